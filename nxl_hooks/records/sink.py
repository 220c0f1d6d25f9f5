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
"""

from __future__ import annotations

import json
import os
import struct
import threading
import zlib
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import load as _load_blob
from safetensors.torch import save as _save_blob

from .steps import STEP_TENSORS, GenerationCall, Step

__all__ = ["Sink", "read_stream"]

_FILE_MAGIC = b"nxl_hooks.stream/1\n"
_FRAME = struct.Struct("<4sQI")
_FRAME_MAGIC = b"NXLF"


class Sink:
    """Append-only, crash-safe record file (format in the module docstring). ``attach(..., sink=Sink(p, fsync=True))``

    The file is created (or truncated) when the probe attaches; read it with :func:`read_stream`.
    """

    def __init__(self, path: str | Path, *, fsync: bool = False) -> None:
        self.path = Path(path)
        self._fsync = fsync
        self._lock = threading.Lock()  # calls in several threads share one file: one frame at a time
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        self._write(_FILE_MAGIC)

    def _write(self, data: bytes) -> None:
        with self._lock:
            if self._fd is None:
                raise RuntimeError(f"sink {self.path} is closed: the probe it belonged to has detached")
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
            if self._fsync:
                os.fsync(self._fd)

    def _frame(self, tensors: dict[str, torch.Tensor], header: dict) -> None:
        # copies: safetensors refuses tensors that share storage (a step's target is a view of its token)
        tensors = {name: value.detach().to("cpu", copy=True).contiguous() for name, value in tensors.items()}
        payload = _save_blob(tensors, metadata={"nxl_hooks": json.dumps(header)})
        self._write(_FRAME.pack(_FRAME_MAGIC, len(payload), zlib.crc32(payload)) + payload)

    def write_call(self, call: GenerationCall, meta: dict) -> None:
        tensors = {"prompt_mask": call.prompt_mask}
        if call.prompt_ids is not None:
            tensors["prompt_ids"] = call.prompt_ids
        self._frame(tensors, {"kind": "call", "call": call.index, "layers": call.layers, "meta": meta,
                              "request_id": call.request_id, "thread": call.thread, "readable": call.readable})

    def write_step(self, step: Step) -> None:
        tensors = {name: getattr(step, name) for name in STEP_TENSORS}
        if step.probability is not None:
            tensors["probability"] = step.probability
        self._frame(tensors, {"kind": "step", "call": step.call, "step": step.step, "position": step.position,
                              "layers": step.layers, "n_blocks": step.n_blocks, "readable": step.readable})

    def write_end(self, call: GenerationCall) -> None:
        tensors = {"sequences": call.sequences} if call.sequences is not None else {}
        self._frame(tensors, {"kind": "end", "call": call.index, "complete": call.complete, "error": call.error})

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.fsync(self._fd)
                os.close(self._fd)
                self._fd = None


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


def read_stream(path: str | Path, *, request_id: str | None = None) -> list[GenerationCall]:
    """Every call and step record in a sink file, up to the last complete frame. ``nxl.read_stream("run.nxl")``

    A call whose ``end`` frame is missing (the writer was killed) has ``complete`` False and no ``sequences``.
    ``request_id``: only the calls of that request.
    """
    data = Path(path).read_bytes()
    if not data.startswith(_FILE_MAGIC):
        raise ValueError(f"{path} is not an nxl_hooks stream file (written by attach(..., sink=path))")
    calls: dict[int, GenerationCall] = {}
    for header, tensors in _frames(data):
        kind, index = header["kind"], header["call"]
        if kind == "call":
            calls[index] = GenerationCall(index=index, layers=header["layers"], prompt_ids=tensors.get("prompt_ids"),
                                          prompt_mask=tensors["prompt_mask"], request_id=header.get("request_id"),
                                          thread=header.get("thread"), readable=header.get("readable"))
        elif kind == "step":
            calls[index].steps.append(Step(call=index, step=header["step"], position=header["position"],
                                           layers=header["layers"], n_blocks=header.get("n_blocks"),
                                           probability=tensors.get("probability"), readable=header.get("readable"),
                                           **{n: tensors[n] for n in STEP_TENSORS}))
        elif kind == "end":
            calls[index].sequences = tensors.get("sequences")
            calls[index].complete = bool(header["complete"])
            calls[index].error = header.get("error")
    return [calls[index] for index in sorted(calls) if request_id is None or calls[index].request_id == request_id]


