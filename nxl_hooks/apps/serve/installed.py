"""Where this nxl_hooks was installed from, and how a program whose own environment lacks it gets it (standard
library only: the bootstrap of ``nxl run`` loads this file by path, in the program's interpreter).

    install_line("/usr/bin/python3")   # '/usr/bin/python3 -m pip install /home/me/nxl_hooks' (its checkout)
    refusal("/usr/bin/python3")        # None, or why that interpreter cannot run nxl_hooks and what to do
    reach()                            # nxl_hooks importable in this interpreter, and nothing else beside it

No index serves nxl_hooks: pip installs it from a checkout, a wheel or a VCS URL, which the installed distribution
records (PEP 610 ``direct_url.json``).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import shlex
import sys

__all__ = ["BASE", "ROOT", "install_line", "reach", "refusal", "source"]

#: The folder that holds the nxl_hooks package: a site-packages, or the checkout it runs from.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
#: pyproject.toml's dependencies, as imported (tomli only below 3.11), without which nxl_hooks does not record; not
#: rich, which only the command line's printing imports.
BASE = ("torch", "transformers", "safetensors", *(("tomli",) if sys.version_info < (3, 11) else ()))
_PLACEHOLDER = "/path/to/nxl_hooks-checkout-or-wheel"


def source(root: str = ROOT) -> str:
    """What pip installs this nxl_hooks from: the checkout, wheel or VCS URL its distribution in ``root`` was
    installed from (``direct_url.json``), else the checkout ``root`` is, else a placeholder to replace."""
    import importlib.metadata
    import json
    from urllib.parse import unquote, urlparse

    for dist in importlib.metadata.distributions(name="nxl_hooks", path=[root]):
        try:
            direct = json.loads(dist.read_text("direct_url.json") or "null")
            url = direct["url"]
        except (ValueError, TypeError, KeyError):
            continue  # from an index, or a record of another shape: nothing to name
        if isinstance(direct.get("vcs_info"), dict):
            info = direct["vcs_info"]
            return f"{info.get('vcs', 'git')}+{url}" + (f"@{info['commit_id']}" if info.get("commit_id") else "")
        parsed = urlparse(url)
        if parsed.scheme != "file":
            return url
        if os.path.exists(unquote(parsed.path)):  # a checkout or wheel removed since names nothing that works
            return unquote(parsed.path)
    return root if os.path.isfile(os.path.join(root, "pyproject.toml")) else _PLACEHOLDER


def install_line(python: str, root: str = ROOT) -> str:
    """The command that installs this nxl_hooks into the environment of interpreter ``python``."""
    return f"{shlex.quote(python)} -m pip install {shlex.quote(source(root))}"


def refusal(python: str) -> str | None:
    """Why this interpreter (``python``), whose environment has no nxl_hooks, cannot run the one at :data:`ROOT`
    (too old a Python, or a :data:`BASE` package it lacks: nxl's own are not lent, they may be of another Python),
    with the install that fixes it; None when it can."""
    lacking = [name for name in BASE if importlib.util.find_spec(name) is None]
    if sys.version_info < (3, 10):
        lacking.insert(0, "Python 3.10 or newer")
    if not lacking:
        return None
    return (f"not recording: this program's Python ({python}) has no nxl_hooks and lacks {', '.join(lacking)}, "
            f"which it needs; install nxl_hooks into that environment ({install_line(python)}); the program runs "
            "unrecorded")


class _OnlyNxlHooks:
    """On ``sys.meta_path``: finds the top-level ``nxl_hooks`` in :data:`ROOT`, and nothing else (its submodules
    follow from its ``__path__``): the program's other imports stay its own environment's."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        return importlib.machinery.PathFinder.find_spec(name, [ROOT]) if name == "nxl_hooks" else None


def reach() -> None:
    """Make nxl_hooks (and only it) importable here, after the program's own finders."""
    if not any(isinstance(finder, _OnlyNxlHooks) for finder in sys.meta_path):
        sys.meta_path.append(_OnlyNxlHooks())
