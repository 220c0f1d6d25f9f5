"""The crash-safe stream file: every call and step record appended as it is made, readable after a SIGKILL.

    with nxl.attach(model, sink="run.nxl"):
        model.generate(**enc, max_new_tokens=32)
    nxl.read_stream("run.nxl")[0].steps      # the records, read back from disk

Format (no pickle): the line ``nxl_hooks.stream/2\\n``, then frames. A frame is ``b"NXLF"``, the payload
length (uint64 little-endian), its CRC-32 (uint32 little-endian) and the payload: a safetensors blob whose
``nxl_hooks`` metadata entry is JSON with a ``kind`` of ``call`` (prompt), ``step`` or ``end`` (sequences), and
``seq``, the frame's number in its file (0, 1, 2...). A step frame names its call and step index; a rotated file's
first frame (``kind`` ``file``) names the file's number and its writer. Files of format 1 (nxl_hooks 0.1: no
``seq``, no ``file`` frame) still read, with the step checks below. A ``call`` frame also carries
``model``, ``started`` and ``special_ids``, a ``step`` frame its ``time`` and an ``end`` frame ``ended``: optional
entries of format 2, which older readers skip; records read from older files without them have None there
(``tests/data/stream-v2.nxl`` is such a file). A ``step`` frame holds the scores of NormXLogit and LogAt as the
tensors ``normxlogit`` and ``logat``, and those of any other method the probe computed as ``scores.<method>``
(older readers skip them too).
Each frame is written with one ``write`` call before the next decoding step starts, so a process killed with
SIGKILL leaves every completed step readable. ``Sink(path, fsync=True)`` also survives power loss, at the cost of
an fsync per step. A sink refuses to write through a symbolic link unless ``Sink(path, follow_symlinks=True)``.

Reading (:func:`read_stream`) stops at the first frame it cannot use and says so in the returned list's
``damage`` (a :class:`Damage`: which frame, at what offset, why, how many steps were recovered):

- a torn last frame (the writer was killed mid-write, or is still writing it) is the normal end of a killed run:
  it is left out quietly (``damage.torn`` True);
- frames whose checksums hold but whose order does not are damage too: a frame number out of sequence, a step
  that does not follow its call's last one (missing, repeated, out of order: ``damage.call`` and the reason name
  the call and the steps), a rotated file missing between two kept ones, or renamed;
- any other damage (a flipped byte, a frame cut out, garbage) warns with :class:`StreamDamageWarning` and returns
  what comes before it; ``read_stream(path, strict=True)`` raises :class:`StreamError` instead;
- a frame whose checksum is right but whose content nxl_hooks did not write raises :class:`StreamError` (a
  ValueError), naming the frame and its offset, in either mode.

A server that runs for weeks writes to a :class:`RotatingSink`: a folder of numbered files, a new one when the
current one would pass ``max_bytes``, the oldest deleted beyond ``max_files``. Every file is a stream file of its
own (the calls still running when it starts are written again at its top), and ``read_stream(folder)`` reads
them in order::

    nxl.attach(model, sink=nxl.RotatingSink("runs/llm", max_bytes=64 << 20, max_files=16))
    nxl.read_stream("runs/")                  # every call in every folder below, oldest file first
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import os
import re
import struct
import sys
import threading
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors.torch import load as _load_blob
from safetensors.torch import save as _save_blob

from ..method.registry import DEFAULT
from .attribution import RecordError, scores_to_store, stored_scores
from .files import CHUNK, read_regular
from .steps import STEP_TENSORS, GenerationCall, Step

__all__ = ["Damage", "RotatingSink", "Sink", "Stream", "StreamDamageWarning", "StreamError", "encode_call",
           "encode_end", "encode_step", "read_stream", "stream_bytes"]

_FILE_MAGIC = b"nxl_hooks.stream/2\n"  # what is written; version 1 (nxl_hooks 0.1, no frame numbers) still reads
_MAGIC_V1 = b"nxl_hooks.stream/1\n"
_FRAME = struct.Struct("<4sQI")
_FRAME_MAGIC = b"NXLF"


#: safetensors dtype names of the tensors a frame holds.
_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.bool: "BOOL", torch.uint8: "U8"}


def _blob(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """A safetensors blob of small CPU tensors, as ``safetensors.torch.save`` writes it (8-byte header length, the
    JSON header, 8-byte aligned, then the raw little-endian data), without its checks for shared and sparse
    storage: these tensors are fresh copies, and the checks cost five times the encoding on the generation thread
    (one frame per step). Read back with safetensors' own ``load``. ``tensors``' names are nxl_hooks' own (plain
    identifiers), so the header is written directly; only the metadata goes through ``json``."""
    entries, parts, offset = [], [], 0
    for name, value in tensors.items():
        data = (value.view(torch.int16) if value.dtype == torch.bfloat16 else value).numpy().tobytes()  # C order
        end = offset + len(data)
        shape = ",".join(map(str, value.shape))
        entries.append(f'"{name}":{{"dtype":"{_DTYPES[value.dtype]}","shape":[{shape}],'
                       f'"data_offsets":[{offset},{end}]}}')
        parts.append(data)
        offset = end
    text = ",".join([f'"__metadata__":{json.dumps(metadata, separators=(",", ":"))}', *entries]).join("{}").encode()
    text += b" " * (-len(text) % 8)
    return b"".join([struct.pack("<Q", len(text)), text, *parts])


def _encode(tensors: dict[str, torch.Tensor], header: dict, seq: int | None = None) -> bytes:
    """One frame: magic, length, CRC-32, then the safetensors payload whose metadata holds ``header`` (and ``seq``,
    the frame's number in its file)."""
    if seq is not None:
        header = {**header, "seq": seq}
    metadata = {"nxl_hooks": json.dumps(header)}
    # records hold CPU tensors outside autograd already (a step's): detach / copy only what is not
    tensors = {name: value if value.device.type == "cpu" and not value.requires_grad else value.detach().cpu()
               for name, value in tensors.items()}
    if sys.byteorder == "little" and all(value.dtype in _DTYPES for value in tensors.values()):
        payload = _blob(tensors, metadata)
    else:  # copies: safetensors refuses tensors that share storage (a step's target is a view of its token)
        payload = _save_blob({name: value.clone().contiguous() for name, value in tensors.items()}, metadata=metadata)
    return _FRAME.pack(_FRAME_MAGIC, len(payload), zlib.crc32(payload)) + payload


def encode_call(call: GenerationCall, meta: dict, *, seq: int | None = None) -> bytes:
    """The ``call`` frame of a call whose prompt is known (``meta``: what the probe explains; ``seq``: the frame's
    number in its file, which the reader checks)."""
    tensors = {"prompt_mask": call.prompt_mask}
    if call.prompt_ids is not None:
        tensors["prompt_ids"] = call.prompt_ids
    if call.prompt_template is not None:
        tensors["prompt_template"] = call.prompt_template
    return _encode(tensors, {"kind": "call", "call": call.index, "layers": call.layers, "meta": meta,
                             "request_id": call.request_id, "thread": call.thread, "readable": call.readable,
                             "model": call.model, "started": call.started, "special_ids": call.special_ids}, seq)


def encode_step(step: Step, *, seq: int | None = None) -> bytes:
    """The ``step`` frame of one record (its call and step index, checked against the one before it on reading)."""
    tensors = {**{name: getattr(step, name) for name in STEP_TENSORS}, **scores_to_store(step.scores)}
    if step.probability is not None:
        tensors["probability"] = step.probability
    return _encode(tensors, {"kind": "step", "call": step.call, "step": step.step, "position": step.position,
                             "layers": step.layers, "n_blocks": step.n_blocks, "readable": step.readable,
                             "time": step.time}, seq)


def encode_end(call: GenerationCall, *, seq: int | None = None) -> bytes:
    """The ``end`` frame of a call that returned (or stopped being recorded)."""
    tensors = {"sequences": call.sequences} if call.sequences is not None else {}
    return _encode(tensors, {"kind": "end", "call": call.index, "complete": call.complete, "error": call.error,
                             "ended": call.ended}, seq)


def stream_bytes(call: GenerationCall, meta: dict) -> bytes:
    """One call as a whole stream file (``read_stream`` reads it back): its call frame, its kept steps and, once
    it has ended, its end frame. ``Path("req.nxl").write_bytes(stream_bytes(probe.calls[-1], probe.describe()))``"""
    if call.prompt_mask is None:
        raise ValueError(f"call {call.index} has no recorded prompt yet: nothing to write")
    ended = call.complete or call.error is not None or call.sequences is not None
    steps = list(call.steps)
    frames = [encode_call(call, meta, seq=0), *(encode_step(step, seq=n) for n, step in enumerate(steps, 1))]
    if ended:
        frames.append(encode_end(call, seq=len(frames)))
    return b"".join([_FILE_MAGIC, *frames])


def _open(path: Path, mode: int, *, follow_symlinks: bool = False) -> int:
    """A new (or truncated) stream file holding only the file magic. A symbolic link is refused (ValueError) unless
    ``follow_symlinks``: O_NOFOLLOW makes the check and the open one step, with no window to swap a link in."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags, mode)
    except OSError as err:
        if err.errno == errno.ELOOP and not follow_symlinks:
            raise ValueError(f"{path} is a symbolic link: nxl_hooks does not write a stream through a link unless "
                             "told to; give the real path, or Sink(path, follow_symlinks=True)") from None
        raise
    try:
        _write_all(fd, _FILE_MAGIC)
    except BaseException:
        os.close(fd)  # a full disk at the first byte: no descriptor kept on a file nothing will write
        raise
    return fd


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


#: What a sink writes: a function of the frame's number in its file that returns the frame.
Frame = Callable[[int], bytes]


class Sink:
    """Append-only, crash-safe record file (format in the module docstring). ``attach(..., sink=Sink(p, fsync=True))``

    The file is created (or truncated) when the probe attaches; read it with :func:`read_stream`. A path that is a
    symbolic link is refused (ValueError), so that a link planted where the file goes cannot redirect the records
    (and the truncation) onto another file; ``follow_symlinks=True`` writes through it.
    """

    _mode = 0o644

    def __init__(self, path: str | Path, *, fsync: bool = False, follow_symlinks: bool = False) -> None:
        self.path = Path(path)
        self._fsync = fsync
        self._follow = follow_symlinks
        self._lock = threading.Lock()  # calls in several threads share one file: one frame at a time
        self._fd: int | None = _open(self.path, self._mode, follow_symlinks=follow_symlinks)
        self._seq = 0  # the next frame's number in the current file

    def _put(self, frame: Frame, *, opens: int | None = None, closes: int | None = None) -> None:
        """Append one frame; ``opens`` / ``closes``: the index of the call it starts or ends."""
        with self._lock:
            self._append(frame(self._seq))

    def _append(self, data: bytes) -> int:
        """Write one frame made with number ``self._seq``; its size. Caller holds the lock."""
        if self._fd is None:
            raise RuntimeError(f"sink {self.path} is closed: the probe it belonged to has detached, or a write to "
                               "it failed")
        try:
            _write_all(self._fd, data)
            if self._fsync:
                os.fsync(self._fd)
        except OSError:
            # A full disk (or an I/O error): the probe drops this sink (its fault), so nothing writes here again;
            # the descriptor goes now, or the file system could not be unmounted while the host runs.
            os.close(self._fd)
            self._fd = None
            raise
        self._seq += 1
        return len(data)

    def write_call(self, call: GenerationCall, meta: dict) -> None:
        self._put(functools.partial(_numbered, encode_call, call, meta), opens=call.index)

    def write_step(self, step: Step) -> None:
        self._put(functools.partial(_numbered, encode_step, step))

    def write_end(self, call: GenerationCall) -> None:
        self._put(functools.partial(_numbered, encode_end, call), closes=call.index)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                fd, self._fd = self._fd, None
                _finish(fd)


def _numbered(encode: Callable[..., bytes], *args: Any) -> Frame:
    """``encode(*args, seq=n)`` as a :data:`Frame`: frames are numbered when written, under the sink's lock."""
    *args, seq = args
    return encode(*args, seq=seq)


#: A rotated file's name: its number in the folder, then the number of the first file its writer made.
_ROTATED = re.compile(r"(\d{8})-(\d{8})\.nxl")


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
      top of the new file, so every file reads on its own.
    - Beyond ``max_files`` files in the folder the oldest are deleted: the folder holds at most about
      ``max_files * max_bytes`` bytes.
    - Files are named ``<number>-<writer>.nxl``: numbers go on from the files already in the folder (a new writer,
      say after a restart, never overwrites), and ``<writer>`` tells which files one writer made, so that
      ``read_stream(folder)`` joins them in order. Each file's first frame carries its number and writer too, so
      that a missing file between two kept ones (or a renamed one) is reported as damage. One writer per folder at
      a time.
    - Files and a folder it creates are private to the user (0600 / 0700): prompts are user data.
    - In a child the process forks, writes are dropped: the files belong to the parent (whose frames a child's
      would interleave with); the child's records stay in its memory.
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
        existing = _rotated(self.folder)
        self._number = self._writer = (existing[-1][0] + 1) if existing else 1
        self._running: dict[int, Frame] = {}  # call index -> its call frame, written again at each rotation
        self._pid = os.getpid()
        super().__init__(self._name(), fsync=fsync)
        self._start()

    def _name(self) -> Path:
        return self.folder / f"{self._number:08d}-{self._writer:08d}.nxl"

    def _start(self) -> None:
        """The new file's first frame: its number and writer. Caller holds the lock (or is the constructor)."""
        self._size = len(_FILE_MAGIC) + self._append(
            _encode({}, {"kind": "file", "file": self._number, "writer": self._writer}, self._seq))
        self._records = 0  # record frames in the current file

    def _put(self, frame: Frame, *, opens: int | None = None, closes: int | None = None) -> None:
        if os.getpid() != self._pid:  # checked before the lock, which a thread of the parent may have held
            return
        with self._lock:
            data = frame(self._seq)
            if self._fd is not None and self._records and self._size + len(data) > self.max_bytes:
                self._rotate()
                data = frame(self._seq)
            self._size += self._append(data)
            self._records += 1
            if self._records == 1:  # this file holds a record now: the oldest beyond max_files go (never for an
                self._prune()       # empty writer)
            if opens is not None:
                self._running[opens] = frame
            if closes is not None:
                self._running.pop(closes, None)

    def _rotate(self) -> None:
        # caller holds the lock
        fd, self._fd = self._fd, None
        _finish(fd)
        self._number += 1
        self.path = self._name()
        self._fd = _open(self.path, self._mode, follow_symlinks=self._follow)
        self._seq = 0
        self._start()
        for frame in self._running.values():
            self._size += self._append(frame(self._seq))
            self._records += 1
        self._prune()

    def close(self) -> None:
        """Close the current file; one that holds no record (nothing was recorded) is removed."""
        if os.getpid() != self._pid:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            return
        with self._lock:
            empty = self._fd is not None and not self._records
        super().close()
        if empty:
            self.path.unlink(missing_ok=True)

    def _prune(self) -> None:
        for _, _, path in _rotated(self.folder)[: -self.max_files]:
            if path != self.path:
                path.unlink(missing_ok=True)


class StreamError(RecordError):
    """A stream file nxl_hooks cannot read: not a stream file, a frame with a valid checksum but content nxl_hooks
    did not write, or (``read_stream(..., strict=True)``) damage. Names the frame and its byte offset."""


class StreamDamageWarning(UserWarning):
    """:func:`read_stream` stopped early at a damaged frame (not a torn last frame); see ``damage`` on its result."""


@dataclass(frozen=True)
class Damage:
    """Where and why :func:`read_stream` stopped before the end of a file. ``calls.damage.frame``"""

    frame: int  #: index of the first frame not read (0 = the first frame after the file header)
    offset: int  #: its byte offset in the file
    reason: str  #: what is wrong with it
    torn: bool  #: a torn last frame (a writer killed mid-write): the normal end of a killed run, not corruption
    steps_recovered: int  #: step records read before it (all of them returned)
    frames_after: int  #: intact frames found after it, not returned (a gap would make the calls lie)
    bytes_dropped: int  #: from ``offset`` to the end of the file
    path: str = ""  #: the file (one of a folder's, when read_stream was given a folder)
    call: int | None = None  #: the call whose records break off there, when one does (a step missing or repeated)

    def describe(self) -> str:
        """One line: ``frame 3 at byte 1234: CRC mismatch; 2 step records recovered before it, ...``"""
        lost = f", {self.frames_after} intact frame(s) after it not read" if self.frames_after else ""
        return (f"frame {self.frame} at byte {self.offset}: {self.reason}; {self.steps_recovered} step record(s) "
                f"recovered before it{lost} ({self.bytes_dropped} bytes left out)")


class Stream(list):
    """What :func:`read_stream` returns: a list of :class:`GenerationCall`, and ``damage`` (None when every file ends
    on a complete frame; else the first damaged file's)."""

    damage: Damage | None = None


def _crc(view: memoryview) -> int:
    """CRC-32 of ``view`` in :data:`CHUNK` pieces (Ctrl-C is seen between two of them)."""
    crc = 0
    for start in range(0, len(view), CHUNK):
        crc = zlib.crc32(view[start: start + CHUNK], crc)
    return crc


def _find(data: bytearray, start: int) -> int:
    """The next frame marker at or after ``start`` (-1: none), searched in :data:`CHUNK` pieces."""
    while start < len(data):
        hit = data.find(_FRAME_MAGIC, start, start + CHUNK + len(_FRAME_MAGIC) - 1)
        if hit != -1:
            return hit
        start += CHUNK
    return -1


def _frame_at(data: bytearray, offset: int) -> tuple[memoryview | None, str]:
    """(payload, "") for an intact frame at ``offset``, else (None, why not). Nothing is copied, and a length
    that runs past the end of the file is refused before any byte of it is read."""
    if offset + _FRAME.size > len(data):
        return None, f"only {len(data) - offset} bytes of a {_FRAME.size}-byte frame header"
    magic, length, crc = _FRAME.unpack_from(data, offset)
    if magic != _FRAME_MAGIC:
        return None, f"no frame marker ({magic!r} instead of {_FRAME_MAGIC!r})"
    start = offset + _FRAME.size
    if start + length > len(data):
        return None, f"the frame announces {length} bytes but only {len(data) - start} follow"
    payload = memoryview(data)[start: start + length]
    if _crc(payload) != crc:
        return None, "checksum (CRC-32) mismatch: the frame was altered after it was written"
    return payload, ""


def _torn(data: bytearray, offset: int) -> bool:
    """Whether the bad frame at ``offset`` looks like a torn last frame: a prefix of a frame that runs past the end
    of the file (a flipped length byte also runs past the end: the caller checks that no intact frame follows)."""
    rest = len(data) - offset
    if rest < len(_FRAME_MAGIC):
        return _FRAME_MAGIC.startswith(bytes(data[offset:]))
    if data[offset: offset + len(_FRAME_MAGIC)] != _FRAME_MAGIC:
        return False
    if rest >= _FRAME.size:
        _, length, _ = _FRAME.unpack_from(data, offset)
        if _FRAME.size + length <= rest:
            return False  # complete, so its checksum failed: altered, not torn
    return True


def _intact_after(data: bytearray, offset: int) -> tuple[int, int]:
    """(how many intact frames start after ``offset``, found by their marker and checksum; payload bytes checked).

    Linear in the file's size: an intact frame is checked once and skipped; a candidate whose length runs past
    the end costs nothing; the checksums of candidates that fail may cover at most the rest of the file once more,
    beyond which candidates are not checked (the count is then a lower bound: a crafted file, not a torn one)."""
    count, checked, failed = 0, 0, 0
    budget = len(data) - offset
    start = _find(data, offset + 1)
    while start != -1:
        nxt = start + 1
        if start + _FRAME.size <= len(data):
            _, length, crc = _FRAME.unpack_from(data, start)
            end = start + _FRAME.size + length
            if end <= len(data) and failed + length <= budget:
                checked += length
                if _crc(memoryview(data)[start + _FRAME.size: end]) == crc:
                    count, nxt = count + 1, end
                else:
                    failed += length
        start = _find(data, nxt)
    return count, checked


def _frames(data: bytearray) -> Iterator[tuple[int, int, memoryview | None, str]]:
    """(index, offset, payload, "") per intact frame; the first bad one comes as (index, offset, None, why), last."""
    offset, index = len(_FILE_MAGIC), 0
    while offset < len(data):
        payload, why = _frame_at(data, offset)
        yield index, offset, payload, why
        if payload is None:
            return
        offset += _FRAME.size + len(payload)
        index += 1


def _decode(payload: memoryview) -> tuple[dict, dict[str, torch.Tensor]]:
    """A frame's header (its ``nxl_hooks`` metadata) and tensors; ValueError when it is not such a blob."""
    (size,) = struct.unpack_from("<Q", payload, 0) if len(payload) >= 8 else (None,)
    if size is None or size > len(payload) - 8:
        raise ValueError("not a safetensors blob")
    metadata = json.loads(bytes(payload[8: 8 + size])).get("__metadata__") or {}  # safetensors' load() drops it
    header = json.loads(metadata["nxl_hooks"]) if isinstance(metadata, dict) and "nxl_hooks" in metadata else None
    if not isinstance(header, dict):
        raise ValueError("no nxl_hooks record header in its metadata")
    return header, _load_blob(bytes(payload))


def _field(header: dict, name: str, kinds: tuple[type, ...], *, optional: bool = False) -> Any:
    value = header.get(name)
    if (value is None and optional) or (isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool))):
        return value
    raise ValueError(f"{name!r} is {value!r}, expected {' or '.join(k.__name__ for k in kinds)}")


def _tensor(tensors: dict[str, torch.Tensor], name: str, dim: int, *, boolean: bool = False,
            optional: bool = False) -> torch.Tensor | None:
    value = tensors.get(name)
    if value is None and optional:
        return None
    ok = value is not None and value.dim() == dim and (
        value.dtype == torch.bool if boolean else not (value.is_floating_point() or value.dtype == torch.bool))
    if not ok:
        want = f"a {dim}-D {'bool' if boolean else 'integer'} tensor"
        raise ValueError(f"tensor {name!r} is {'missing' if value is None else f'{value.dtype} {tuple(value.shape)}'}"
                         f", expected {want}")
    return value


def _layers(header: dict) -> list[int]:
    layers = header.get("layers")
    if not isinstance(layers, list) or not layers or not all(isinstance(x, int) and not isinstance(x, bool)
                                                             for x in layers):
        raise ValueError(f"'layers' is {layers!r}, expected a list of ints")
    return layers


def _strings(header: dict, name: str) -> Any:
    """An optional list of strings, or of lists of strings (readable token texts)."""
    value = header.get(name)
    flat = value if value is None or not value or not isinstance(value[0], list) else [t for row in value for t in row]
    if value is None or (isinstance(value, list) and all(isinstance(text, str) for text in flat)):
        return value
    raise ValueError(f"{name!r} is {value!r}, expected a list of token texts")


def _ints(header: dict, name: str) -> list[int] | None:
    """An optional list of ints (token ids)."""
    value = header.get(name)
    if value is None or (isinstance(value, list) and all(type(i) is int for i in value)):
        return value
    raise ValueError(f"{name!r} is {value!r:.80}, expected a list of token ids")


class _Gap(Exception):
    """Frames whose checksums hold but whose order does not: a frame missing, repeated or moved."""

    def __init__(self, reason: str, call: int | None = None) -> None:
        super().__init__(reason)
        self.reason, self.call = reason, call


def _next_step(call: GenerationCall, number: int, *, rotated: bool) -> None:
    """Refuse (:class:`_Gap`) a step record that does not follow the call's last one."""
    last = call.steps[-1].step if call.steps else None
    index = call.index
    if last is None:
        if number != 0 and not rotated:  # a rotated file may start a call whose first steps were deleted
            raise _Gap(f"call {index}: its first step record is step {number} ({_steps(0, number)} missing)", index)
    elif number == last:
        raise _Gap(f"call {index}: step {number} recorded twice", index)
    elif number < last:
        raise _Gap(f"call {index}: step {number} comes after step {last} (out of order)", index)
    elif number > last + 1:
        raise _Gap(f"call {index}: step {number} follows step {last} ({_steps(last + 1, number)} missing)", index)


def _steps(first: int, end: int) -> str:
    return f"step {first}" if end == first + 1 else f"steps {first}-{end - 1}"


def _apply(calls: dict[int, GenerationCall], header: dict, tensors: dict[str, torch.Tensor], *,
           rotated: bool) -> bool:
    """Add one frame's record to ``calls``; True for a step record. ValueError when it does not fit. ``rotated``: a
    file of a RotatingSink, where a running call's frame comes again at the top of each file and the first files
    (with the call frames of older calls) may have been deleted."""
    kind, index = header.get("kind"), _field(header, "call", (int,))
    if kind == "call":
        if index in calls and rotated:
            return False  # written again at the top of a rotated file: the call goes on
        if index in calls:
            raise ValueError(f"a second 'call' frame for call {index}")
        mask = _tensor(tensors, "prompt_mask", 2, boolean=True)
        ids = _tensor(tensors, "prompt_ids", 2, optional=True)
        template = _tensor(tensors, "prompt_template", 2, boolean=True, optional=True)
        for name, value in (("prompt_ids", ids), ("prompt_template", template)):
            if value is not None and value.shape != mask.shape:
                raise ValueError(f"{name} {tuple(value.shape)} and prompt_mask {tuple(mask.shape)} differ in shape")
        calls[index] = GenerationCall(index=index, layers=_layers(header), prompt_ids=ids, prompt_mask=mask,
                                      request_id=_field(header, "request_id", (str,), optional=True),
                                      thread=_field(header, "thread", (str,), optional=True),
                                      readable=_strings(header, "readable"), prompt_template=template,
                                      special_ids=_ints(header, "special_ids"),
                                      model=_field(header, "model", (str,), optional=True),
                                      started=_field(header, "started", (float, int), optional=True))
        return False
    if index not in calls and rotated:
        return False  # its call frame was in a file deleted by the RotatingSink's retention
    if index not in calls:
        raise ValueError(f"a {kind!r} frame for call {index}, which no 'call' frame opened")
    call = calls[index]
    if kind == "step":
        step = Step(call=index, step=_field(header, "step", (int,)), position=_field(header, "position", (int,)),
                    layers=_layers(header), n_blocks=_field(header, "n_blocks", (int,), optional=True),
                    probability=tensors.get("probability"), readable=_strings(header, "readable"),
                    time=_field(header, "time", (float, int), optional=True), scores=stored_scores(tensors),
                    **{name: tensors.get(name) for name in STEP_TENSORS if name not in DEFAULT})
        _check_step(step, call)
        call.link(step)
        call.steps.append(step)
        return True
    if kind == "end":
        call.sequences = _tensor(tensors, "sequences", 2, optional=True)
        call.complete = _field(header, "complete", (bool,))
        call.error = _field(header, "error", (str,), optional=True)
        call.ended = _field(header, "ended", (float, int), optional=True)
        return False
    raise ValueError(f"unknown record kind {kind!r} (expected 'call', 'step' or 'end')")


def _check_step(step: Step, call: GenerationCall) -> None:
    """A step record whose tensors fit each other, its call's batch and its position."""
    batch = call.prompt_mask.shape[0]
    token, active = _tensor(vars(step), "token", 1), _tensor(vars(step), "active", 1, boolean=True)
    if token.shape[0] != batch or active.shape[0] != batch:
        raise ValueError(f"step {step.step}: token / active have {token.shape[0]} / {active.shape[0]} rows, "
                         f"the call's prompt {batch}")
    scores = step.scores.get("normxlogit")
    if scores is None or scores.dim() < 3 or scores.shape[1:3] != (batch, step.position) or step.position < 1:
        raise ValueError(f"step {step.step}: normxlogit {None if scores is None else tuple(scores.shape)} does not "
                         f"cover {batch} row(s) x {step.position} positions")
    step.to_attribution().check()  # every other field, by the one set of rules of Attribution


def _read(data: bytearray, path: Path, calls: dict[int, GenerationCall], *, name: tuple[int, int] | None
          ) -> tuple[int, Damage | None]:
    """Add the records of one stream file to ``calls`` (those of one writer so far): (steps read, damage or None).
    ``name``: (number, writer) of a rotated file, from its name."""
    if data.startswith(_FILE_MAGIC):
        numbered = True
    elif data.startswith(_MAGIC_V1):  # nxl_hooks 0.1: no frame numbers, no file frame
        numbered = False
    else:
        raise StreamError(f"{path} is not an nxl_hooks stream file (written by attach(..., sink=path))")
    steps = 0
    for index, offset, payload, why in _frames(data):
        try:
            if payload is None:
                raise _Gap(why)
            try:
                header, tensors = _decode(payload)
                number, seq = header.get("step"), header.get("seq")
                call = calls.get(header.get("call")) if header.get("kind") == "step" else None
                if call is not None and type(number) is int:  # a step that does not follow its call's last one
                    _next_step(call, number, rotated=name is not None)
                if numbered and seq is not None and seq != index:
                    raise _Gap(f"frame number {seq!r} where {index} was expected: a frame is missing, repeated or "
                               "out of order")
                if header.get("kind") == "file":
                    _check_file(header, index, name)
                else:
                    steps += _apply(calls, header, tensors, rotated=name is not None)
                if numbered and seq is None:
                    raise ValueError("no frame number ('seq'), which every frame of a format 2 file has")
            except _Gap:
                raise
            except Exception as err:  # noqa: BLE001 - any parse failure of a frame whose checksum holds is one error
                raise StreamError(f"{path}: frame {index} at byte {offset} has a valid checksum but is not a record "
                                  f"nxl_hooks wrote ({type(err).__name__}: {err})") from None
        except _Gap as gap:
            after, _ = _intact_after(data, offset)
            torn = payload is None and not after and _torn(data, offset)
            return steps, Damage(frame=index, offset=offset, reason=gap.reason, torn=torn, steps_recovered=steps,
                                 frames_after=after, bytes_dropped=len(data) - offset, path=str(path), call=gap.call)
    return steps, None


def _check_file(header: dict, index: int, name: tuple[int, int] | None) -> None:
    """A rotated file's first frame: its number and writer, which its name must repeat."""
    number, writer = _field(header, "file", (int,)), _field(header, "writer", (int,))
    if index != 0:
        raise ValueError("a 'file' frame that is not the file's first")
    if name is not None and (number, writer) != name:
        raise _Gap(f"the file says it is file {number} of writer {writer}, its name file {name[0]} of writer "
                   f"{name[1]}: renamed or copied over another")


def _writers(folder: Path) -> list[list[Path]]:
    """The stream files below ``folder``, one list per writer (a RotatingSink's files joined in order)."""
    groups: dict[tuple, list[Path]] = {}
    for path in sorted(p for p in folder.rglob("*.nxl") if p.is_file()):
        match = _ROTATED.fullmatch(path.name)
        key = (str(path.parent), int(match.group(2))) if match else (str(path.parent), -1, path.name)
        groups.setdefault(key, []).append(path)
    return [groups[key] for key in sorted(groups)]


def read_stream(path: str | Path, *, request_id: str | None = None, strict: bool = False) -> Stream:
    """Every call and step record in a sink file, up to the first frame that cannot be read. ``nxl.read_stream(p)``

    A call whose ``end`` frame is missing (the writer was killed) has ``complete`` False and no ``sequences``.
    ``path`` may be a folder: every stream file below it, a :class:`RotatingSink`'s files joined in order (calls
    of one writer, then the next; a call whose first file was deleted starts at its first kept step).
    ``request_id``: only the calls of that request. The result is a list with a ``damage`` attribute (see the module
    docstring): None for whole files; a torn last frame is left out quietly; other damage (a missing, repeated or
    moved frame or file included) warns (:class:`StreamDamageWarning`), or raises :class:`StreamError` with
    ``strict=True``; a writer's records stop at its first damage, so what is returned has no gap. A frame with a
    valid checksum that nxl_hooks did not write raises :class:`StreamError`. What is not a regular file (a FIFO,
    a device, a socket) is refused before it is opened; Ctrl-C interrupts a long read.
    """
    path = Path(path)
    out, damage = Stream(), None
    for files in _writers(path) if path.is_dir() else [[path]]:
        calls: dict[int, GenerationCall] = {}
        found, steps, last = None, 0, None
        for file in files:
            match = _ROTATED.fullmatch(file.name)
            name = (int(match.group(1)), int(match.group(2))) if match else None
            if last is not None and name is not None and name[0] != last[0] + 1:
                found = Damage(frame=0, offset=0, reason=f"file {last[0] + 1:08d}-{name[1]:08d}.nxl is missing "
                               f"(deleted or lost) between {last[1].name} and {file.name}{_running(calls)}",
                               torn=False, steps_recovered=steps, frames_after=0, bytes_dropped=0, path=str(file))
                break
            try:
                data = read_regular(file, StreamError)
            except FileNotFoundError:
                if len(files) > 1 and last is None:  # deleted by the writer's retention while we read
                    continue
                raise
            got, found = _read(data, file, calls, name=name)
            steps, last = steps + got, (name[0] if name else 0, file)
            if found is not None:
                if file is not files[-1]:  # only a writer's last file may end torn: the records go on elsewhere
                    found = dataclasses.replace(found, torn=False)
                break
        if found is not None and not found.torn:
            if strict:
                raise StreamError(f"{found.path} is damaged: {found.describe()}")
            warnings.warn(f"{found.path} is damaged, read up to the damage: {found.describe()}",
                          StreamDamageWarning, stacklevel=2)
        damage = damage or found
        out.extend(calls[index] for index in sorted(calls))
    out[:] = [call for call in out if request_id is None or call.request_id == request_id]
    out.damage = damage
    return out


def _running(calls: dict[int, GenerationCall]) -> str:
    """The calls whose records break off at a missing file, and their last step read."""
    open_ = [f"call {c.index} (after step {c.steps[-1].step})" if c.steps else f"call {c.index} (no step yet)"
             for c in calls.values() if not c.complete and c.error is None and c.sequences is None]
    return f"; records of {', '.join(open_)} break off there" if open_ else ""
