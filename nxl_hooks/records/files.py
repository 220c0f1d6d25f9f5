"""Whole files written so that a failure never destroys what was there: a temporary name beside the target, then
one rename over it; and user files read safely (:func:`read_regular`).

    with replacing("a.safetensors") as fh:
        fh.write(blob)                   # on any error the old a.safetensors is left as it was

Readers (and a crash or SIGKILL half-way) see either the old file or the new one, never half of one. The
temporary file lives in the target's folder (a rename across file systems would not be atomic) and is removed
when the write fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Iterator

__all__ = ["CHUNK", "STREAM_MAGIC", "cannot_write_in", "file_in_the_way", "file_kind", "json_value", "not_a_folder",
           "read_regular", "replacing", "too_large", "unmade", "unwritable", "user_path", "write_bytes", "write_text"]

#: Bytes per read (and per checksum) of a user file: Ctrl-C is seen between two chunks, never after a huge one.
CHUNK = 8 << 20

#: A stream file's first line: this, its format's number, a newline. Here, below both readers, so that
#: ``Attribution.load`` tells a stream file given to it (``--generate --out a.safetensors``) from a broken attribution.
STREAM_MAGIC = b"nxl_hooks.stream/"


@contextlib.contextmanager
def replacing(path: str | Path, *, durable: bool = True) -> Iterator[BinaryIO]:
    """A binary file handle whose content replaces ``path`` when the block ends without an error.

    ``durable``: fsync the data before the rename, so that a power loss cannot leave an empty file in place
    of the old one. The new file keeps the old one's permissions (0644 for a new file).
    """
    path = Path(path)
    why = unwritable(path)
    if why is not None:
        raise ValueError(why)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as error:  # named after the target, not the temporary file next to it
        raise type(error)(error.errno, f"{path}: no file can be made in {path.parent} ({error.strerror})") from None
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


def unwritable(path: str | Path) -> str | None:
    """Why a result cannot replace ``path`` (one line), or None: what is there must be a regular file, not a
    symbolic link (the rename would put a file in its place: ``/dev/null``, a FIFO, a link planted where results go)
    nor anything else."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    kind = file_kind(mode)
    if not kind:
        return None
    return f"{path} is {kind}, not a regular file: nxl_hooks writes results only as regular files; give another path"


def user_path(path: str | Path) -> Path:
    """``path`` with a leading ``~`` or ``~user`` expanded: ``user_path("~/runs/a.nxl")``. A ``~user`` of no user on
    this machine (or ``~`` with no home to find) is a one-line ValueError naming the path: pathlib raises a bare
    RuntimeError, which read as a crash of nxl_hooks."""
    try:
        return Path(path).expanduser()
    except RuntimeError:
        raise ValueError(f"{path}: {Path(path).parts[0]} names no home folder on this machine (no such user); "
                         "spell the path out, or name a user that exists") from None


def _nearest(path: Path) -> Path | None:
    """``path`` or the nearest folder above it that exists (None when none does)."""
    return next((where for where in (path, *path.parents) if where.exists()), None)


def file_in_the_way(path: Path) -> Path | None:
    """The file that keeps ``path`` from being a folder: ``path`` itself, or the nearest folder above it that exists,
    when that is a file; None when there is none (missing folders are made). ``file_in_the_way(Path("a.txt/x"))``"""
    where = _nearest(path)
    return where if where is not None and not where.is_dir() else None


def not_a_folder(path: str | Path) -> str | None:
    """Why ``path`` cannot be a folder to write into (one line), or None: it, or a folder above it, is a file (a
    missing folder is created when written)."""
    target = user_path(path)
    where = _nearest(target)  # (one walk up: the file in the way, or the folder to write in)
    if where is None:
        return None
    if not where.is_dir():
        return f"{path}: {where} is a file, not a folder; give a folder (it is created when missing)"
    return cannot_write_in(target, path)


def unmade(path: str | Path, folder: str | Path, error: OSError) -> str:
    """The one line saying that ``folder``, missing on the way to ``path``, cannot be made (``error``)."""
    return f"{path}: the folder {folder} cannot be made ({error.strerror or error}): give a folder you can write in"


def cannot_write_in(folder: str | Path, path: str | Path) -> str | None:
    """Why no file can be written in ``folder`` (to write ``path``, named in the line), or None: tried as the
    writer would, then undone (where the first missing folder goes, a folder of a name of its own made and removed;
    in an existing one, a file). Never the path's own folder: the processes of a sharded run (each rank checks its
    --out) would find it made, or removed, by another's check. Permission bits do not tell it: root may write
    anywhere by them, yet nothing is made in /proc or on a read-only mount; and a check before a model loads spares
    the load. ``why = cannot_write_in(out.parent, out)``"""
    folder = Path(folder)
    missing = [where for where in (folder, *folder.parents) if not where.exists()]
    with contextlib.suppress(OSError):
        if os.stat(missing[-1].parent if missing else folder).st_uid != os.geteuid():
            return None  # nothing is made in another user's folder (root attaching: the writer's own checks refuse)
    try:
        if missing:
            os.rmdir(tempfile.mkdtemp(prefix=".nxl-probe-", dir=missing[-1].parent))
        else:
            fd, probe = tempfile.mkstemp(prefix=".nxl-probe-", dir=folder)
            os.close(fd)
            os.unlink(probe)
    except OSError as error:
        if missing:
            return unmade(path, missing[-1], error)
        return f"{path}: nothing can be written in the folder {folder} ({error.strerror or error}): give a folder " \
               "you can write in"
    return None


def write_bytes(path: str | Path, data: bytes) -> Path:
    """``data`` as the whole content of ``path``, via :func:`replacing`."""
    with replacing(path) as fh:
        fh.write(data)
    return Path(path)


def write_text(path: str | Path, text: str) -> Path:
    """``text`` (UTF-8) as the whole content of ``path``, via :func:`replacing`."""
    return write_bytes(path, text.encode("utf-8"))


def read_regular(path: str | Path, error: type[Exception] = ValueError, *, follow_symlinks: bool = True,
                 max_bytes: int | None = None, dir_fd: int | None = None) -> bytearray:
    """The whole content of ``path``, which must be a regular file. ``data = read_regular("run.nxl")``

    A FIFO, device or socket is refused (``error``, one line) before it is opened, so a reader never blocks on a
    FIFO nor reads ``/dev/zero`` forever; the file is opened non-blocking and checked again (it may have been
    swapped), the buffer is the file's real size (a file that does not fit in memory is ``error`` too), and it is
    read in :data:`CHUNK` pieces so that Ctrl-C interrupts a long read. A file that grows meanwhile is read up to
    the size it had when opened.
    ``follow_symlinks=False``: a symbolic link is refused too (a file in a folder someone else may write);
    ``max_bytes``: a larger file is refused before anything is read. ``dir_fd``: ``path`` is relative to that open
    folder (one whose path someone else may have swapped since it was opened)."""
    if not isinstance(path, (str, os.PathLike)):  # an int is a file descriptor to os.stat: another file's
        raise error(f"{path!r} is not a file path: give the path of the file to read, as a str or pathlib.Path")
    kind = file_kind(os.stat(path, dir_fd=dir_fd, follow_symlinks=follow_symlinks).st_mode)
    if kind:
        raise error(f"{path} is {kind}, not a regular file: nxl_hooks reads records only from regular files")
    nofollow = 0 if follow_symlinks else os.O_NOFOLLOW
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | nofollow | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
    try:
        info = os.fstat(fd)
        kind = file_kind(info.st_mode)
        if kind:
            raise error(f"{path} is {kind}, not a regular file: nxl_hooks reads records only from regular files")
        if max_bytes is not None and info.st_size > max_bytes:
            raise error(f"{path} holds {info.st_size} bytes, more than the {max_bytes} expected there")
        # read, not mapped: a mapped file that another process truncates (a new sink taking its path over) kills the
        # reader with SIGBUS at its next look
        try:
            data, done = bytearray(info.st_size), 0
        except MemoryError:
            raise error(too_large(path, info.st_size)) from None
        with memoryview(data) as view, os.fdopen(fd, "rb", buffering=0, closefd=False) as fh:
            while done < len(data):
                got = fh.readinto(view[done: done + CHUNK])
                if not got:
                    break
                done += got
        del data[done:]  # a file that shrank while being read: what it holds now
        return data
    finally:
        os.close(fd)


def json_value(text: str | bytes | bytearray) -> Any:
    """``json.loads`` of text from outside (a user's file, another process's answer, a request body): whatever is
    not JSON is a ValueError with a short reason and no Python internals, nesting too deep for Python's parser
    (``[[[[...``, a RecursionError, not a ValueError) and bytes that are not UTF-8 included.
    ``json_value(b"[" * 200000)`` raises ValueError("nested too deeply to read")."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply to read") from None
    except json.JSONDecodeError as err:  # (where, as json says it, less its character offset)
        where = f"column {err.colno}" if err.lineno == 1 else f"line {err.lineno} column {err.colno}"
        raise ValueError(f"{err.msg}: {where}") from None
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None


def too_large(path: str | Path, size: int) -> str:
    """One line for a file of ``size`` bytes that does not fit in memory (records files are read whole)."""
    return (f"{path} holds {size} bytes, more than this machine's free memory can hold (nxl_hooks reads a records "
            "file whole): read it on a machine with more memory free")


def file_kind(mode: int) -> str:
    """'' for a regular file, else what it is, in words."""
    for test, name in ((stat.S_ISREG, ""), (stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a file"
