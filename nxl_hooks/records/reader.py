"""The crash-safe stream file's reader: :func:`read_stream` (the format: :mod:`nxl_hooks.records.writer`).

    nxl.read_stream("run.nxl")[0].steps      # the records of the first call
    nxl.read_stream("runs/")                 # every call in every folder below, a RotatingSink's files in order

Reading (:func:`read_stream`) stops at the first frame it cannot use and says so in the returned list's
``damage`` (a :class:`Damage`: which frame, at what offset, why, how many steps were recovered):

- a torn last frame (the writer was killed mid-write, or is still writing it) is the normal end of a killed run:
  it is left out quietly (``damage.torn`` True); so is a file header cut short (empty, or a part of the magic
  line: its writer stopped before its first record, or has just started the file), which reads as no call;
- frames whose checksums hold but whose order does not are damage too: a frame number out of sequence, a step
  that does not follow its call's last one (missing, repeated, out of order: ``damage.call`` and the reason name
  the call and the steps; not a call whose first steps a rotating sink deleted, starting at its first kept step
  in a rotated file or marked so in a file of its own, :func:`~nxl_hooks.records.writer.stream_bytes`), a rotated
  file missing between two kept ones, or renamed;
- any other damage (a flipped byte, a frame cut out, garbage) warns with :class:`StreamDamageWarning` and returns
  what comes before it; ``read_stream(path, strict=True)`` raises :class:`StreamError` instead;
- a frame whose checksum is right but whose content nxl_hooks did not write raises :class:`StreamError` (a
  ValueError), naming the frame and its offset, in either mode.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from ..arch.version import VERSION
from ..method.registry import DEFAULT
from .attribution import RecordError, read_blob, stored_scores
from .files import CHUNK, read_regular
from .steps import STEP_TENSORS, GenerationCall, Step
from .tokens import record_text
from .writer import _FILE_MAGIC, _FORMAT, _FRAME, _FRAME_MAGIC, _MAGIC_V1, _ROTATED, _later_format
from .view import Choice

__all__ = ["Damage", "Stream", "StreamDamageWarning", "StreamError", "read_stream"]


class StreamError(RecordError):
    """A stream file nxl_hooks cannot read: not a stream file, a frame with a valid checksum but content nxl_hooks
    did not write, or (``read_stream(..., strict=True)``) damage. Names the frame and its byte offset."""


class StreamDamageWarning(UserWarning):
    """:func:`read_stream` stopped early at a damaged frame (not a torn last frame); see ``damage`` on its result.
    ``warnings.simplefilter("error", nxl.StreamDamageWarning)`` makes it raise."""


@dataclass(frozen=True)
class Damage:
    """Where and why :func:`read_stream` stopped before the end of a file. ``calls.damage.frame``"""

    frame: int  #: index of the first frame not read (0 = the first frame after the file header)
    offset: int  #: its byte offset in the file
    reason: str  #: what is wrong with it
    torn: bool  #: a torn last frame (a writer killed mid-write): the normal end of a killed run, not corruption
    steps_recovered: int  #: step records read before it (all of them returned; in a folder, its writer's files')
    frames_after: int  #: intact frames found after it, not returned (a gap would make the calls lie)
    bytes_dropped: int  #: from ``offset`` to the end of the file
    path: str = ""  #: the file (one of a folder's, when read_stream was given a folder)
    #: the call whose records break off there, when one does: a step missing or repeated, or the one call running
    #: at a frame that cannot be read or a missing file (its reason names every call running)
    call: int | None = None

    def describe(self) -> str:
        """One line: ``frame 3 at byte 1234: CRC mismatch; 2 step records recovered before it, ...``"""
        lost = f", {self.frames_after} intact frame(s) after it not read" if self.frames_after else ""
        return (f"frame {self.frame} at byte {self.offset}: {self.reason}; {self.steps_recovered} step record(s) "
                f"recovered before it{lost} ({self.bytes_dropped} bytes left out)")


class Stream(list[GenerationCall]):
    """What :func:`read_stream` returns: a list of :class:`GenerationCall`, ``damage`` (None when every file ends
    on a complete frame; else the first damaged file's, a torn last frame only when no file is damaged otherwise:
    a killed writer's end must not hide records lost elsewhere) and ``damages`` (every file's, in reading order)."""

    damage: Damage | None = None
    damages: tuple[Damage, ...] = ()


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
    of the file (a flipped length byte also runs past the end: the caller checks that no intact frame follows, and
    this that the bytes up to the end are not the whole frame)."""
    rest = len(data) - offset
    if rest < len(_FRAME_MAGIC):
        return _FRAME_MAGIC.startswith(bytes(data[offset:]))
    if data[offset: offset + len(_FRAME_MAGIC)] != _FRAME_MAGIC:
        return False
    if rest >= _FRAME.size:
        _, length, crc = _FRAME.unpack_from(data, offset)
        if _FRAME.size + length <= rest:
            return False  # complete, so its checksum failed: altered, not torn
        if _crc(memoryview(data)[offset + _FRAME.size:]) == crc:
            return False  # all of it there (its checksum holds) but its length altered: a torn prefix's differs
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
    metadata, tensors = read_blob(payload)
    header = json.loads(metadata["nxl_hooks"]) if isinstance(metadata, dict) and "nxl_hooks" in metadata else None
    if not isinstance(header, dict):
        raise ValueError("no nxl_hooks record header in its metadata")
    return header, tensors


def _field(header: dict, name: str, kinds: tuple[type, ...], *, optional: bool = False) -> Any:
    """``header[name]`` of one of ``kinds``; a number is one a writer makes: a time (``float`` among ``kinds``) a
    finite count of seconds whose microseconds fit int64, an index or count (``int``) one that fits int32."""
    value = header.get(name)
    if value is None and optional:
        return value
    if isinstance(value, bool):
        fits = bool in kinds
    elif isinstance(value, (int, float)) and isinstance(value, kinds):
        fits = 0 <= value < (_SECONDS if float in kinds else _INDEX)  # (NaN fails, as does the infinity json reads)
    else:
        fits = isinstance(value, kinds)
    if fits:
        return value
    raise ValueError(f"{name!r} is {value!r:.80}, expected {' or '.join(k.__name__ for k in kinds)}")


def _text(header: dict, name: str) -> str | None:
    """An optional text of a call (its model, request, thread, error) as records keep it (:func:`record_text`: a file
    written before it was the rule may hold a name that is not UTF-8, which Parquet refuses)."""
    return record_text(_field(header, name, (str,), optional=True))


def _choice(header: dict) -> Choice | None:
    """A call's :class:`~.view.Choice` (``{"prompt": int or null, "sample": int}``); None in a file without one."""
    value = _field(header, "choice", (dict,), optional=True)
    return None if value is None else Choice.from_json(value)


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


#: Upper bounds of the numbers a writer puts in a frame's header: an index or count (fits int32), a time in seconds
#: (its microseconds fit int64), a token id (fits int64).
_INDEX, _SECONDS, _ID = 1 << 31, 1 << 40, 1 << 63


def _layers(header: dict) -> list[int]:
    layers = header.get("layers")
    if not isinstance(layers, list) or not layers or not all(type(x) is int and -_INDEX <= x < _INDEX
                                                             for x in layers):
        raise ValueError(f"'layers' is {layers!r:.80}, expected a list of layer indices")
    return layers


def _texts(header: dict, name: str, rows: int, width: int | None = None) -> Any:
    """An optional list of ``rows`` readable token texts (``width`` None: one per row), or of ``rows`` lists of
    ``width`` texts each."""
    value = header.get(name)
    if value is None or (isinstance(value, list) and len(value) == rows and all(
            isinstance(row, str) if width is None else
            isinstance(row, list) and len(row) == width and all(isinstance(text, str) for text in row)
            for row in value)):
        return value
    shape = f"{rows} token text(s)" if width is None else f"{rows} list(s) of {width} token texts"
    raise ValueError(f"{name!r} is {value!r:.80}, expected {shape}")


def _ints(header: dict, name: str) -> list[int] | None:
    """An optional list of ints (token ids)."""
    value = header.get(name)
    if value is None or (isinstance(value, list) and all(type(i) is int and -_ID <= i < _ID for i in value)):
        return value
    raise ValueError(f"{name!r} is {value!r:.80}, expected a list of token ids")


def _named_ids(header: dict, name: str) -> dict[int, str] | None:
    """An optional mapping of token ids to texts, its keys the ids as JSON writes them (``{"348": "␣Paris"}``)."""
    value = header.get(name)
    if value is None:
        return None
    if isinstance(value, dict) and all(isinstance(key, str) and re.fullmatch(r"-?[0-9]{1,20}", key)
                                       and isinstance(text, str) for key, text in value.items()):
        ids = {int(key): text for key, text in value.items()}
        if all(-_ID <= i < _ID for i in ids):
            return ids
    raise ValueError(f"{name!r} is {value!r:.80}, expected token ids and their texts")


class _Gap(Exception):
    """Frames whose checksums hold but whose order does not: a frame missing, repeated or moved."""

    def __init__(self, reason: str, call: int | None = None) -> None:
        super().__init__(reason)
        self.reason, self.call = reason, call


def _next_step(call: GenerationCall, number: int, *, rotated: bool) -> None:
    """Refuse (:class:`_Gap`) a step record that does not follow the call's last one. ``rotated``: a call's first
    step record may be a later step (a rotated file, or a step marked ``first_kept``: the steps before it were
    deleted by a rotating sink)."""
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
        shape = tuple(mask.shape)
        unprompted = shape == (0, 0)  # a call whose prompt never ran recorded (writer.encode_call)
        if mask.numel() == 0 and not unprompted:  # (rows of nothing would cost memory alone)
            raise ValueError(f"prompt_mask {shape} holds no token")
        # an unprompted call's prompt texts and template are passed over: nxl_hooks 0.4 before this release wrote
        # those of a call detached while its prompt was being recorded, which describe nothing recorded
        for name, value in (("prompt_ids", ids), ("prompt_template", None if unprompted else template)):
            if value is not None and value.shape != mask.shape:
                raise ValueError(f"{name} {tuple(value.shape)} and prompt_mask {shape} differ in shape")
        if unprompted:
            mask = ids = template = None
        calls[index] = GenerationCall(index=index, layers=_layers(header), prompt_ids=ids, prompt_mask=mask,
                                      request_id=_text(header, "request_id"),
                                      choice=_choice(header),
                                      thread=_text(header, "thread"),
                                      readable=None if unprompted else _texts(header, "readable", *shape),
                                      prompt_template=template,
                                      special_ids=_ints(header, "special_ids"),
                                      target_texts=None if unprompted else _named_ids(header, "target_texts"),
                                      model=_text(header, "model"),
                                      separator=_text(header, "separator") or "",
                                      continuation=_text(header, "continuation") or "",
                                      cleanup=_field(header, "cleanup", (bool,), optional=True) is True,
                                      clean_up_spaces=_field(header, "clean_up_spaces", (bool,), optional=True) is True,
                                      started=_field(header, "started", (float, int), optional=True),
                                      meta=_field(header, "meta", (dict,), optional=True) or None)
        return False
    if index not in calls and rotated:
        return False  # its call frame was in a file deleted by the RotatingSink's retention
    if index not in calls:
        raise ValueError(f"a {kind!r} frame for call {index}, which no 'call' frame opened")
    call = calls[index]
    if kind == "step":
        if call.prompt_mask is None:
            raise ValueError(f"a step frame for call {index}, whose 'call' frame holds no prompt")
        step = Step(call=index, step=_field(header, "step", (int,)), position=_field(header, "position", (int,)),
                    layers=_layers(header), n_blocks=_field(header, "n_blocks", (int,), optional=True),
                    probability=tensors.get("probability"),
                    readable=_texts(header, "readable", call.prompt_mask.shape[0]),
                    time=_field(header, "time", (float, int), optional=True),
                    scores=stored_scores(tensors),
                    **{name: tensors.get(name) for name in STEP_TENSORS if name not in DEFAULT})
        _check_step(step, call)
        call.link(step)
        call.steps.append(step)
        return True
    if kind == "end":
        call.sequences = _tensor(tensors, "sequences", 2, optional=True)
        call.complete = _field(header, "complete", (bool,))
        call.error = _text(header, "error")
        call.ended = _field(header, "ended", (float, int), optional=True)
        notes = _field(header, "notes", (list,), optional=True) or []
        if not all(isinstance(note, str) for note in notes):
            raise ValueError(f"'notes' is {notes!r:.80}, expected a list of texts")
        call.notes = [record_text(note) for note in notes]
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


def _saved_attribution(data: bytearray) -> bool:
    """Whether ``data`` is a file :meth:`Attribution.save` wrote (a safetensors blob with an ``nxl_hooks`` header):
    the likely mistake behind a stream read that fails at its first byte, worth its own line."""
    try:
        return "nxl_hooks" in read_blob(data)[0]
    except Exception:  # noqa: BLE001 - whatever fails to parse is no attribution file either
        return False


def _read(data: bytearray, path: Path, calls: dict[int, GenerationCall], *, name: tuple[int, int] | None
          ) -> tuple[int, Damage | None]:
    """Add the records of one stream file to ``calls`` (those of one writer so far): (steps read, damage or None).
    ``name``: (number, writer) of a rotated file, from its name."""
    if len(data) < len(_FILE_MAGIC) and _FILE_MAGIC.startswith(data):
        # its writer was killed while it wrote the header, or before (an empty file: created, or emptied to be
        # written): torn, as a last frame cut short is. An empty file of another origin reads so too: no byte tells
        # them apart, and neither holds a record
        return 0, Damage(frame=0, offset=0, reason=f"only {len(data)} bytes of the {len(_FILE_MAGIC)}-byte file "
                         "header: its writer stopped before its first record", torn=True, steps_recovered=0,
                         frames_after=0, bytes_dropped=len(data), path=str(path))
    if data.startswith(_FILE_MAGIC):
        numbered = True
    elif data.startswith(_MAGIC_V1):  # nxl_hooks 0.1: no frame numbers, no file frame
        numbered = False
    elif (later := _later_format(data)) is not None:
        raise StreamError(f"{path} is a stream file of format {later}, which a later nxl_hooks wrote: nxl_hooks "
                          f"{VERSION} reads formats 1 to {_FORMAT}; upgrade nxl_hooks to read it")
    elif _saved_attribution(data):
        raise StreamError(f"{path} is an attribution file (Attribution.save, nxl attribute --out without --generate), "
                          "not a stream: read it with nxl.Attribution.load(path)")
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
                    _next_step(call, number, rotated=name is not None or header.get("first_kept") is True)
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
            # a frame that cannot be read (altered, cut) names no call itself: the calls still running break off
            # there (a torn end is a killed writer's, not damage: said as it was)
            cut, call = ("", gap.call) if gap.call is not None or torn else _cut_off(calls)
            return steps, Damage(frame=index, offset=offset, reason=gap.reason + cut, torn=torn, steps_recovered=steps,
                                 frames_after=after, bytes_dropped=len(data) - offset, path=str(path), call=call)
    return steps, None


def _check_file(header: dict, index: int, name: tuple[int, int] | None) -> None:
    """A rotated file's first frame: its number and writer, which its name must repeat."""
    number, writer = _field(header, "file", (int,)), _field(header, "writer", (int,))
    if index != 0:
        raise ValueError("a 'file' frame that is not the file's first")
    if name is not None and (number, writer) != name:
        raise _Gap(f"the file says it is file {number} of writer {writer}, its name file {name[0]} of writer "
                   f"{name[1]}: renamed or copied over another")


def stream_files(path: Path) -> list[Path]:
    """The files :func:`read_stream` reads for ``path``: itself, or the stream files below a folder, in order."""
    return sorted(_stream_files(path)) if path.is_dir() else [path]


def _writers(folder: Path) -> list[list[Path]]:
    """The stream files below ``folder``, one list per writer (a RotatingSink's files joined in order)."""
    groups: dict[tuple, list[tuple[int, Path]]] = {}
    for path in stream_files(folder):
        match = _ROTATED.fullmatch(path.name)
        key = (str(path.parent), int(match.group(2))) if match else (str(path.parent), -1, path.name)
        groups.setdefault(key, []).append((int(match.group(1)) if match else 0, path))
    # a writer's files by number, not name: 100000000 comes after 99999999
    return [[path for _, path in sorted(groups[key])] for key in sorted(groups)]


def _stream_files(folder: Path) -> Iterator[Path]:
    """The ``*.nxl`` regular files below ``folder``, walked without recursion (a folder nested thousands deep is a
    folder like another) and without following links; a folder below it that cannot be listed (``lost+found``) is
    passed over."""
    folders = [folder]
    while folders:
        below = folders.pop()
        try:
            listing = os.scandir(below)
        except PermissionError:
            if below == folder:
                raise
            continue
        with listing as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    folders.append(Path(entry.path))
                elif entry.name.endswith(".nxl") and entry.is_file():  # (a link to a file is read)
                    yield Path(entry.path)


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
    for _ in range(_ATTEMPTS):
        try:
            return _read_stream(path, request_id=request_id, strict=strict)
        except _Moved:  # a writer's retention deleted a file after the ones before it were read: read the newest
            pass
    raise StreamError(f"{path}: its files were deleted by their writer's retention faster than they could be read; "
                      "read it again, or copy the folder first")


#: How many times a folder is read again when its writer rotates files away under the read.
_ATTEMPTS = 3


class _Moved(Exception):
    """A rotated file was deleted after the files before it were read."""


def _read_stream(path: Path, *, request_id: str | None, strict: bool) -> Stream:
    out, damages = Stream(), []
    for files in _writers(path) if path.is_dir() else [[path]]:
        calls: dict[int, GenerationCall] = {}
        found, steps, last = None, 0, None
        for file in files:
            match = _ROTATED.fullmatch(file.name)
            name = (int(match.group(1)), int(match.group(2))) if match else None
            if last is not None and name is not None and name[0] != last[0] + 1:
                cut, call = _cut_off(calls)
                found = Damage(frame=0, offset=0, reason=f"file {last[0] + 1:08d}-{name[1]:08d}.nxl is missing "
                               f"(deleted or lost) between {last[1].name} and {file.name}{cut}",
                               torn=False, steps_recovered=steps, frames_after=0, bytes_dropped=0, path=str(file),
                               call=call)
                break
            try:
                data = read_regular(file, StreamError)
            except FileNotFoundError:
                if name is None:
                    raise
                # deleted by the writer's retention while we read: the next one listed starts what is kept, else the
                # folder is listed again
                if last is None and file is not files[-1]:
                    continue
                raise _Moved() from None
            got, found = _read(data, file, calls, name=name)
            steps, last = steps + got, (name[0] if name else 0, file)
            if found is not None:
                # what the writer's files gave before it, as a missing file's damage counts it (not this file's only)
                found = dataclasses.replace(found, steps_recovered=steps)
                if found.torn and file is not files[-1]:
                    # only a writer's last file may end torn: the records go on in the next, and those of the calls
                    # running here break off, said as for any other frame that cannot be read
                    cut, call = _cut_off(calls)
                    found = dataclasses.replace(found, torn=False, reason=found.reason + cut, call=call)
                break
        if found is not None and not found.torn:
            if strict:
                raise StreamError(f"{found.path} is damaged: {found.describe()}")
            warnings.warn(f"{found.path} is damaged, read up to the damage: {found.describe()}",
                          StreamDamageWarning, stacklevel=2)
        if found is not None:
            damages.append(found)
        out.extend(calls[index] for index in sorted(calls))
    out[:] = [call for call in out if request_id is None or call.request_id == request_id]
    out.damages = tuple(damages)
    out.damage = next((found for found in damages if not found.torn), damages[0] if damages else None)
    return out


def _cut_off(calls: dict[int, GenerationCall]) -> tuple[str, int | None]:
    """What damage (a missing file, a frame that cannot be read) cuts off: the calls not ended yet, as the reason's
    ``; records of call 0 (after step 3) break off there`` ("" for none), and the call when it is the only one."""
    running = [c for c in calls.values() if not c.complete and c.error is None and c.sequences is None]
    named = [f"call {c.index} (after step {c.steps[-1].step})" if c.steps else f"call {c.index} (no step yet)"
             for c in running]
    return (f"; records of {', '.join(named)} break off there" if named else "",
            running[0].index if len(running) == 1 else None)
