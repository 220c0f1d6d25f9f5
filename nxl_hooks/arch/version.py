"""The package's version, in the bottom layer so that every layer may name it (``nxl --version`` in apps);
``nxl_hooks.__version__`` is this. pyproject.toml and CHANGELOG.md's top section state the same
(tests/process/test_docs.py)."""

VERSION = "0.4.0"
