"""The package's version, in the bottom layer so that every layer may name it (``nxl --version`` in apps);
``nxl_hooks.__version__`` is this. pyproject.toml and CHANGELOG.md's top section state the same
(tests/process/test_docs.py). Also the lowest torch the package runs on, checked when it is imported."""

import functools
import importlib.metadata
import re
import sys

import torch

VERSION = "0.4.0"

#: pyproject.toml's ``torch>=`` (tests/process/test_extras.py keeps them equal). Below it ``import nxl_hooks``
#: failed on a name torch lacked (``torch.compiler.is_exporting``, torch 2.6) or compiled forwards raised.
TORCH_FLOOR = (2, 11)


#: Packages whose version changes what a model computes or how it is loaded (module: distribution), each named in a
#: record's versions when the process has imported it: a quantized model's numbers are its kernels'.
_RECORDED = {"transformers": "transformers", "bitsandbytes": "bitsandbytes", "peft": "peft", "accelerate": "accelerate",
             "gguf": "gguf", "optimum.quanto": "optimum-quanto", "torchao": "torchao"}


def versions() -> dict[str, str]:
    """What a record was made with, to make it again: ``{"nxl_hooks": "0.4.0", "torch": "2.13.0", "transformers":
    ..., "bitsandbytes": ...}``: nxl_hooks, torch and each package of :data:`_RECORDED` this process imported (one
    never imported computed nothing here)."""
    found = {"nxl_hooks": VERSION, "torch": str(torch.__version__)}
    for module, distribution in _RECORDED.items():
        if module in sys.modules:
            found[distribution] = _installed(module, distribution)
    return found


@functools.lru_cache(maxsize=None)
def _installed(module: str, distribution: str) -> str:
    # once per process: a lookup scans every path entry (ms), and each attach (each explain) records the versions
    try:
        return importlib.metadata.version(distribution)
    except (importlib.metadata.PackageNotFoundError, ValueError):  # imported from a source tree, not installed
        return str(getattr(sys.modules[module], "__version__", "unknown"))


def _check_torch() -> None:
    # One line naming the fix, before the hooks layer imports what an older torch lacks. A user may force an older
    # torch past pip's check (--no-deps, a pinned environment); a version this does not parse is let through.
    found = re.match(r"(\d+)\.(\d+)", str(torch.__version__))
    if found and tuple(map(int, found.groups())) < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        raise ImportError(f"nxl_hooks needs torch >= {floor}, this is torch {torch.__version__}: "
                          f"pip install 'torch>={floor}'")


_check_torch()
