"""Whole files written so that a failure never destroys what was there: a temporary name beside the target, then
one rename over it.

    with replacing("a.safetensors") as fh:
        fh.write(blob)                   # on any error the old a.safetensors is left as it was

Readers (and a crash or SIGKILL half-way) see either the old file or the new one, never half of one. The
temporary file lives in the target's folder (a rename across file systems would not be atomic) and is removed
when the write fails.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO, Iterator

__all__ = ["replacing", "write_bytes", "write_text"]


@contextlib.contextmanager
def replacing(path: str | Path, *, durable: bool = True) -> Iterator[BinaryIO]:
    """A binary file handle whose content replaces ``path`` when the block ends without an error.

    ``durable``: fsync the data before the rename, so that a power loss cannot leave an empty file in place
    of the old one. The new file keeps the old one's permissions (0644 for a new file).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            try:
                mode = stat.S_IMODE(os.stat(path).st_mode)
            except FileNotFoundError:
                mode = 0o644
            os.fchmod(fh.fileno(), mode)
            yield fh
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_bytes(path: str | Path, data: bytes) -> Path:
    """``data`` as the whole content of ``path``, via :func:`replacing`."""
    with replacing(path) as fh:
        fh.write(data)
    return Path(path)


def write_text(path: str | Path, text: str) -> Path:
    """``text`` (UTF-8) as the whole content of ``path``, via :func:`replacing`."""
    return write_bytes(path, text.encode("utf-8"))
