"""The package's version, in the bottom layer so that every layer may name it (``nxl --version`` in apps);
``nxl_hooks.__version__`` is this. pyproject.toml and CHANGELOG.md's top section state the same
(tests/process/test_docs.py). Also the lowest torch the package runs on, checked when it is imported."""

import re

import torch

VERSION = "0.4.0"

#: pyproject.toml's ``torch>=`` (tests/process/test_extras.py keeps them equal). Below it ``import nxl_hooks``
#: failed on a name torch lacked (``torch.compiler.is_exporting``, torch 2.6) or compiled forwards raised.
TORCH_FLOOR = (2, 11)


def _check_torch() -> None:
    # One line naming the fix, before the hooks layer imports what an older torch lacks. A user may force an older
    # torch past pip's check (--no-deps, a pinned environment); a version this does not parse is let through.
    found = re.match(r"(\d+)\.(\d+)", str(torch.__version__))
    if found and tuple(map(int, found.groups())) < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        raise ImportError(f"nxl_hooks needs torch >= {floor}, this is torch {torch.__version__}: "
                          f"pip install 'torch>={floor}'")


_check_torch()
