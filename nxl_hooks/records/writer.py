"""The crash-safe stream file's writer: every call and step record appended as it is made, readable after a SIGKILL.

    with nxl.attach(model, sink="run.nxl"):
        model.generate(**enc, max_new_tokens=32)
    nxl.read_stream("run.nxl")[0].steps      # the records, read back from disk (:mod:`nxl_hooks.records.reader`)

Format (no pickle): the line ``nxl_hooks.stream/2\\n``, then frames. A frame is ``b"NXLF"``, the payload
length (uint64 little-endian), its CRC-32 (uint32 little-endian) and the payload: a safetensors blob whose
``nxl_hooks`` metadata entry is JSON with a ``kind`` of ``call`` (prompt; an empty (0, 0) ``prompt_mask`` for a
call whose prompt never ran recorded, whose end frame follows), ``step`` or ``end`` (sequences), and
``seq``, the frame's number in its file (0, 1, 2...). A step frame names its call and step index (``first_kept``
true on a call's first step kept where a rotating sink deleted the steps before it); a rotated file's first frame
(``kind`` ``file``) names the file's number and its writer. Files of format 1 (nxl_hooks 0.1: no
``seq``, no ``file`` frame) still read, with the reader's step checks. A ``call`` frame also carries
``model``, ``started``, ``special_ids``, ``target_texts`` (each fixed target id's text, keyed by the id as a
string), ``separator`` (only where its tokenizer's decode puts one between tokens), ``continuation`` and
``cleanup`` (only for a WordPiece tokenizer: its prefix, and whether its decoder cleans up), ``clean_up_spaces``
(only where its decode cleans up the joined text), a ``step`` frame its
``time`` and an ``end`` frame ``ended``: optional entries of format 2, which older readers skip; records read
from older files without them have None there (``tests/data/stream-v2.nxl`` is such a file). A ``step`` frame
holds the scores of NormXLogit and LogAt as the tensors ``normxlogit`` and ``logat``, and those of any other
method the probe computed as ``scores.<method>`` (older readers skip them too).
Frames are appended whole and in order (one ``write`` per frame, or per batch of step frames:
:meth:`Sink.write_steps`), so a process killed with SIGKILL leaves every frame it wrote readable, the last one
possibly torn. ``Sink(path, fsync=True)`` also survives power loss, at the cost of
an fsync per step. A sink refuses to write through a symbolic link unless ``Sink(path, follow_symlinks=True)``.

A server that runs for weeks writes to a :class:`RotatingSink`: a folder of numbered files, a new one when the
current one would pass ``max_bytes``, the oldest deleted beyond ``max_files``. Every file is a stream file of its
own (the calls still running when it starts are written again at its top), and ``read_stream(folder)`` reads
them in order::

    nxl.attach(model, sink=nxl.RotatingSink("runs/llm", max_bytes=64 << 20, max_files=16))
    nxl.read_stream("runs/")                  # every call in every folder below, oldest file first
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import itertools
import json
import os
import re
import struct
import threading
import weakref
import zlib
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from .attribution import scores_to_store, write_blob
from .files import STREAM_MAGIC, file_kind
from .steps import STEP_TENSORS, GenerationCall, Step

__all__ = ["PartlyWritten", "RotatingSink", "Sink", "encode_call", "encode_end", "encode_step", "stream_bytes"]

#: The sink kinds made here (:data:`nxl_hooks.records.sinks.DECLARED`): ``file:PATH``, ``folder:PATH``. ``"arg":
#: "file"``: ARG is a file, which the sink makes in a folder that must be there (a RotatingSink makes its folder).
SINKS = {"file": {"factory": "Sink", "arg": "file"}, "folder": {"factory": "RotatingSink"}}

_FORMAT = 2  # the stream format written (a later one's files are refused as such, naming it)
_FILE_MAGIC = STREAM_MAGIC + b"%d\n" % _FORMAT  # version 1 (nxl_hooks 0.1, no frame numbers) still reads
_MAGIC_V1 = STREAM_MAGIC + b"1\n"  # nxl_hooks 0.1, no frame numbers: still read
_FRAME = struct.Struct("<4sQI")
_FRAME_MAGIC = b"NXLF"
def _encode(tensors: dict[str, torch.Tensor], header: dict, seq: int | None = None) -> bytes:
    """One frame: magic, length, CRC-32, then the safetensors payload whose metadata holds ``header`` (and ``seq``,
    the frame's number in its file)."""
    if seq is not None:
        header = {**header, "seq": seq}
    metadata = {"nxl_hooks": json.dumps(header)}
    # records hold CPU tensors outside autograd already (a step's): detach / move only when one is not
    if not all(value.is_cpu and not value.requires_grad for value in tensors.values()):
        tensors = {name: value.detach().cpu() for name, value in tensors.items()}
    payload = write_blob(tensors, metadata)
    return _FRAME.pack(_FRAME_MAGIC, len(payload), zlib.crc32(payload)) + payload


def encode_call(call: GenerationCall, meta: dict, *, seq: int | None = None) -> bytes:
    """The ``call`` frame of a call (``meta``: what the probe explains; ``seq``: the frame's number in its file,
    which the reader checks). A call whose prompt never ran recorded (not recorded, or ended before its first
    forward) has an empty (0, 0) ``prompt_mask``, read back as None: its end frame says why."""
    # the mask is read once, and the rest only with it: a call detached while its prompt was being recorded has
    # some of its prompt's fields set but no mask yet (Hub.prompt sets the mask last)
    mask = call.prompt_mask
    prompted = mask is not None
    tensors = {"prompt_mask": mask if prompted else torch.zeros(0, 0, dtype=torch.bool)}
    if prompted and call.prompt_ids is not None:
        tensors["prompt_ids"] = call.prompt_ids
    if prompted and call.prompt_template is not None:
        tensors["prompt_template"] = call.prompt_template
    return _encode(tensors, {"kind": "call", "call": call.index, "layers": call.layers, "meta": meta,
                             "request_id": call.request_id, "thread": call.thread,
                             **({"choice": call.choice.to_json()} if call.choice is not None else {}),
                             "readable": call.readable if prompted else None,
                             "model": call.model, "started": call.started, "special_ids": call.special_ids,
                             # JSON keys are texts: {"348": "␣Paris"}
                             "target_texts": call.target_texts if prompted else None,
                             **({"separator": call.separator} if call.separator else {}),
                             **({"continuation": call.continuation} if call.continuation else {}),
                             **({"cleanup": True} if call.cleanup else {}),
                             **({"clean_up_spaces": True} if call.clean_up_spaces else {})}, seq)


def encode_step(step: Step, *, seq: int | None = None, first_kept: bool = False) -> bytes:
    """The ``step`` frame of one record (its call and step index, checked against the one before it on reading).
    ``first_kept``: the first step kept of a call whose earlier steps a rotating sink deleted (:func:`stream_bytes`),
    which a reader takes as its call's first."""
    tensors = {**{name: getattr(step, name) for name in STEP_TENSORS}, **scores_to_store(step.scores)}
    if step.probability is not None:
        tensors["probability"] = step.probability
    return _encode(tensors, {"kind": "step", "call": step.call, "step": step.step, "position": step.position,
                             "layers": step.layers, "n_blocks": step.n_blocks, "readable": step.readable,
                             "time": step.time, **({"first_kept": True} if first_kept else {})}, seq)


def encode_end(call: GenerationCall, *, seq: int | None = None) -> bytes:
    """The ``end`` frame of a call that returned (or stopped being recorded), with its notes where it has some."""
    tensors = {"sequences": call.sequences} if call.sequences is not None else {}
    notes = {"notes": list(call.notes)} if call.notes else {}
    return _encode(tensors, {"kind": "end", "call": call.index, "complete": call.complete, "error": call.error,
                             "ended": call.ended, **notes}, seq)


def stream_bytes(call: GenerationCall, meta: dict) -> bytes:
    """One call as a whole stream file (``read_stream`` reads it back): its call frame, its kept steps and, once
    it has ended, its end frame. A call read from a rotating sink's folder whose first steps were deleted starts at
    its first kept step, marked so (``first_kept``): the reader takes it as such, not as steps missing.
    ``Path("req.nxl").write_bytes(stream_bytes(probe.calls[-1], probe.describe()))``"""
    ended = call.complete or call.error is not None or call.sequences is not None
    if call.prompt_mask is None and not ended:
        raise ValueError(f"call {call.index} has no recorded prompt yet: nothing to write")
    steps = list(call.steps)
    frames = [encode_call(call, meta, seq=0), *(encode_step(step, seq=n, first_kept=n == 1 and step.step > 0)
                                                for n, step in enumerate(steps, 1))]
    if ended:
        frames.append(encode_end(call, seq=len(frames)))
    return b"".join([_FILE_MAGIC, *frames])


def _later_format(data: bytes | bytearray) -> int | None:
    """The format number of a stream file a later nxl_hooks wrote (its first line ``nxl_hooks.stream/3``), else
    None: such a file is a stream this version cannot read, not some other file."""
    line = bytes(data[len(STREAM_MAGIC): len(STREAM_MAGIC) + 20]).split(b"\n", 1)
    if not data.startswith(STREAM_MAGIC) or len(line) < 2 or not line[0].isdigit():
        return None
    number = int(line[0])
    return number if number > _FORMAT else None


def _holds_stream(head: bytes) -> bool:
    """Whether a file that begins with ``head`` (its first ``len(_FILE_MAGIC)`` bytes) is a stream file as
    :func:`~nxl_hooks.records.reader.read_stream` reads one: a file header of either version, or the start of the
    current one, where its writer was killed (or an empty file)."""
    return head.startswith((_FILE_MAGIC, _MAGIC_V1)) or _FILE_MAGIC.startswith(head)


def _open(path: Path, mode: int, *, follow_symlinks: bool = False) -> int:
    """A new (or emptied) stream file holding only the file magic, held for this writer (:func:`claim_file`). A
    file that holds something other than a stream (a Parquet file given without ``parquet:``, anyone's data) is
    refused (ValueError, one line), never emptied. A file it created whose magic could not be written (a full disk)
    is removed: left there, it would read as a writer that stopped before its first record."""
    fd, created = claim_file(path, mode, follow_symlinks=follow_symlinks, readable=True)
    try:
        head = os.pread(fd, len(STREAM_MAGIC) + 21, 0)
        if (later := _later_format(head)) is not None:  # (a stream all the same: said so, and never emptied)
            raise ValueError(f"{path} is a stream file of format {later}, which a later nxl_hooks wrote and a stream "
                             "sink would empty: give another path, or remove the file first")
        if not _holds_stream(head[:len(_FILE_MAGIC)]):
            kind = " (a Parquet sink is 'parquet:PATH')" if path.suffix == ".parquet" else ""
            raise ValueError(f"{path} holds something other than an nxl_hooks stream, which a stream sink would "
                             f"empty: give another path, or remove the file first{kind}")
        os.ftruncate(fd, 0)
        _write_all(fd, _FILE_MAGIC)
    except BaseException as error:
        if created:  # removed while still held, so no other writer can have it; one put in its place is left
            with contextlib.suppress(OSError):
                if os.path.samestat(os.fstat(fd), os.lstat(path)):
                    os.unlink(path)
        os.close(fd)  # a full disk at the first byte: no descriptor kept on a file nothing will write
        if isinstance(error, OSError) and error.filename is None:  # said with the file it could not start
            raise OSError(error.errno, error.strerror, str(path)) from None
        raise
    return fd


def claim_file(path: Path, mode: int, *, follow_symlinks: bool = False, unlocked_if_new: bool = False,
                readable: bool = False) -> tuple[int, bool]:
    """A descriptor of the regular file ``path`` (created when missing, left as it is: the caller empties it) and
    whether this call created it (``O_EXCL`` first: no window between a check and the open), open for writing and
    locked for this writer (:func:`_claim`): one that another writer holds is refused (ValueError) and left as it
    is; one that a writer no longer holds (it closed, crashed, was killed) is this writer's. A symbolic
    link is refused (ValueError) unless ``follow_symlinks``: O_NOFOLLOW makes the check and the open one step, with
    no window to swap a link in. The one-writer rule of every records file (stream files, the Parquet sink's).
    ``unlocked_if_new``: on a file system without locks, a file that was there before is refused (ValueError): no
    lock tells a live writer's from a dead one's, and a caller that empties what it takes would empty a live one.
    ``readable``: open for reading too (a caller that looks at what it takes before emptying it)."""
    # non-blocking: a FIFO without a reader is refused at once, not waited on (its open would block the host); not
    # truncated by the open: only once this writer holds the file
    flags = ((os.O_RDWR if readable else os.O_WRONLY) | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK
             | (0 if follow_symlinks else os.O_NOFOLLOW))
    try:
        try:
            fd, created = os.open(path, flags | os.O_EXCL, mode), True
        except FileExistsError:  # (a link too: O_EXCL never follows one; the open below refuses it)
            fd, created = os.open(path, flags, mode), False
    except OSError as err:
        if err.errno == errno.ELOOP and not follow_symlinks:
            raise ValueError(f"{path} is a symbolic link: nxl_hooks does not write records through a link unless "
                             "told to; give the real path (for a stream file, or Sink(path, follow_symlinks=True))"
                             ) from None
        if err.errno == errno.ENXIO:
            raise ValueError(f"{path} is a FIFO (named pipe), not a regular file: nxl_hooks writes records only "
                             "to a regular file; give another path") from None
        raise
    kind = file_kind(os.fstat(fd).st_mode)
    if kind:  # a FIFO with a reader, a device: the records go to a file, whole frames that read back
        os.close(fd)
        raise ValueError(f"{path} is {kind}, not a regular file: nxl_hooks writes records only to a regular file; "
                         "give another path")
    try:
        if not _claim(fd, path, "path") and unlocked_if_new and not created:
            raise ValueError(f"{path} exists, and its file system has no locks to tell whether another sink still "
                             "writes it: if none does (a crashed run left it), remove it; else give another path")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)  # refused: no descriptor kept on a file another writer holds
        raise
    return fd, created


def _claim(fd: int, path: Path, kind: str) -> bool:
    """Lock ``fd`` (a stream file, or a RotatingSink's folder) for this writer, until every copy of it is closed
    (a forked child's copy shares the lock). ValueError when another writer holds it: two models or processes
    given one ``kind`` of place would interleave their frames, numbered alike, into a stream no one can read. A file
    system without locks leaves it unlocked: False."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ValueError(f"{path} is being written by another sink (a second model or process): give each its own "
                         f"{kind}, or detach the other first") from None
    except OSError:  # no locks there (ENOLCK, EOPNOTSUPP): written as before, unguarded
        return False
    return True


def _finish(fd: int) -> None:
    """fsync and close a stream file's descriptor; closed even when fsync fails (a full disk, an I/O error)."""
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class PartlyWritten(Exception):
    """A write of several step frames failed (its ``__cause__``) after the first ``written`` were whole on disk:
    a full disk takes a write's first bytes, then refuses the rest."""

    def __init__(self, written: int) -> None:
        super().__init__(f"{written} frame(s) written before the failure")
        self.written = written


#: What a sink writes: a function of the frame's number in its file that returns the frame.
Frame = Callable[[int], bytes]


class Sink:
    """Append-only, crash-safe record file (format in the module docstring). ``attach(..., sink=Sink(p, fsync=True))``

    The file is created (or emptied, when it holds a stream) when the probe attaches; read it with
    :func:`read_stream`. A file that holds anything else is refused (ValueError), never emptied. One writer per
    file: a path another sink has open (a second model or process) is refused (ValueError) and left as it is, until
    that sink is closed. A path that is a symbolic link is refused (ValueError), so that a link planted where the
    file goes cannot redirect the records (and the truncation) onto another file; ``follow_symlinks=True`` writes through it. A sink belongs to the
    process that opened it: a child it forks that writes to it gets a RuntimeError (an attached probe never does;
    it keeps the child's records in memory and says so). A file deleted while it is written (it, or its folder) fails
    the next write (FileNotFoundError), which would otherwise go into a file nobody can read again.
    """

    _mode = 0o644

    def __init__(self, path: str | Path, *, fsync: bool = False, follow_symlinks: bool = False) -> None:
        self.path = Path(path)
        self._fsync = fsync
        self._follow = follow_symlinks
        self._lock = threading.Lock()  # calls in several threads share one file: one frame at a time
        self._fd: int | None = None
        self._take()
        self._seq = 0  # the next frame's number in the current file
        self._reached = 0  # the file offset the last write that failed reached (PartlyWritten)
        self._pid = os.getpid()
        held(self)

    def _take(self) -> None:
        """Open ``self.path`` (created, or emptied) as the file written from now on."""
        self._fd = _open(self.path, self._mode, follow_symlinks=self._follow)
        # a file system that counts no links (0 on a file just opened) never tells a deleted file from another
        self._counted = os.fstat(self._fd).st_nlink > 0

    def _forked(self) -> None:
        """In a child just forked (one thread): its copy of the descriptor goes, so that the lock on the file ends
        with the parent's close, not with the last child's exit (the child's writes are refused: :meth:`_owned`)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def _owned(self) -> None:
        """Refuses a write from a process forked from the sink's own: its frames would interleave with the
        parent's in one file. Checked before the lock, which a thread of the parent may have held at the fork."""
        if os.getpid() != self._pid:
            raise RuntimeError(f"sink {self.path} belongs to process {self._pid}, which this one ({os.getpid()}) "
                               "forked from: its frames would interleave with that process's; open a sink of its "
                               "own in this process")

    def _put(self, frame: Frame, *, opens: int | None = None, closes: int | None = None) -> None:
        """Append one frame; ``opens`` / ``closes``: the index of the call it starts or ends."""
        self._owned()
        with self._lock:
            self._append(frame(self._seq))

    def _put_many(self, frames: list[Frame]) -> None:
        """Append several frames with one write; failing, :class:`PartlyWritten` says how many were whole."""
        self._owned()
        with self._lock:
            self._append_many([frame(self._seq + n) for n, frame in enumerate(frames)])

    def _append_many(self, data: list[bytes]) -> int:
        """Write frames ``data`` with one write (see :meth:`_append`); failing, :class:`PartlyWritten` says how many
        were whole. Caller holds the lock."""
        start = self._offset()
        try:
            return self._append(b"".join(data), len(data))
        except OSError as error:
            done = self._reached - start if start is not None else 0
            raise PartlyWritten(sum(1 for end in itertools.accumulate(map(len, data)) if end <= done)) from error

    def _offset(self) -> int | None:
        """Where the next write lands in the file (None where that cannot be told)."""
        try:
            return os.lseek(self._fd, 0, os.SEEK_CUR) if self._fd is not None else None
        except OSError:
            return None

    def _append(self, data: bytes, frames: int = 1) -> int:
        """Write ``frames`` frames, the first made with number ``self._seq``; their size. Caller holds the lock."""
        if self._fd is None:
            raise RuntimeError(f"sink {self.path} is closed: the probe it belonged to has detached, or a write to "
                               "it failed")
        try:
            if self._counted and os.fstat(self._fd).st_nlink == 0:
                # deleted (it, or its folder) while open: writes would go on, into a file nobody can read again
                raise FileNotFoundError(errno.ENOENT, f"{os.strerror(errno.ENOENT)}: deleted (it, or its folder) "
                                        "while the sink wrote it, with the records in it", str(self.path))
            _write_all(self._fd, data)
            if self._fsync:
                os.fsync(self._fd)
        except OSError:
            # A full disk (or an I/O error): the probe drops this sink (its fault), so nothing writes here again;
            # the descriptor goes now, or the file system could not be unmounted while the host runs.
            self._reached = self._offset() or 0
            os.close(self._fd)
            self._fd = None
            raise
        self._seq += frames
        return len(data)

    def write_call(self, call: GenerationCall, meta: dict) -> None:
        self._put(functools.partial(_numbered, encode_call, call, meta), opens=call.index)

    def write_step(self, step: Step) -> None:
        self._put(functools.partial(_numbered, encode_step, step))

    def write_steps(self, steps: list[Step]) -> None:
        """Several step records in order, with one write (the probe's sink thread hands over what waits at once):
        killed mid-write, the file ends with whole frames and at most one torn one. ``sink.write_steps(steps)``"""
        self._put_many([functools.partial(_numbered, encode_step, step) for step in steps])

    def write_end(self, call: GenerationCall) -> None:
        self._put(functools.partial(_numbered, encode_end, call), closes=call.index)

    def close(self) -> None:
        if os.getpid() != self._pid:  # a forked child let go of its copy of the descriptor at the fork (_forked)
            return
        with self._lock:
            if self._fd is not None:
                fd, self._fd = self._fd, None
                _finish(fd)


class _Held(Protocol):
    """A writer holding a :func:`claim_file` descriptor (a :class:`Sink`, a ParquetSink)."""

    def _forked(self) -> None:
        """In a forked child: let go of the descriptor, so that the file's lock ends with its writer."""


#: The writers of this process: a child it forks lets go of their descriptors at once (:meth:`_Held._forked`).
_OPEN: "weakref.WeakSet[_Held]" = weakref.WeakSet()


def held(writer: _Held) -> None:
    """Count ``writer`` among this process's writers: a child it forks lets go of its descriptor at once."""
    _OPEN.add(writer)


def _after_fork() -> None:
    for sink in list(_OPEN):
        sink._forked()


os.register_at_fork(after_in_child=_after_fork)


def _numbered(encode: Callable[..., bytes], *args: Any) -> Frame:
    """``encode(*args, seq=n)`` as a :data:`Frame`: frames are numbered when written, under the sink's lock."""
    *args, seq = args
    return encode(*args, seq=seq)


#: A rotated file's name: its number in the folder, then the number of the first file its writer made; eight digits
#: at least (numbers go on past 99999999: a folder's retention and its readers keep following them, in their order).
_ROTATED = re.compile(r"(\d{8,})-(\d{8,})\.nxl")


def _rotated(folder: Path) -> list[tuple[int, int, Path]]:
    """(number, writer, path) of the rotated files in ``folder``, oldest first."""
    found = []
    for path in folder.iterdir():
        match = _ROTATED.fullmatch(path.name)
        if match and path.is_file():
            found.append((int(match.group(1)), int(match.group(2)), path))
    return sorted(found)


class RotatingSink(Sink):
    """A :class:`Sink` over a folder of numbered files, for processes that run for weeks.

    ``attach(model, sink=RotatingSink("runs/llm", max_bytes=64 << 20, max_files=16))``

    - A new file starts when the next frame would take the current one past ``max_bytes`` (a frame is never
      split, so one larger step record makes one larger file); the calls still running are written again at the
      top of the new file, so every file reads on its own. Where those frames with the next one pass ``max_bytes``
      (a long prompt's texts), a file takes about ``max_bytes`` of records after them before the next starts: a
      new file at each step would write them again, once per step.
    - Beyond ``max_files`` files in the folder the oldest are deleted: the folder holds at most about
      ``max_files * max_bytes`` bytes.
    - Files are named ``<number>-<writer>.nxl`` (eight digits each, more past 99999999): numbers go on from the
      files already in the folder (a new writer, say after a restart, never overwrites), and ``<writer>`` tells
      which files one writer made, so that ``read_stream(folder)`` joins them in order. Each file's first frame
      carries its number and writer too, so that a missing file between two kept ones (or a renamed one) is
      reported as damage.
    - One writer per folder at a time: a second one (another model or process given the folder) is refused with a
      ValueError while the first is open.
    - Files and a folder it creates are private to the user (0600 / 0700): prompts are user data.
    - Like every :class:`Sink`, it belongs to the process that opened it (see there).
    """

    _mode = 0o600

    def __init__(self, folder: str | Path, *, max_bytes: int = 64 << 20, max_files: int = 16,
                 fsync: bool = False) -> None:
        if max_bytes < 1 or max_files < 1:
            raise ValueError(f"max_bytes={max_bytes}, max_files={max_files}: give a file size in bytes and a number "
                             "of files to keep, each at least 1")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.max_bytes, self.max_files = max_bytes, max_files
        # held while this writer is open: its numbering and retention assume no other writer in the folder
        self._held: int | None = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            _claim(self._held, self.folder, "folder")
            existing = _rotated(self.folder)
            self._number = self._writer = (existing[-1][0] + 1) if existing else 1
            # call index -> its call frame (and its size), written again at each rotation
            self._running: dict[int, tuple[Frame, int]] = {}
            super().__init__(self._name(), fsync=fsync)
            self._start()
        except BaseException:
            self._let_go()
            raise

    def _name(self) -> Path:
        return self.folder / f"{self._number:08d}-{self._writer:08d}.nxl"

    def _start(self) -> None:
        """The new file's first frame: its number and writer. Caller holds the lock (or is the constructor)."""
        self._size = len(_FILE_MAGIC) + self._append(
            _encode({}, {"kind": "file", "file": self._number, "writer": self._writer}, self._seq))
        self._records = 0  # record frames in the current file
        self._head = self._size

    def _put(self, frame: Frame, *, opens: int | None = None, closes: int | None = None) -> None:
        self._owned()
        with self._lock:
            data = frame(self._seq)
            if self._fd is not None and self._records and self._size + len(data) > self.max_bytes \
                    and self._due(len(data)):
                self._rotate()
                data = frame(self._seq)
            self._size += self._append(data)
            self._records += 1
            if self._records == 1:  # this file holds a record now: the oldest beyond max_files go (never for an
                self._prune()       # empty writer)
            if opens is not None:
                self._running[opens] = frame, len(data)
            if closes is not None:
                self._running.pop(closes, None)

    def _put_many(self, frames: list[Frame]) -> None:
        """Several frames with one write while they fit the current file; one at a time where a new file starts."""
        self._owned()
        with self._lock:
            data = [frame(self._seq + n) for n, frame in enumerate(frames)]
            size = sum(map(len, data))
            if self._fd is not None and self._size + size <= self.max_bytes:
                self._size += self._append_many(data)
                self._records += len(data)
                if self._records == len(data):  # the first records of this file (see _put)
                    self._prune()
                return
        for written, frame in enumerate(frames):
            try:
                self._put(frame)
            except Exception as error:  # the frames before it are on disk
                raise PartlyWritten(written) from error

    def _due(self, size: int) -> bool:
        """Whether the current file, past ``max_bytes`` with a next frame of ``size`` bytes, gives way to a new one.
        A new file starts with its first frame and the running calls' frames: where those with the next frame fit
        in ``max_bytes``, at once; where they do not (a long prompt's texts), a new file at each step would write
        them all again, once per step, so only once this file holds ``max_bytes`` more than them. Caller holds the
        lock."""
        carried = self._head + sum(length for _, length in self._running.values())
        return carried + size <= self.max_bytes or self._size >= carried + self.max_bytes

    def _rotate(self) -> None:
        # caller holds the lock
        fd, self._fd = self._fd, None
        _finish(fd)
        self._number += 1
        self.path = self._name()
        self._take()
        self._seq = 0
        self._start()
        for frame, _ in self._running.values():
            self._size += self._append(frame(self._seq))
            self._records += 1
        self._prune()

    def close(self) -> None:
        """Close the current file (one that holds no record, nothing was recorded, is removed) and let go of the
        folder."""
        if os.getpid() != self._pid:  # a forked child let go of both at the fork; the file is not its to remove
            return
        with self._lock:
            empty = self._fd is not None and not self._records
        try:
            super().close()
            if empty:
                self.path.unlink(missing_ok=True)
        finally:  # a close that fails (fsync's I/O error) lets go all the same: else the folder stays taken
            self._let_go()

    def _forked(self) -> None:
        super()._forked()
        self._let_go()

    def _let_go(self) -> None:
        """Close this writer's hold on the folder (once); another writer may take it then."""
        held, self._held = self._held, None
        if held is not None:
            os.close(held)

    def _prune(self) -> None:
        for _, _, path in _rotated(self.folder)[: -self.max_files]:
            if path != self.path:
                path.unlink(missing_ok=True)
