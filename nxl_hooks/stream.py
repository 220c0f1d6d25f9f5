"""Per-token records of a ``generate`` call, and the ways they leave the probe while the model runs.

    with nxl.attach(model, tokenizer=tok, on_step=print, sink="run.nxl") as probe:
        out = model.generate(**enc, max_new_tokens=32)
    probe.steps[0].normxlogit            # (len(layers), batch, context_len)
    nxl.read_stream("run.nxl")[0].steps  # the same records, read back from disk

Four ways out, all fed the same :class:`Step` objects as soon as each is complete:

- ``probe.calls[i].steps`` (``probe.steps`` = the last call's), unless ``attach(..., keep_steps=False)``;
- ``attach(..., on_step=fn)``: ``fn(step)`` runs in the thread that runs ``generate``; an exception it raises
  stops the generation;
- ``probe.stream()``: an iterator another thread consumes while ``generate`` runs;
- ``attach(..., sink="run.nxl")``: an append-only file, readable with :func:`read_stream`.

Sink format (no pickle): the line ``nxl_hooks.stream/1\\n``, then frames. A frame is ``b"NXLF"``, the payload
length (uint64 little-endian), its CRC-32 (uint32 little-endian) and the payload: a safetensors blob whose
``nxl_hooks`` metadata entry is JSON with a ``kind`` of ``call`` (prompt), ``step`` or ``end`` (sequences).
Each frame is written with one ``write`` call before the next decoding step starts, so a process killed with
SIGKILL leaves every completed step readable; a torn last frame fails its length or CRC check and is ignored.
``Sink(path, fsync=True)`` also survives power loss, at the cost of an fsync per step.
"""

from __future__ import annotations

import json
import os
import queue
import struct
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors.torch import load as _load_blob
from safetensors.torch import save as _save_blob

from .attribution import Attribution

__all__ = ["GenerationCall", "Sink", "Step", "read_stream"]

_FILE_MAGIC = b"nxl_hooks.stream/1\n"
_FRAME = struct.Struct("<4sQI")
_FRAME_MAGIC = b"NXLF"
_STEP_TENSORS = ("token", "target", "normxlogit", "logat", "embed_norm", "mask", "active")


@dataclass(eq=False)  # records compare by identity: tensor fields have no single truth value
class Step:
    """The attribution of one emitted token: what the context before it contributed to it, per layer.

    ``step.normxlogit[step.layers.index(l), b, i]``: token i's NormXLogit, at layer l, for row b's emitted token.
    Rows are generate's rows (``num_return_sequences`` rows per prompt). A row that has finished (emitted an
    EOS token) keeps getting records until the whole batch stops, as generate keeps padding it: those records
    explain the pad token generate emitted and have ``active`` False; the pad positions have ``mask`` False.
    """

    call: int  #: index of the generate call under this probe (``probe.calls[call]``)
    step: int  #: 0 for the first new token
    position: int  #: index of the emitted token in the full sequence (prompt, left padding included)
    token: torch.Tensor  #: int64 (batch,): the token id generate emitted (sampled or argmax)
    target: torch.Tensor  #: int64 (batch,) the explained id (= token unless attach(target=...)), or (batch, k)
    normxlogit: torch.Tensor  #: float32 (len(layers), batch, position[, k]): every position before the token
    logat: torch.Tensor  #: float32, same shape: HoT(h_i^l)[target]
    embed_norm: torch.Tensor  #: float32 (batch, position)
    mask: torch.Tensor  #: bool (batch, position): False on left padding and on pad tokens after a row's EOS
    active: torch.Tensor  #: bool (batch,): False where the row had already finished before this step
    layers: list[int]
    n_blocks: int | None = None  #: the model's block count, for negative layer indices


    def to_attribution(self, tokens: list[list[str]] | None = None) -> Attribution:
        """This step as an :class:`Attribution` (prediction position = ``position - 1``), e.g. for ``.top()``."""
        batch = self.token.shape[0]
        return Attribution(
            normxlogit=self.normxlogit,
            logat=self.logat,
            embed_norm=self.embed_norm,
            layers=list(self.layers),
            target=self.target,
            mask=self.mask,
            position=torch.full((batch,), self.position - 1, dtype=torch.long),
            example=torch.arange(batch),
            tokens=tokens,
            meta={"call": self.call, "step": self.step, "n_blocks": self.n_blocks},
        )


@dataclass(eq=False)
class GenerationCall:
    """One ``generate`` call under a probe: its prompt, its step records and, once it returned, its output."""

    index: int
    layers: list[int]
    prompt_ids: torch.Tensor | None = None  #: int64 (batch, prompt_len) as the first forward saw it
    prompt_mask: torch.Tensor | None = None  #: bool (batch, prompt_len)
    steps: list[Step] = field(default_factory=list)  #: empty with attach(keep_steps=False)
    sequences: torch.Tensor | None = None  #: generate's output ids, set when the call returned
    complete: bool = False  #: True once generate returned normally (or, read from disk, its end frame exists)


class _End:
    """Queue sentinel: the watched call ended (or the probe detached)."""


class _Subscription:
    """The iterator :meth:`Probe.stream` returns; registered at creation so no record is missed."""

    def __init__(self) -> None:
        self.queue: queue.Queue = queue.Queue()

    def __iter__(self) -> "_Subscription":
        return self

    def __next__(self) -> Step:
        item = self.queue.get()
        if item is _End:
            raise StopIteration
        return item


class _Hub:
    """Hands every finished record to the probe's call list, the callback, the subscribers and the sink."""

    def __init__(self, *, on_step: Callable[[Step], Any] | None, sink: "str | Path | Sink | None",
                 keep_steps: bool) -> None:
        self.calls: list[GenerationCall] = []
        self._on_step = on_step
        self._sink = sink if isinstance(sink, Sink) or sink is None else Sink(sink)
        self._keep = keep_steps
        self._lock = threading.Lock()
        self._subscribers: list[_Subscription] = []
        self._running: GenerationCall | None = None
        self._closed = False  # the probe detached: a late subscriber must not wait for a call that never comes

    def begin(self, layers: list[int]) -> GenerationCall:
        call = GenerationCall(index=len(self.calls), layers=list(layers))
        with self._lock:
            self.calls.append(call)
            self._running = call
        return call

    def prompt(self, call: GenerationCall, ids: torch.Tensor | None, mask: torch.Tensor, meta: dict) -> None:
        call.prompt_ids, call.prompt_mask = ids, mask
        if self._sink is not None:
            self._sink.write_call(call, meta)

    def publish(self, step: Step) -> None:
        call = self.calls[step.call]
        with self._lock:
            if self._keep:
                call.steps.append(step)
            for subscriber in self._subscribers:
                subscriber.queue.put(step)
        if self._sink is not None:
            self._sink.write_step(step)
        if self._on_step is not None:
            self._on_step(step)

    def end(self, call: GenerationCall, sequences: torch.Tensor | None) -> None:
        call.sequences, call.complete = sequences, sequences is not None
        if self._sink is not None and call.prompt_mask is not None:
            self._sink.write_end(call)
        self._release()

    def subscribe(self) -> _Subscription:
        subscription = _Subscription()
        with self._lock:
            if self._closed:
                subscription.queue.put(_End)
                return subscription
            if self._running is not None:  # joined mid-call: replay what that call already produced
                for step in self._running.steps:
                    subscription.queue.put(step)
            self._subscribers.append(subscription)
        return subscription

    def _release(self) -> None:
        with self._lock:
            self._running = None
            subscribers, self._subscribers = self._subscribers, []
        for subscriber in subscribers:
            subscriber.queue.put(_End)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._release()
        if self._sink is not None:
            self._sink.close()


class Sink:
    """Append-only, crash-safe record file (format in the module docstring). ``attach(..., sink=Sink(p, fsync=True))``

    The file is created (or truncated) when the probe attaches; read it with :func:`read_stream`.
    """

    def __init__(self, path: str | Path, *, fsync: bool = False) -> None:
        self.path = Path(path)
        self._fsync = fsync
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        self._write(_FILE_MAGIC)

    def _write(self, data: bytes) -> None:
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
        self._frame(tensors, {"kind": "call", "call": call.index, "layers": call.layers, "meta": meta})

    def write_step(self, step: Step) -> None:
        tensors = {name: getattr(step, name) for name in _STEP_TENSORS}
        self._frame(tensors, {"kind": "step", "call": step.call, "step": step.step, "position": step.position,
                              "layers": step.layers, "n_blocks": step.n_blocks})

    def write_end(self, call: GenerationCall) -> None:
        tensors = {"sequences": call.sequences} if call.sequences is not None else {}
        self._frame(tensors, {"kind": "end", "call": call.index, "complete": call.complete})

    def close(self) -> None:
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


def read_stream(path: str | Path) -> list[GenerationCall]:
    """Every call and step record in a sink file, up to the last complete frame. ``nxl.read_stream("run.nxl")``

    A call whose ``end`` frame is missing (the writer was killed) has ``complete`` False and no ``sequences``.
    """
    data = Path(path).read_bytes()
    if not data.startswith(_FILE_MAGIC):
        raise ValueError(f"{path} is not an nxl_hooks stream file (written by attach(..., sink=path))")
    calls: dict[int, GenerationCall] = {}
    for header, tensors in _frames(data):
        kind, index = header["kind"], header["call"]
        if kind == "call":
            calls[index] = GenerationCall(index=index, layers=header["layers"], prompt_ids=tensors.get("prompt_ids"),
                                          prompt_mask=tensors["prompt_mask"])
        elif kind == "step":
            calls[index].steps.append(Step(call=index, step=header["step"], position=header["position"],
                                           layers=header["layers"], n_blocks=header.get("n_blocks"),
                                           **{n: tensors[n] for n in _STEP_TENSORS}))
        elif kind == "end":
            calls[index].sequences = tensors.get("sequences")
            calls[index].complete = bool(header["complete"])
    return [calls[index] for index in sorted(calls)]


def print_generation(model: Any, tokenizer: Any, text: str, new_tokens: int, *, layers: Any = "all", top: int = 3,
                     embedding: str = "layer_input", console: Any = None,
                     sink: "str | Path | None" = None) -> GenerationCall:
    """Generate greedily after ``text`` and print each token's attribution as soon as it is emitted: the view of
    ``nxl attribute MODEL TEXT --generate N``. One line per token: the token, then per selected layer the ``top``
    context tokens by signed NormXLogit; ``embedding`` goes to :func:`nxl_hooks.attach`. Returns the call's records.

    ``print_generation(model, tok, "The capital of France is", 8, layers=[-1])``
    """
    from rich.console import Console
    from rich.text import Text

    from .capture import attach

    console = console or Console()
    enc = tokenizer(text, return_tensors="pt").to(model.device)
    names = tokenizer.convert_ids_to_tokens(enc["input_ids"][0].tolist())
    console.print(Text(f"prompt ({len(names)} tokens): ", style="bold") + Text(" ".join(names)))

    def show(step: Step) -> None:
        token = tokenizer.convert_ids_to_tokens(int(step.token[0]))
        res = step.to_attribution(tokens=[list(names)])
        line = Text(f"{step.step:>4} ", style="dim") + Text(f"{token!r:>14}", style="bold green") + Text("  ")
        for layer in step.layers[::-1]:
            best = " ".join(f"{name!r}:{score:.3g}" for _, name, score in res.top(top, layer=layer))
            line += Text(f"L{layer} ", style="bold") + Text(best + "  ")
        console.print(line, overflow="fold")
        names.append(token)

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with attach(model, layers=layers, tokenizer=tokenizer, embedding=embedding, on_step=show, sink=sink) as probe:
        if probe.kind != "causal_lm":
            raise ValueError(f"generating needs a causal LM; {type(probe.model).__name__} is a {probe.kind} model")
        model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    return probe.calls[-1]
