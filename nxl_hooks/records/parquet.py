"""Step records as tidy Parquet rows, for pandas, Polars or DuckDB (needs ``pip install "nxl_hooks[parquet]"``).

    nxl.attach(model, tokenizer=tok, sink="parquet:scores.parquet")     # live, written at detach
    nxl export runs/ scores.parquet                                     # offline, from stream files
    pandas.read_parquet("scores.parquet").query("layer == -1 and step == 0")
    rows = pandas.read_parquet("scores.parquet").query("ranked and in_prompt and step == 0")   # as top() ranks

One row per (call, batch row, step, layer, context position[, explained target]) where the position is real
(``mask`` True: left padding and pads after a row's end are left out). Columns (:data:`SCHEMA`):

===================  ==========================================================================================
``request_id``       the request the call served (a generated id where no request named it)
``call``, ``row``    the call's index under its probe, generate's batch row
``choice_prompt``,   which of its request's choices the call generated (:class:`~.view.Choice`: a vLLM request with
``choice_sample``    ``n`` > 1 or several prompts is several calls under one request id): its prompt (null for a chat)
                     and sample; both null where not known (no server said: ``generate``, older files)
``step``             0 for the first new token; ``emitted_position``: that token's index in the sequence
``emitted_id``       the token generate emitted at this step; ``emitted_text`` as people read it ('␣Paris')
``active``           False where the row had already ended (the step explains a pad token)
``layer``            the layer index (0..L, negative indices given to attach resolved)
``position``         the context position scored; ``token_id`` / ``token_text``: the token there (null where the
                     records do not hold it: a prompt given as ``inputs_embeds``, steps a rotated file deleted)
``target_index``     0, or which of the k explained ids (``attach(target=[...])``)
``target_id``        the explained id; ``target_text`` its text when known; ``probability`` the model's own
``normxlogit``       the score; ``logat`` (HoT(h_i^l)[target]) and ``embed_norm`` (‖e_i‖) it is made of
*method*             one column per other attribution method the probe computed (``attach(methods=[...])``),
                     named after it (``contrastive``), after ``logat``; null where a record does not have it;
                     float64, which holds whatever float a method returns exactly (``normxlogit``, ``logat``
                     and ``embed_norm`` are float32, as they are computed)
``model``            the model's name (its folder or hub id); ``time`` when the step was made (UTC)
``in_prompt``        True on the prompt's positions, False on generated tokens
``prediction_position``  where the step's prediction was read (``emitted_position - 1``)
``special``          the token is one of the tokenizer's special tokens (False where the records do not say)
``template``         the position is the chat template's own (markers, system prompt; False for other prompts)
``ranked``           the position takes part in a ranking: :func:`~nxl_hooks.method.select.rankable` of the step's
                     context, the rule of ``Attribution.top()``, the terminal and the HTML (not the prediction
                     position, special or template tokens, unless nothing else is left)
===================  ==========================================================================================

A call with no rows to show for all it ran (not recorded, stopped early, notes on its records, or not ended when
the file was closed) is listed with why in the file's key-value metadata, ``nxl.calls`` (JSON, in the footer:
``pyarrow.parquet.read_metadata``, Polars' ``read_parquet_metadata``, DuckDB's ``parquet_kv_metadata``):
``{"calls": N, "listed": [{"call", "request_id", "choice", "model", "recorded", "complete", "error", "notes"},
...], "more": K}`` (at most :data:`LISTED` calls, ``more`` the rest). ``nxl.models`` says what made the rows: per model
name, what its probe explains (``call.meta``: dtype, quantization, head kind, methods, package versions)::

    json.loads(pyarrow.parquet.read_metadata("scores.parquet").metadata[b"nxl.calls"])["listed"]

"Which prompt token drove the first token most at the last layer", as the library ranks it::

    df = pandas.read_parquet("scores.parquet")
    last = df[(df.layer == df.layer.max()) & (df.step == 0) & df.ranked & df.in_prompt]
    last.loc[last.groupby(["call", "row"]).normxlogit.idxmax(), ["call", "row", "position", "token_text"]]

Records of older stream files have no model, time or special-token ids: those columns are null (``special`` False).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
from pathlib import Path
from typing import Any, Iterable

import torch

from ..arch.text import install_command
from ..method.registry import DEFAULT
from ..method.select import rankable, special_flags
from .files import STREAM_MAGIC
from .steps import GenerationCall, Step
from .writer import claim_file, held

__all__ = ["INSTALL", "ParquetSink", "export_parquet", "pyarrow_module"]

#: What to run when pyarrow is missing.
INSTALL = install_command("parquet")
#: The sink kind made here (:data:`nxl_hooks.records.sinks.DECLARED`): ``parquet:PATH``, where pyarrow is installed;
#: PATH is a file in a folder that must be there (``"arg": "file"``).
SINKS = {"parquet": {"factory": "ParquetSink", "needs": "pyarrow.parquet", "extra": "parquet", "arg": "file"}}
#: The most calls ``nxl.calls`` lists (a server's file may hold millions of calls; the rest are counted).
LISTED = 10_000
#: The first bytes of every Parquet file: a writer's unfinished file begins with them (or is still empty).
_MAGIC = b"PAR1"


def pyarrow_module() -> Any:
    """pyarrow with its ``parquet`` submodule, or one ImportError line saying what to install.
    ``pa = pyarrow_module()``"""
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401 - the submodule ParquetSink writes with
    except ImportError:
        raise ImportError(f"Parquet export needs pyarrow: {INSTALL}", name="pyarrow") from None
    return pyarrow


def schema(methods: Iterable[str] = DEFAULT) -> Any:
    """The Arrow schema of the rows (see the module docstring), with a column for each of ``methods`` beyond
    NormXLogit and LogAt."""
    pa = pyarrow_module()
    # float64 whatever a method's records hold: a live sink fixes its columns at the first call, before any score,
    # and float64 keeps a method's float16 to float64 scores exact alike (one column type for every file too)
    extra = [(name, pa.float64()) for name in dict.fromkeys(methods) if name not in DEFAULT]
    return pa.schema([
        ("request_id", pa.string()), ("call", pa.int64()), ("choice_prompt", pa.int32()), ("choice_sample", pa.int32()),
        ("row", pa.int32()), ("step", pa.int32()),
        ("emitted_position", pa.int32()), ("emitted_id", pa.int64()), ("emitted_text", pa.string()),
        ("active", pa.bool_()), ("layer", pa.int32()), ("position", pa.int32()), ("token_id", pa.int64()),
        ("token_text", pa.string()), ("target_index", pa.int32()), ("target_id", pa.int64()),
        ("target_text", pa.string()), ("probability", pa.float32()), ("normxlogit", pa.float32()),
        ("logat", pa.float32()), *extra, ("embed_norm", pa.float32()), ("model", pa.string()),
        ("time", pa.timestamp("us", tz="UTC")), ("in_prompt", pa.bool_()), ("prediction_position", pa.int32()),
        ("special", pa.bool_()), ("template", pa.bool_()), ("ranked", pa.bool_()),
    ])


class _Context:
    """A running call's context so far: token ids (-1 where unknown) and texts per row, grown by each step."""

    def __init__(self, call: GenerationCall) -> None:
        self.request_id, self.model, self.special_ids = call.request_id, call.model, call.special_ids
        self.choice = call.choice
        self.target_texts = call.target_texts
        self.prompt_len = call.prompt_mask.shape[1]
        self.context_template = call.context_template  # the prompt's flags, then False on generated tokens
        mask = call.prompt_mask
        self.ids = call.prompt_ids.long() if call.prompt_ids is not None else torch.full(mask.shape, -1)
        self.texts: list[list[str | None]] = ([list(row) for row in call.readable] if call.readable
                                              else [[None] * mask.shape[1] for _ in range(mask.shape[0])])

    def reach(self, position: int) -> None:
        """Unknown tokens up to ``position`` (the steps before it were not seen: a rotated file deleted)."""
        missing = position - self.ids.shape[1]
        if missing > 0:
            self.ids = torch.cat([self.ids, torch.full((self.ids.shape[0], missing), -1)], dim=1)
            for texts in self.texts:
                texts.extend([None] * missing)

    def grow(self, step: Step) -> None:
        self.ids = torch.cat([self.ids[:, :step.position], step.token.long().view(-1, 1)], dim=1)
        for row, texts in enumerate(self.texts):
            del texts[step.position:]
            texts.append(step.readable[row] if step.readable else None)


def _rows(context: _Context, step: Step) -> dict[str, Any]:
    """The columns of one step's rows (numpy arrays and lists), real context positions only (a method's column is
    missing where the step has no scores of it: null)."""
    import numpy as np

    scores = step.normxlogit
    k = scores.shape[3] if scores.dim() == 4 else 1
    n_layers, batch, n = scores.shape[:3]
    grid = [t.reshape(-1) for t in torch.meshgrid(torch.arange(n_layers), torch.arange(batch), torch.arange(n),
                                                   torch.arange(k), indexing="ij")]
    layer_i, row, position, target_index = grid
    keep = step.mask[row, position].numpy()
    pick = lambda t: t.numpy()[keep]  # noqa: E731 - one filter for every column
    targets = step.target.long().view(batch, -1)
    texts = np.array(context.texts, dtype=object).reshape(batch, -1)
    named = np.array(step.target_names(context.target_texts), dtype=object).reshape(batch, k)  # (the one rule)
    emitted_text = np.array(step.readable if step.readable else [None] * batch, dtype=object)
    prob = step.probability.float().view(batch, -1)[row, target_index] if step.probability is not None else None
    row_k, pos_k = pick(row), pick(position)
    count = len(row_k)
    special = special_flags(context.ids[:, :n], context.special_ids)
    template = context.context_template(n)
    ranked = rankable(step.mask, torch.full((batch,), n - 1), special, template)  # the one rule, called
    never = np.zeros(count, dtype=bool)
    return {
        "request_id": [context.request_id] * int(keep.sum()),
        "call": np.full(int(keep.sum()), step.call, dtype=np.int64),
        "choice_prompt": [None if context.choice is None else context.choice.prompt] * count,
        "choice_sample": [None if context.choice is None else context.choice.sample] * count,
        "row": row_k.astype(np.int32),
        "step": np.full(len(row_k), step.step, dtype=np.int32),
        "emitted_position": np.full(len(row_k), step.position, dtype=np.int32),
        "emitted_id": step.token.long().numpy()[row_k],
        "emitted_text": list(emitted_text[row_k]),
        "active": step.active.numpy()[row_k],
        "layer": np.asarray(step.layers, dtype=np.int32)[pick(layer_i)],
        "position": pos_k.astype(np.int32),
        # -1 (not known: a prompt given as inputs_embeds, the steps a rotated file deleted) is null, as its text is
        "token_id": np.ma.masked_less(context.ids[:, :n].numpy()[row_k, pos_k], 0),
        "token_text": list(texts[row_k, pos_k]),
        "target_index": pick(target_index).astype(np.int32),
        "target_id": pick(targets[row, target_index]),
        "target_text": list(named[row_k, pick(target_index)]),
        "probability": pick(prob).astype(np.float32) if prob is not None else None,
        **{name: pick(step.scores[name].to(torch.float32 if name in DEFAULT else torch.float64)
                      .reshape(n_layers, batch, n, k)[layer_i, row, position, target_index])
           for name in step.scores},  # (each in its column's type)
        "embed_norm": step.embed_norm.float().numpy()[row_k, pos_k],
        "model": [context.model] * count,
        "time": None if step.time is None else np.full(count, round(step.time * 1e6), dtype=np.int64),
        "in_prompt": pos_k < context.prompt_len,
        "prediction_position": np.full(count, n - 1, dtype=np.int32),
        "special": never if special is None else special.numpy()[row_k, pos_k],
        "template": never if template is None else template.numpy()[row_k, pos_k],
        "ranked": ranked.numpy()[row_k, pos_k],
    }


class ParquetSink:
    """A :class:`~nxl_hooks.records.sinks.RecordSink` writing tidy Parquet rows (see the module docstring).

    ``nxl.attach(model, tokenizer=tok, sink="parquet:out.parquet")`` or ``ParquetSink("out.parquet")``.

    Its columns of attribution methods are those of ``methods`` when given, else those the first call's ``meta``
    names (``meta["methods"]``: what the probe computes), else NormXLogit's and LogAt's.

    Rows are buffered and written as a row group every ``row_group_rows`` rows, to ``out.parquet.partial``;
    ``close()`` (the probe detaching) writes the rest and the file's footer and renames it to ``out.parquet``.
    Parquet is not append-safe: a file without its footer cannot be read, so a process that dies before the
    probe detaches (a crash, SIGKILL) loses every row of this sink, and ``out.parquet.partial`` is left behind.
    Where that matters, record to the crash-safe stream file (``sink="run.nxl"``) and convert it afterwards
    with ``nxl export run.nxl out.parquet`` (:func:`export_parquet`). A write that fails (a full disk) removes
    ``out.parquet.partial`` before it raises: its rows are lost either way, and the path stays free for the next
    writer. One writer per file, as for stream files: a path whose ``out.parquet.partial`` another writer holds (a
    second model or process) is refused (ValueError, one line); one that a writer left when it died is taken over
    by the next, with one line on the ``nxl_hooks`` logger. A child process it forks lets go of the file.
    A Parquet file at ``out.parquet`` is replaced when the file is finished; a folder there, or a file that holds
    something else (a stream file, anyone's data), is refused (ValueError, one line) and left as it is, the rule of
    stream sinks (``replace_any``: any file is replaced, as ``nxl export --force`` replaces it).
    """

    def __init__(self, path: str | os.PathLike, *, row_group_rows: int = 1 << 17,
                 methods: Iterable[str] | None = None, replace_any: bool = False) -> None:
        pyarrow_module()
        self.path = Path(path)
        _replaceable(self.path, replace_any)
        self._partial = partial_path(self.path)
        self._methods = None if methods is None else tuple(methods)
        self._schema: Any = None  # once the methods are known: at the first call, or when the file is closed
        self._file = os.fdopen(_claim_partial(self._partial), "wb")
        self._pid = os.getpid()
        held(self)  # a child it forks lets go of the file at once (_forked)
        self._writer: Any = None
        self._closed = False
        self._row_group_rows = row_group_rows
        self._buffer: list[dict[str, Any]] = []
        self._buffered = 0
        self._calls: dict[int, _Context] = {}
        self._seen = 0  # calls written
        # the calls begun and not ended, by identity (a folder of several writers' streams repeats call indexes);
        # held, so that no other call takes the identity of one whose end has not come
        self._running: dict[int, GenerationCall] = {}
        self._said: list[dict[str, Any]] = []  # the calls nxl.calls lists (the module docstring)
        self._more = 0  # and those it only counts
        #: what made the rows, by model name: its first call's meta (``probe.describe()``), for ``nxl.models``
        self._models: dict[str | None, dict] = {}
        self.rows = 0  #: rows written so far (in row groups or buffered)
        self._taken = 0  # step records taken by write_step calls that returned
        #: step records taken before and lost when the sink failed (its file cannot be finished, so it is removed)
        self.lost = 0

    def _open(self, methods: Iterable[str] | None) -> None:
        if self._schema is None:
            self._schema = schema(self._methods or methods or DEFAULT)
            self._writer = pyarrow_module().parquet.ParquetWriter(self._file, self._schema)

    def write_call(self, call: GenerationCall, meta: dict) -> None:
        self._open(meta.get("methods"))
        self._seen += 1
        if len(self._models) < LISTED and (meta or call.meta):  # (an export passes none: its calls hold theirs)
            self._models.setdefault(call.model, meta or call.meta)
        self._running[id(call)] = call
        if call.prompt_mask is not None:  # (a call not recorded has no prompt, and no rows: its end follows)
            self._calls[call.index] = _Context(call)

    def write_step(self, step: Step) -> None:
        context = self._calls.get(step.call)
        if context is None:
            return  # its call frame never came (the call started before the sink): no context to name
        context.reach(step.position)
        columns = _rows(context, step)
        context.grow(step)
        count = len(columns["row"])
        self._buffer.append(columns)
        self._buffered += count
        self.rows += count
        if self._buffered >= self._row_group_rows:
            self._failing(self._flush)
        self._taken += 1

    def write_end(self, call: GenerationCall) -> None:
        self._calls.pop(call.index, None)
        self._running.pop(id(call), None)
        if not (call.complete and call.prompt_mask is not None and not call.error and not call.notes):
            self._say(call)  # (one whose rows say it all is not listed)

    def _say(self, call: GenerationCall) -> None:
        """List ``call`` in ``nxl.calls`` as it stands (or count it, past :data:`LISTED`); once per call."""
        if len(self._said) >= LISTED:
            self._more += 1
            return
        self._said.append({"call": call.index, "request_id": call.request_id,
                           "choice": None if call.choice is None else call.choice.to_json(), "model": call.model,
                           "recorded": call.prompt_mask is not None, "complete": call.complete,
                           "error": call.error, "notes": list(call.notes)})

    @property
    def unexplained(self) -> int:
        """How many calls ``nxl.calls`` holds: not recorded, stopped early, with notes, or not ended."""
        return len(self._said) + self._more

    def _flush(self) -> None:
        if not self._buffer:
            return
        pa = pyarrow_module()
        arrays = []
        for field in self._schema:
            parts = [[None] * len(chunk["row"]) if chunk.get(field.name) is None else chunk[field.name]
                     for chunk in self._buffer]  # a column the records do not have (probability, time): null
            arrays.append(pa.chunked_array([pa.array(part, type=field.type) for part in parts], type=field.type))
        self._writer.write_table(pa.Table.from_arrays(arrays, schema=self._schema))
        self._buffer, self._buffered = [], 0

    def close(self) -> None:
        if self._closed or os.getpid() != self._pid:  # (a forked child let go of the file at the fork: _forked)
            return
        self._failing(self._finish)
        try:  # renamed while this writer holds it: no other writer can take the name between
            os.replace(self._partial, self.path)
        finally:
            self._file.close()

    def _finish(self) -> None:
        self._open(None)  # a file without calls still has its columns
        self._flush()
        for call in self._running.values():  # not ended when the file was closed
            self._say(call)
        self._running.clear()
        said = {"calls": self._seen, "listed": self._said, "more": self._more}
        self._writer.add_key_value_metadata({"nxl.calls": json.dumps(said),  # the footer: known only now
                                             "nxl.models": json.dumps(self._models)})
        self._writer.close()
        self._writer, self._closed = None, True
        self._file.flush()  # whole on disk before its name says it is finished

    def _failing(self, write: Any) -> None:
        """``write()``; when it raises (a full disk, Ctrl-C), the partial file is closed and removed first."""
        try:
            write()
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        """Stop without writing the file: ``out.parquet.partial`` is closed and removed, ``out.parquet`` untouched;
        the step records taken so far are :attr:`lost`."""
        if os.getpid() != self._pid:  # a forked child: the file is its parent's
            return
        writer, self._writer, self._closed = self._writer, None, True
        self.lost, self._taken = self.lost + self._taken, 0
        with contextlib.suppress(Exception):  # the disk that failed may fail the footer too: the file goes anyway
            if writer is not None:
                writer.close()
        self._partial.unlink(missing_ok=True)  # while this writer holds it: never another writer's file
        with contextlib.suppress(OSError):
            self._file.close()

    def _forked(self) -> None:
        """In a child just forked: its copy of the file's descriptor points at /dev/null instead, so that the lock
        ends with the parent's close (or death), and what the child's copy of the buffer flushes goes nowhere."""
        if not self._file.closed:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._file.fileno())
            os.close(null)


def _replaceable(path: Path, replace_any: bool) -> None:
    """Refuse (ValueError, one line) a ``path`` the finished file's rename would fail on (a folder: the rows would be
    lost at the end of the run) or destroy: a file that is no Parquet file (a stream file given a Parquet sink's
    path, anyone's data; any file with ``replace_any``). Checked when the sink is made, before any record."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        raise ValueError(f"{path} is a folder: a Parquet sink writes one file; give a file path "
                         f"({path / 'scores.parquet'})")
    if replace_any or not stat.S_ISREG(mode):  # (a link or a FIFO is replaced, what it leads to left as it is)
        return
    with contextlib.suppress(OSError), open(path, "rb") as existing:
        head = existing.read(len(_MAGIC))
        if not _MAGIC.startswith(head):
            kind = (" (a stream file: nxl export converts it to Parquet)" if head == STREAM_MAGIC[:len(_MAGIC)]
                    else "")
            raise ValueError(f"{path} holds something other than a Parquet file, which the Parquet sink would "
                             f"replace: give another path, or remove the file first{kind}")


def partial_path(path: str | os.PathLike) -> Path:
    """Where a Parquet writer of ``path`` writes until its file is finished: ``out.parquet.partial``, a file it
    writes as much as ``path`` itself (``nxl export`` keeps both apart from its inputs)."""
    path = Path(path)
    return path.with_name(path.name + ".partial")


def _claim_partial(partial: Path) -> int:
    """``out.parquet.partial``, emptied and held for this writer by the rule of stream files
    (:func:`~nxl_hooks.records.writer.claim_file`): a live writer's is refused (ValueError, one line); one that a
    writer left when it died (a crash, SIGKILL: no footer, unreadable) is taken over, with one log line. What no
    Parquet writer began (a stream file, anyone's data) is refused (ValueError, one line): never emptied."""
    while True:
        fd, _ = claim_file(partial, 0o644, unlocked_if_new=True, readable=True)  # (it empties what it takes)
        try:
            held = os.fstat(fd)
            with contextlib.suppress(FileNotFoundError):
                if os.path.samestat(held, os.stat(partial)):
                    if held.st_size and not _MAGIC.startswith(os.pread(fd, len(_MAGIC), 0)):
                        raise ValueError(f"{partial} is no Parquet file a writer left unfinished (it does not begin "
                                         f"with {_MAGIC!r}): nxl_hooks empties only its own; move it away, or write "
                                         "the Parquet file elsewhere")
                    os.ftruncate(fd, 0)
                    break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # the writer that held it renamed or removed it since the open: that name again
    if held.st_size:
        logging.getLogger("nxl_hooks").warning(
            "nxl_hooks: %s was left by a writer that died before it finished (a crash, SIGKILL), its rows lost with "
            "it (a Parquet file without its footer cannot be read): replaced by this writer's", partial)
    return fd


def export_parquet(calls: Iterable[GenerationCall], out: str | os.PathLike, *,
                   replace_any: bool = False) -> ParquetSink:
    """Write the step records of ``calls`` (e.g. ``read_stream(path)``) as Parquet rows, and the calls with no rows
    to show for all they ran in ``nxl.calls``; returns the closed sink (``.rows``, ``.unexplained``).
    ``export_parquet(nxl.read_stream("runs/"), "out.parquet").rows``; a file at ``out`` that is no Parquet file is
    refused unless ``replace_any`` (:class:`ParquetSink`)."""
    calls = list(calls)
    names = dict.fromkeys(name for call in calls for step in call.steps for name in step.scores)
    sink = ParquetSink(out, methods=names, replace_any=replace_any)
    try:
        for call in calls:
            sink.write_call(call, {})
            for step in call.steps:
                sink.write_step(step)
            sink.write_end(call)
    except BaseException:
        sink.abandon()
        raise
    sink.close()
    return sink
