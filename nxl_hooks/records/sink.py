"""The crash-safe stream file: every call and step record appended as it is made, readable after a SIGKILL.

    with nxl.attach(model, sink="run.nxl"):
        model.generate(**enc, max_new_tokens=32)
    nxl.read_stream("run.nxl")[0].steps      # the records, read back from disk

Format (no pickle): the line ``nxl_hooks.stream/1\\n``, then frames. A frame is ``b"NXLF"``, the payload
length (uint64 little-endian), its CRC-32 (uint32 little-endian) and the payload: a safetensors blob whose
``nxl_hooks`` metadata entry is JSON with a ``kind`` of ``call`` (prompt), ``step`` or ``end`` (sequences).
Each frame is written with one ``write`` call before the next decoding step starts, so a process killed with
SIGKILL leaves every completed step readable. ``Sink(path, fsync=True)`` also survives power loss, at the cost of
an fsync per step. A sink refuses to write through a symbolic link unless ``Sink(path, follow_symlinks=True)``.

Reading (:func:`read_stream`) stops at the first frame it cannot use and says so in the returned list's
``damage`` (a :class:`Damage`: which frame, at what offset, why, how many steps were recovered):

- a torn last frame (the writer was killed mid-write, or is still writing it) is the normal end of a killed run:
  it is left out quietly (``damage.torn`` True);
- any other damage (a flipped byte, a frame cut out, garbage) warns with :class:`StreamDamageWarning` and returns
  what comes before it; ``read_stream(path, strict=True)`` raises :class:`StreamError` instead;
- a frame whose checksum is right but whose content nxl_hooks did not write raises :class:`StreamError` (a
  ValueError), naming the frame and its offset, in either mode.
"""

from __future__ import annotations

import errno
import json
import os
import struct
import threading
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import load as _load_blob
from safetensors.torch import save as _save_blob

from .attribution import RecordError
from .steps import STEP_TENSORS, GenerationCall, Step

__all__ = ["Damage", "Sink", "Stream", "StreamDamageWarning", "StreamError", "read_stream"]

_FILE_MAGIC = b"nxl_hooks.stream/1\n"
_FRAME = struct.Struct("<4sQI")
_FRAME_MAGIC = b"NXLF"


class Sink:
    """Append-only, crash-safe record file (format in the module docstring). ``attach(..., sink=Sink(p, fsync=True))``

    The file is created (or truncated) when the probe attaches; read it with :func:`read_stream`. A path that is a
    symbolic link is refused (ValueError), so that a link planted where the file goes cannot redirect the records
    (and the truncation) onto another file; ``follow_symlinks=True`` writes through it.
    """

    def __init__(self, path: str | Path, *, fsync: bool = False, follow_symlinks: bool = False) -> None:
        self.path = Path(path)
        self._fsync = fsync
        self._lock = threading.Lock()  # calls in several threads share one file: one frame at a time
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | (0 if follow_symlinks else os.O_NOFOLLOW)
        try:  # O_NOFOLLOW: the check and the open are one step, no window to swap a link in between
            self._fd: int | None = os.open(self.path, flags, 0o644)
        except OSError as err:
            if err.errno == errno.ELOOP and not follow_symlinks:
                raise ValueError(f"{self.path} is a symbolic link: nxl_hooks does not write a stream through a link "
                                 "unless told to; give the real path, or Sink(path, follow_symlinks=True)") from None
            raise
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
                              "request_id": call.request_id, "thread": call.thread})

    def write_step(self, step: Step) -> None:
        tensors = {name: getattr(step, name) for name in STEP_TENSORS}
        self._frame(tensors, {"kind": "step", "call": step.call, "step": step.step, "position": step.position,
                              "layers": step.layers, "n_blocks": step.n_blocks})

    def write_end(self, call: GenerationCall) -> None:
        tensors = {"sequences": call.sequences} if call.sequences is not None else {}
        self._frame(tensors, {"kind": "end", "call": call.index, "complete": call.complete, "error": call.error})

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.fsync(self._fd)
                os.close(self._fd)
                self._fd = None


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

    def describe(self) -> str:
        """One line: ``frame 3 at byte 1234: CRC mismatch; 2 step records recovered before it, ...``"""
        lost = f", {self.frames_after} intact frame(s) after it not read" if self.frames_after else ""
        return (f"frame {self.frame} at byte {self.offset}: {self.reason}; {self.steps_recovered} step record(s) "
                f"recovered before it{lost} ({self.bytes_dropped} bytes left out)")


class Stream(list):
    """What :func:`read_stream` returns: a list of :class:`GenerationCall`, and ``damage`` (None when the file ends
    on a complete frame)."""

    damage: Damage | None = None


def _frame_at(data: bytes, offset: int) -> tuple[bytes | None, str]:
    """(payload, "") for an intact frame at ``offset``, else (None, why not)."""
    if offset + _FRAME.size > len(data):
        return None, f"only {len(data) - offset} bytes of a {_FRAME.size}-byte frame header"
    magic, length, crc = _FRAME.unpack_from(data, offset)
    if magic != _FRAME_MAGIC:
        return None, f"no frame marker ({magic!r} instead of {_FRAME_MAGIC!r})"
    payload = data[offset + _FRAME.size: offset + _FRAME.size + length]
    if len(payload) != length:
        return None, f"the frame announces {length} bytes but only {len(payload)} follow"
    if zlib.crc32(payload) != crc:
        return None, "checksum (CRC-32) mismatch: the frame was altered after it was written"
    return payload, ""


def _torn(data: bytes, offset: int) -> bool:
    """Whether the bad frame at ``offset`` looks like a torn last frame: a prefix of a frame that runs past the end
    of the file (a flipped length byte also runs past the end: the caller checks that no intact frame follows)."""
    rest = data[offset:]
    if len(rest) < len(_FRAME_MAGIC):
        return _FRAME_MAGIC.startswith(rest)
    if not rest.startswith(_FRAME_MAGIC):
        return False
    if len(rest) >= _FRAME.size:
        _, length, _ = _FRAME.unpack_from(rest, 0)
        if _FRAME.size + length <= len(rest):
            return False  # complete, so its checksum failed: altered, not torn
    return True


def _intact_after(data: bytes, offset: int) -> int:
    """How many intact frames start after ``offset`` (found by their marker and checksum)."""
    count, start = 0, data.find(_FRAME_MAGIC, offset + 1)
    while start != -1:
        payload, _ = _frame_at(data, start)
        if payload is not None:
            count += 1
            start = data.find(_FRAME_MAGIC, start + _FRAME.size + len(payload))
        else:
            start = data.find(_FRAME_MAGIC, start + 1)
    return count


def _frames(data: bytes) -> Iterator[tuple[int, int, bytes | None, str]]:
    """(index, offset, payload, "") per intact frame; the first bad one comes as (index, offset, None, why), last."""
    offset, index = len(_FILE_MAGIC), 0
    while offset < len(data):
        payload, why = _frame_at(data, offset)
        yield index, offset, payload, why
        if payload is None:
            return
        offset += _FRAME.size + len(payload)
        index += 1


def _decode(payload: bytes) -> tuple[dict, dict[str, torch.Tensor]]:
    """A frame's header (its ``nxl_hooks`` metadata) and tensors; ValueError when it is not such a blob."""
    (size,) = struct.unpack_from("<Q", payload, 0) if len(payload) >= 8 else (None,)
    if size is None or size > len(payload) - 8:
        raise ValueError("not a safetensors blob")
    metadata = json.loads(payload[8: 8 + size]).get("__metadata__") or {}  # safetensors' load() drops it
    header = json.loads(metadata["nxl_hooks"]) if isinstance(metadata, dict) and "nxl_hooks" in metadata else None
    if not isinstance(header, dict):
        raise ValueError("no nxl_hooks record header in its metadata")
    return header, _load_blob(payload)


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


def _apply(calls: dict[int, GenerationCall], header: dict, tensors: dict[str, torch.Tensor]) -> bool:
    """Add one frame's record to ``calls``; True for a step record. ValueError when it does not fit."""
    kind, index = header.get("kind"), _field(header, "call", (int,))
    if kind == "call":
        if index in calls:
            raise ValueError(f"a second 'call' frame for call {index}")
        mask = _tensor(tensors, "prompt_mask", 2, boolean=True)
        ids = _tensor(tensors, "prompt_ids", 2, optional=True)
        if ids is not None and ids.shape != mask.shape:
            raise ValueError(f"prompt_ids {tuple(ids.shape)} and prompt_mask {tuple(mask.shape)} differ in shape")
        calls[index] = GenerationCall(index=index, layers=_layers(header), prompt_ids=ids, prompt_mask=mask,
                                      request_id=_field(header, "request_id", (str,), optional=True),
                                      thread=_field(header, "thread", (str,), optional=True))
        return False
    if index not in calls:
        raise ValueError(f"a {kind!r} frame for call {index}, which no 'call' frame opened")
    call = calls[index]
    if kind == "step":
        step = Step(call=index, step=_field(header, "step", (int,)), position=_field(header, "position", (int,)),
                    layers=_layers(header), n_blocks=_field(header, "n_blocks", (int,), optional=True),
                    **{name: tensors.get(name) for name in STEP_TENSORS})
        _check_step(step, call)
        call.steps.append(step)
        return True
    if kind == "end":
        call.sequences = _tensor(tensors, "sequences", 2, optional=True)
        call.complete = _field(header, "complete", (bool,))
        call.error = _field(header, "error", (str,), optional=True)
        return False
    raise ValueError(f"unknown record kind {kind!r} (expected 'call', 'step' or 'end')")


def _check_step(step: Step, call: GenerationCall) -> None:
    """A step record whose tensors fit each other, its call's batch and its position."""
    batch = call.prompt_mask.shape[0]
    token, active = _tensor(vars(step), "token", 1), _tensor(vars(step), "active", 1, boolean=True)
    if token.shape[0] != batch or active.shape[0] != batch:
        raise ValueError(f"step {step.step}: token / active have {token.shape[0]} / {active.shape[0]} rows, "
                         f"the call's prompt {batch}")
    scores = step.normxlogit
    if scores is None or scores.dim() < 3 or scores.shape[1:3] != (batch, step.position) or step.position < 1:
        raise ValueError(f"step {step.step}: normxlogit {None if scores is None else tuple(scores.shape)} does not "
                         f"cover {batch} row(s) x {step.position} positions")
    step.to_attribution().check()  # every other field, by the one set of rules of Attribution


def read_stream(path: str | Path, *, request_id: str | None = None, strict: bool = False) -> Stream:
    """Every call and step record in a sink file, up to the first frame that cannot be read. ``nxl.read_stream(p)``

    A call whose ``end`` frame is missing (the writer was killed) has ``complete`` False and no ``sequences``.
    ``request_id``: only the calls of that request. The result is a list with a ``damage`` attribute (see the module
    docstring): None for a whole file; a torn last frame is left out quietly; other damage warns
    (:class:`StreamDamageWarning`), or raises :class:`StreamError` with ``strict=True``. A frame with a valid checksum
    that nxl_hooks did not write raises :class:`StreamError`.
    """
    data = Path(path).read_bytes()
    if not data.startswith(_FILE_MAGIC):
        raise StreamError(f"{path} is not an nxl_hooks stream file (written by attach(..., sink=path))")
    calls: dict[int, GenerationCall] = {}
    steps, damage = 0, None
    for index, offset, payload, why in _frames(data):
        if payload is None:
            after = _intact_after(data, offset)
            damage = Damage(frame=index, offset=offset, reason=why, torn=not after and _torn(data, offset),
                            steps_recovered=steps, frames_after=after, bytes_dropped=len(data) - offset)
            break
        try:
            steps += _apply(calls, *_decode(payload))
        except Exception as err:  # noqa: BLE001 - any parse failure of a frame whose checksum holds is one error
            raise StreamError(f"{path}: frame {index} at byte {offset} has a valid checksum but is not a record "
                              f"nxl_hooks wrote ({type(err).__name__}: {err})") from None
    if damage is not None and not damage.torn:
        if strict:
            raise StreamError(f"{path} is damaged: {damage.describe()}")
        warnings.warn(f"{path} is damaged, read up to the damage: {damage.describe()}", StreamDamageWarning,
                      stacklevel=2)
    out = Stream(calls[i] for i in sorted(calls) if request_id is None or calls[i].request_id == request_id)
    out.damage = damage
    return out
