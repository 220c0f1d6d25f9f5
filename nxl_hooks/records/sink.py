"""The crash-safe stream file: every call and step record appended as it is made, readable after a SIGKILL.

    with nxl.attach(model, sink="run.nxl"):
        model.generate(**enc, max_new_tokens=32)
    nxl.read_stream("run.nxl")[0].steps      # the records, read back from disk

Format (no pickle): the line ``nxl_hooks.stream/1\\n``, then frames. A frame is ``b"NXLF"``, the payload
length (uint64 little-endian), its CRC-32 (uint32 little-endian) and the payload: a safetensors blob whose
``nxl_hooks`` metadata entry is JSON with a ``kind`` of ``call`` (prompt), ``step`` or ``end`` (sequences).
Each frame is written with one ``write`` call before the next decoding step starts, so a process killed with
SIGKILL leaves every completed step readable; a torn last frame fails its length or CRC check and is ignored.
``Sink(path, fsync=True)`` also survives power loss, at the cost of an fsync per step.

A server that runs for weeks writes to a :class:`RotatingSink`: a folder of numbered files, a new one when the
current one would pass ``max_bytes``, the oldest deleted beyond ``max_files``. Every file is a stream file of its
own (the calls still running when it starts are written again at its top), and ``read_stream(folder)`` reads
them in order::

    nxl.attach(model, sink=nxl.RotatingSink("runs/llm", max_bytes=64 << 20, max_files=16))
    nxl.read_stream("runs/")                  # every call in every folder below, oldest file first
"""

from __future__ import annotations

import json
import os
import re
import struct
import sys
import threading
import zlib
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import load as _load_blob
from safetensors.torch import save as _save_blob

from .steps import STEP_TENSORS, GenerationCall, Step

__all__ = ["RotatingSink", "Sink", "encode_call", "encode_end", "encode_step", "read_stream",
           "stream_bytes"]

_FILE_MAGIC = b"nxl_hooks.stream/1\n"
_FRAME = struct.Struct("<4sQI")
_FRAME_MAGIC = b"NXLF"


#: safetensors dtype names of the tensors a frame holds.
_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.bool: "BOOL", torch.uint8: "U8"}


def _blob(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """A safetensors blob of small CPU tensors, as ``safetensors.torch.save`` writes it (8-byte header length, the
    JSON header, 8-byte aligned, then the raw little-endian data), without its checks for shared and sparse
    storage: these tensors are fresh copies, and the checks cost five times the encoding on the generation thread
    (one frame per step). Read back with safetensors' own ``load``."""
    header: dict = {"__metadata__": metadata}
    parts, offset = [], 0
    for name, value in tensors.items():
        data = (value.view(torch.int16) if value.dtype == torch.bfloat16 else value).numpy().tobytes()  # C order
        header[name] = {"dtype": _DTYPES[value.dtype], "shape": list(value.shape),
                        "data_offsets": [offset, offset + len(data)]}
        parts.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return b"".join([struct.pack("<Q", len(text)), text, *parts])


def _encode(tensors: dict[str, torch.Tensor], header: dict) -> bytes:
    """One frame: magic, length, CRC-32, then the safetensors payload whose metadata holds ``header``."""
    metadata = {"nxl_hooks": json.dumps(header)}
    tensors = {name: value.detach().cpu() for name, value in tensors.items()}
    if sys.byteorder == "little" and all(value.dtype in _DTYPES for value in tensors.values()):
        payload = _blob(tensors, metadata)
    else:  # copies: safetensors refuses tensors that share storage (a step's target is a view of its token)
        payload = _save_blob({name: value.clone().contiguous() for name, value in tensors.items()}, metadata=metadata)
    return _FRAME.pack(_FRAME_MAGIC, len(payload), zlib.crc32(payload)) + payload


def encode_call(call: GenerationCall, meta: dict) -> bytes:
    """The ``call`` frame of a call whose prompt is known (``meta``: what the probe explains)."""
    tensors = {"prompt_mask": call.prompt_mask}
    if call.prompt_ids is not None:
        tensors["prompt_ids"] = call.prompt_ids
    return _encode(tensors, {"kind": "call", "call": call.index, "layers": call.layers, "meta": meta,
                             "request_id": call.request_id, "thread": call.thread, "readable": call.readable})


def encode_step(step: Step) -> bytes:
    """The ``step`` frame of one record."""
    tensors = {name: getattr(step, name) for name in STEP_TENSORS}
    if step.probability is not None:
        tensors["probability"] = step.probability
    return _encode(tensors, {"kind": "step", "call": step.call, "step": step.step, "position": step.position,
                             "layers": step.layers, "n_blocks": step.n_blocks, "readable": step.readable})


def encode_end(call: GenerationCall) -> bytes:
    """The ``end`` frame of a call that returned (or stopped being recorded)."""
    tensors = {"sequences": call.sequences} if call.sequences is not None else {}
    return _encode(tensors, {"kind": "end", "call": call.index, "complete": call.complete, "error": call.error})


def stream_bytes(call: GenerationCall, meta: dict) -> bytes:
    """One call as a whole stream file (``read_stream`` reads it back): its call frame, its kept steps and, once
    it has ended, its end frame. ``Path("req.nxl").write_bytes(stream_bytes(probe.calls[-1], probe.describe()))``"""
    if call.prompt_mask is None:
        raise ValueError(f"call {call.index} has no recorded prompt yet: nothing to write")
    ended = call.complete or call.error is not None or call.sequences is not None
    return b"".join([_FILE_MAGIC, encode_call(call, meta), *map(encode_step, list(call.steps)),
                     encode_end(call) if ended else b""])


def _open(path: Path, mode: int) -> int:
    """A new (or truncated) stream file holding only the file magic."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, mode)
    _write_all(fd, _FILE_MAGIC)
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class Sink:
    """Append-only, crash-safe record file (format in the module docstring). ``attach(..., sink=Sink(p, fsync=True))``

    The file is created (or truncated) when the probe attaches; read it with :func:`read_stream`.
    """

    _mode = 0o644

    def __init__(self, path: str | Path, *, fsync: bool = False) -> None:
        self.path = Path(path)
        self._fsync = fsync
        self._lock = threading.Lock()  # calls in several threads share one file: one frame at a time
        self._fd: int | None = _open(self.path, self._mode)

    def _put(self, frame: bytes, *, opens: int | None = None, closes: int | None = None) -> None:
        """Append one frame; ``opens`` / ``closes``: the index of the call it starts or ends."""
        with self._lock:
            self._append(frame)

    def _append(self, data: bytes) -> None:
        # caller holds the lock
        if self._fd is None:
            raise RuntimeError(f"sink {self.path} is closed: the probe it belonged to has detached")
        _write_all(self._fd, data)
        if self._fsync:
            os.fsync(self._fd)

    def write_call(self, call: GenerationCall, meta: dict) -> None:
        self._put(encode_call(call, meta), opens=call.index)

    def write_step(self, step: Step) -> None:
        self._put(encode_step(step))

    def write_end(self, call: GenerationCall) -> None:
        self._put(encode_end(call), closes=call.index)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.fsync(self._fd)
                os.close(self._fd)
                self._fd = None


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
      ``read_stream(folder)`` joins them in order. One writer per folder at a time.
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
        self._running: dict[int, bytes] = {}  # call index -> its call frame, written again at each rotation
        self._pid = os.getpid()
        super().__init__(self._name(), fsync=fsync)
        self._size = len(_FILE_MAGIC)

    def _name(self) -> Path:
        return self.folder / f"{self._number:08d}-{self._writer:08d}.nxl"

    def _put(self, frame: bytes, *, opens: int | None = None, closes: int | None = None) -> None:
        if os.getpid() != self._pid:  # checked before the lock, which a thread of the parent may have held
            return
        with self._lock:
            if self._fd is not None and self._size + len(frame) > self.max_bytes and self._size > len(_FILE_MAGIC):
                self._rotate()
            fresh = self._size == len(_FILE_MAGIC)
            self._append(frame)
            self._size += len(frame)
            if fresh:  # this file holds a record now: the oldest beyond max_files go (never for an empty writer)
                self._prune()
            if opens is not None:
                self._running[opens] = frame
            if closes is not None:
                self._running.pop(closes, None)

    def _rotate(self) -> None:
        # caller holds the lock
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        self._number += 1
        self.path = self._name()
        self._fd = _open(self.path, self._mode)
        self._size = len(_FILE_MAGIC)
        for frame in self._running.values():
            self._append(frame)
            self._size += len(frame)
        self._prune()

    def close(self) -> None:
        """Close the current file; one that holds no frame (nothing was recorded) is removed."""
        if os.getpid() != self._pid:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            return
        with self._lock:
            empty = self._fd is not None and self._size == len(_FILE_MAGIC)
        super().close()
        if empty:
            self.path.unlink(missing_ok=True)

    def _prune(self) -> None:
        for _, _, path in _rotated(self.folder)[: -self.max_files]:
            if path != self.path:
                path.unlink(missing_ok=True)


def _frames(data: bytes) -> Iterator[tuple[dict, dict[str, torch.Tensor]]]:
    offset = len(_FILE_MAGIC)
    while offset + _FRAME.size <= len(data):
        magic, length, crc = _FRAME.unpack_from(data, offset)
        payload = data[offset + _FRAME.size: offset + _FRAME.size + length]
        if magic != _FRAME_MAGIC or len(payload) != length or zlib.crc32(payload) != crc:
            return  # a torn last frame (the writer was killed mid-write): everything before it is whole
        header = json.loads(_metadata(payload)["nxl_hooks"])  # safetensors' load() drops the metadata
        yield header, _load_blob(payload)
        offset += _FRAME.size + length


def _metadata(payload: bytes) -> dict[str, str]:
    # safetensors layout: uint64 header size, then the JSON header whose "__metadata__" holds our entry.
    (size,) = struct.unpack_from("<Q", payload, 0)
    return json.loads(payload[8: 8 + size]).get("__metadata__", {})


def _read(data: bytes, path: str | Path, calls: dict[int, GenerationCall]) -> None:
    """Add the records of one stream file to ``calls`` (those of one writer so far)."""
    if not data.startswith(_FILE_MAGIC):
        raise ValueError(f"{path} is not an nxl_hooks stream file (written by attach(..., sink=path))")
    for header, tensors in _frames(data):
        kind, index = header["kind"], header["call"]
        if kind == "call":
            if index in calls:  # written again at the top of a rotated file: the call goes on
                continue
            calls[index] = GenerationCall(index=index, layers=header["layers"], prompt_ids=tensors.get("prompt_ids"),
                                          prompt_mask=tensors["prompt_mask"], request_id=header.get("request_id"),
                                          thread=header.get("thread"), readable=header.get("readable"))
        elif index not in calls:
            continue  # its call frame was in a file deleted by a RotatingSink's retention
        elif kind == "step":
            calls[index].steps.append(Step(call=index, step=header["step"], position=header["position"],
                                           layers=header["layers"], n_blocks=header.get("n_blocks"),
                                           probability=tensors.get("probability"), readable=header.get("readable"),
                                           **{n: tensors[n] for n in STEP_TENSORS}))
        elif kind == "end":
            calls[index].sequences = tensors.get("sequences")
            calls[index].complete = bool(header["complete"])
            calls[index].error = header.get("error")


def _writers(folder: Path) -> list[list[Path]]:
    """The stream files below ``folder``, one list per writer (a RotatingSink's files joined in order)."""
    groups: dict[tuple, list[Path]] = {}
    for path in sorted(p for p in folder.rglob("*.nxl") if p.is_file()):
        match = _ROTATED.fullmatch(path.name)
        key = (str(path.parent), int(match.group(2))) if match else (str(path.parent), -1, path.name)
        groups.setdefault(key, []).append(path)
    return [groups[key] for key in sorted(groups)]


def read_stream(path: str | Path, *, request_id: str | None = None) -> list[GenerationCall]:
    """Every call and step record in a sink file, up to the last complete frame. ``nxl.read_stream("run.nxl")``

    A call whose ``end`` frame is missing (the writer was killed) has ``complete`` False and no ``sequences``.
    ``path`` may be a folder: every stream file below it, a :class:`RotatingSink`'s files joined in order (calls
    of one writer, then the next; a call whose first file was deleted starts at its first kept step).
    ``request_id``: only the calls of that request.
    """
    path = Path(path)
    out: list[GenerationCall] = []
    for files in _writers(path) if path.is_dir() else [[path]]:
        calls: dict[int, GenerationCall] = {}
        for file in files:
            try:
                data = file.read_bytes()
            except FileNotFoundError:  # deleted by the writer's retention while we read
                continue
            _read(data, file, calls)
        out.extend(calls[index] for index in sorted(calls))
    return [call for call in out if request_id is None or call.request_id == request_id]
