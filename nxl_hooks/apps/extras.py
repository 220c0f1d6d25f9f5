"""Optional extras: which ``pip install "nxl_hooks[...]"`` a missing package calls for, said in one line.

    extra_hint(ModuleNotFoundError(name="captum"))    # 'this needs captum, from an optional extra: pip install ...'
    require_extra("serve", ["fastapi", "uvicorn"], "transformers serve")   # CliError when one is missing

:func:`nxl_hooks.apps.cli.main` turns an ImportError (ours, or transformers' "Please install gguf ...") that names
a package of an extra into that one line and exit code 2.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from typing import Sequence

from ..arch.text import install_command
from .options import CliError

__all__ = ["EXTRAS", "NOISE", "SERVE_MODULES", "extra_hint", "extra_line", "quiet_library_noise", "require_extra"]

#: Each optional package (as imported, or as pip names it) -> the nxl_hooks extra that installs it (pyproject.toml);
#: accelerate is in [gguf] too, which an ImportError for GGUF reading names itself.
EXTRAS = {
    "gguf": "gguf",
    "accelerate": "big", "bitsandbytes": "big", "peft": "big",
    "optimum": "quant", "optimum.quanto": "quant", "optimum-quanto": "quant", "optimum_quanto": "quant",
    "torchao": "quant",
    "captum": "eval", "scipy": "eval", "tqdm": "eval", "jinja2": "eval",
    "pyarrow": "parquet",
    "fastapi": "serve", "uvicorn": "serve", "openai": "serve", "pydantic": "serve", "starlette": "serve",
}
#: What ``transformers serve`` imports (transformers' own ``serving`` extra, which nxl_hooks[serve] installs).
SERVE_MODULES = ("fastapi", "uvicorn", "openai", "pydantic", "starlette")
_NAMED = re.compile(r'pip install "nxl_hooks\[(\w+)\]"')
_WORD = re.compile(r"(?<![\w.-])(" + "|".join(sorted(map(re.escape, EXTRAS), key=len, reverse=True)) + r")(?![\w-])")


def extra_line(package: str, extra: str) -> str:
    """The one line saying that ``package`` comes with the optional extra ``extra``."""
    return f"this needs {package}, from the optional extra [{extra}]: {install_command(extra)}"


def extra_hint(error: BaseException) -> str | None:
    """The one line to print for an error that a missing optional package caused (an ImportError naming the
    module, or a message such as transformers' "Please install torch and gguf>=0.10.0"); None for any other."""
    name = getattr(error, "name", None) if isinstance(error, ImportError) else None
    if name:
        top = name.split(".")[0]
        named = _NAMED.search(str(error))  # a package several extras carry: the error knows which one it needs
        for candidate in (name, top):
            if candidate in EXTRAS:
                return extra_line(candidate, named.group(1) if named else EXTRAS[candidate])
        if named:  # a package no extra here lists, from an error that names its extra (a built-in sink kind's)
            return extra_line(top, named.group(1))
    message = str(error)
    if not isinstance(error, ImportError) and "install" not in message:
        return None  # a ValueError that only mentions a package is about something else
    found = _WORD.search(message)
    return extra_line(found.group(1), EXTRAS[found.group(1)]) if found else None


def require_extra(extra: str, modules: Sequence[str], what: str) -> None:
    """Raise :class:`CliError` (one line naming the extra) when one of ``modules`` cannot be imported, before
    anything is started. ``require_extra("serve", ["fastapi"], "transformers serve")``"""
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package missing, or a module hidden (None in sys.modules)
            found = False
        if not found:
            raise CliError(f"{what}: " + extra_line(module, extra))


#: Warnings libraries log that say nothing true about the user's run: logger name -> the start of the message
#: (torchao's kernels built for another CUDA or Python; torchao registering Enums the old way with torch; a
#: tokenizer's ``model_max_length`` below the model's positions, a saved fine-tune's habit: every command checks the
#: model's own limit, ``check_length``, and refuses a longer text in its own line).
NOISE = {
    "torchao": "Failed to load ",
    "torch.utils._pytree": "%s is an Enum subclass and is now natively supported by torch.compile",
    "transformers.tokenization_utils_base": "Token indices sequence length is longer than the specified maximum",
}


class _Noise(logging.Filter):
    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno <= logging.WARNING and str(record.msg).startswith(self.start))


def quiet_library_noise() -> None:
    """Drop exactly the :data:`NOISE` records, on their own loggers (every other warning of those libraries, and
    every warning of any other, still shows). Called once by ``nxl``; idempotent."""
    for name, start in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Noise) and f.start == start for f in logger.filters):
            logger.addFilter(_Noise(start))
