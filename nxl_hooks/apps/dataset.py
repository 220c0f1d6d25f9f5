"""Dataset runs: load JSONL/CSV examples, score them sharded across processes, resumably, merged once.

    examples = load_examples("data.jsonl")                    # [{"text", "label"?, "evidence"?, "id"?}, ...]
    records = run_dataset(examples, score, "out/", settings={"model": "m"})   # list on the main process

:func:`run_dataset` is what ``nxl evaluate`` and ``nxl audit`` share. Under ``accelerate launch
--num_processes N`` every process takes its share of the examples not yet done (accelerate's
``PartialState`` says which process it is), appends one JSON line per finished example to its own part
file in ``out/parts/`` (flushed and fsynced, so a killed run keeps every completed record; a torn last
line is ignored and cut off), and the main process merges all parts once, in dataset order. Rerunning
the same command on the same ``out/`` resumes: finished examples are read back, not recomputed.

Every line carries the run's identity (``run_id``, a hash of its settings: model and its files, data, options, and
the version of nxl_hooks), so a resumed run never mixes in another run's records, even when ``run.json`` was deleted.
It also carries what made it (``made_with``: each model's name, dtype, quantization and the packages' versions), which
is no part of the identity: :func:`scored` lists each set seen in the summary, with how many examples it made.
An example whose scoring raises is recorded as failed, with its reason (``{"index", "id", "error"}``), and the run
goes on; a resumed run does not retry it. :func:`scored` splits the failures off for the summary. Output files are
written under a temporary name and renamed, so a failed write never destroys an earlier result; what the run
writes in ``out/`` must be a regular file there (a symbolic link is refused before anything is read or written).
"""

from __future__ import annotations

import collections
import csv
import hashlib
import io
import json
import math
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from ..arch.text import typed
from ..arch.version import VERSION
from ..records.files import json_value, read_regular, replacing, unwritable, write_text
from .options import check_apart, check_output_folder, say

__all__ = [
    "SettingsMismatchError",
    "check_out",
    "examples_from_args",
    "load_examples",
    "place",
    "read_records",
    "run_dataset",
    "run_files",
    "scored",
    "write_json",
    "write_outputs",
]

_PARTS = "parts"
_SETTINGS = "run.json"
_OUTPUTS = ("records.jsonl", "summary.json", "report.html")  #: the merged results, replaced by each finished run
_RUN_ID = "run_id"
NOTES_SHOWN = 5  #: the records' notes a finished run says on stderr (summary.json lists every one)
_VERSION = "nxl_hooks"  #: run.json's key for the version that made the run (part of its identity)
_MADE_WITH = "made_with"  #: a record's and the summary's key for what made the numbers (no part of the identity)


class SettingsMismatchError(ValueError):
    """The output folder holds a run made with other settings: resuming it would mix two runs."""


# -- loading ---------------------------------------------------------------------------------------------


def _csv_label(value: Any) -> Any:
    """A CSV label cell, read as the same JSONL string is (surrounding spaces dropped; "" -> None): the model's rules
    say what it is (a classifier's label name, else a number as its id; a regression's number; a language model's
    word: "7" is the word, not output id 7). A NaN or infinite number ("nan", "inf") is that float, so the load
    refuses it as it refuses JSONL's ``NaN``.

    Only for CSV labels: JSON and hub values are typed already, and a ``target`` / ``foil`` token string
    must stay as written (" 4" and "4" are different tokens).
    """
    if not isinstance(value, str):
        return value
    value = value.strip()
    if not value:
        return None
    try:
        number = float(value)
    except ValueError:
        return value
    return value if math.isfinite(number) else number


def _evidence(value: Any) -> list[str] | None:
    """A JSON list, or (CSV) a JSON list in a string or words separated by spaces, commas or ``|``."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            value = json_value(text)
        else:
            return [word for word in re.split(r"[\s,|]+", text) if word]
    if not isinstance(value, list) or not all(isinstance(word, str) for word in value):
        raise ValueError(f"evidence must be a list of words or a string of words, got {value!r}")
    return value or None


def _check_values(where: str, example: Mapping[str, Any]) -> None:
    """Refuse what a run cannot judge nor write back: records.jsonl is JSON, which has no NaN or Infinity, and one
    NaN gold value leaves the whole run without Pearson (JSONL ``NaN``, a CSV cell ``nan`` or ``inf``); a lone
    surrogate (JSONL ``"\\ud800"``, a valid escape) is no character, so no tokenizer reads it and no UTF-8 file
    holds it, as a byte that is not UTF-8 (:func:`_file_text`)."""
    for key, value in example.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{where}: {key} {value!r} is not a finite number: give a number, or leave the {key} out")
        for text in value if isinstance(value, list) else [value]:  # (evidence is a list of words)
            if isinstance(text, str):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as err:
                    raise ValueError(f"{where}: {key} holds {text[err.start]!r}, half of a UTF-16 surrogate pair "
                                     "without the other half, which is no character: write the character itself (or "
                                     "both halves of its escape)") from None


def _file_text(path: Path) -> str:
    """The whole dataset file as text; a byte that is not UTF-8 is named with its line."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")  # a byte-order mark, as spreadsheet programs write, is no content
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line} is not UTF-8 text (byte {data[err.start:err.start + 1]!r}): save the file "
                         "as UTF-8") from None


def _file_rows(path: Path) -> Iterator[tuple[str, Mapping[str, Any]]]:
    if not path.is_file():
        raise FileNotFoundError(
            f"no dataset at {path}: give a .jsonl (one JSON object per line) or .csv file, or hf:NAME:SPLIT"
        )
    text = _file_text(path)
    if path.suffix.lower() == ".csv":
        yield from _csv_rows(path, text)
        return
    # Lines end at "\n" only: a JSON string may hold U+2028 and other characters that str.splitlines() breaks at.
    for line, content in enumerate(text.split("\n"), start=1):
        if content.strip():
            try:
                yield f"{path}:{line}", json_value(content)
            except ValueError as err:
                raise ValueError(f"{path}:{line} is not valid JSON ({err}); one JSON object per line") from None


def _csv_rows(path: Path, text: str) -> list[tuple[str, Mapping[str, Any]]]:
    """The rows of a CSV file's ``text``, each with its ``file:line``; what csv cannot read is a ValueError naming
    the line. csv's cell limit (131072 characters, process-wide) is lifted while this file is read, and put back:
    the file is in memory already, so it guards nothing, and a long-context model reads longer texts (JSONL has no
    such limit)."""
    limit = csv.field_size_limit(max(csv.field_size_limit(), len(text)))
    # strict: a quote never closed is an error, not a cell that swallows every later row into one example
    reader = csv.DictReader(io.StringIO(text, newline=""), strict=True)
    rows, start = [], 1  # the line the row being read starts on: csv's line_num is where a (multi-line) row ends
    try:
        if reader.fieldnames:  # (reads the header)
            start = reader.line_num + 1
        for row in reader:
            where = f"{path}:{reader.line_num}"
            if None in row:  # DictReader keeps the cells beyond the header under the key None
                raise ValueError(f"{where} has {len(reader.fieldnames) + len(row[None])} cells but the header names "
                                 f"{len(reader.fieldnames)}: quote cells that hold a comma")
            rows.append((where, row))
            start = reader.line_num + 1
    except csv.Error as err:  # (no ValueError): a quote never closed, text after one, a NUL character on 3.10
        raise ValueError(f"{path}:{start} cannot be read as CSV ({err}): fix that row (a quoted cell ends with its "
                         "quote, a quote in it is doubled), or save the data as .jsonl") from None
    finally:
        csv.field_size_limit(limit)
    return rows


def _hub_rows(source: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """``hf:NAME:SPLIT`` or ``hf:NAME:CONFIG:SPLIT``, read with the ``datasets`` package."""
    parts = source[3:].split(":")
    if len(parts) not in (2, 3) or not all(parts):
        raise ValueError(
            f"{source!r}: write a hub dataset as hf:NAME:SPLIT or hf:NAME:CONFIG:SPLIT (hf:stanfordnlp/sst2:validation)"
        )
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{source} is a hub dataset: install the datasets package (pip install datasets)") from None
    name, config, split = (parts[0], None, parts[1]) if len(parts) == 2 else parts
    for index, row in enumerate(datasets.load_dataset(name, config, split=split)):
        yield f"{source}[{index}]", row


def load_examples(
    source: str | Path,
    *,
    text: str = "text",
    label: str = "label",
    evidence: str = "evidence",
    limit: int | None = None,
) -> list[dict[str, Any]]:
    """Examples of a ``.jsonl`` / ``.csv`` file or a hub dataset as dicts for
    :func:`nxl_hooks.eval.faithfulness.score_example`.

    ``load_examples("sst2.csv", text="sentence")``; ``load_examples("hf:stanfordnlp/sst2:validation",
    text="sentence")`` (needs the ``datasets`` package). Each gets ``text``, and ``label`` / ``evidence`` /
    ``target`` / ``foil`` / ``id`` where the file has them (``id`` defaults to the example's index).
    A CSV label is the string a JSONL label would be, less surrounding spaces (the model's rules read it: a label
    name or id, a number, a word); every other value (and every JSONL / hub value) is kept as written, whitespace
    included. Evidence is a list of words. A NaN or infinite
    value (JSONL ``NaN``, a CSV cell ``nan``) or a lone surrogate in a string (JSONL ``"\\ud800"``) is a
    ValueError naming its line.
    A ``label`` or ``evidence`` field other than the default that no example has is a ValueError (a typo).
    """
    source = str(source)
    if limit is not None and limit < 1:
        raise ValueError(f"limit {limit}: give a positive number of examples (or no limit)")
    from_csv = not source.startswith("hf:") and Path(source).suffix.lower() == ".csv"
    rows = _hub_rows(source) if source.startswith("hf:") else _file_rows(Path(source))
    out: list[dict[str, Any]] = []
    fields: set[str] = set()  # every field a row has: a label or evidence field named but in none is a typo
    for where, row in rows:
        if not isinstance(row, Mapping) or not isinstance(row.get(text), str) or not row[text].strip():
            columns = sorted(row) if isinstance(row, Mapping) else type(row).__name__
            raise ValueError(f"{where} has no non-empty {text!r} field (it has {columns}); pick it with --text-field")
        fields.update(row)
        identifier = row.get("id")
        example: dict[str, Any] = {"id": len(out) if identifier in (None, "") else identifier, "text": row[text]}
        try:
            words = _evidence(row.get(evidence))
        except ValueError as err:
            raise ValueError(f"{where}: field {evidence!r}: {err}") from None
        for key, value in (
            ("label", _csv_label(row.get(label)) if from_csv else row.get(label)),
            ("evidence", words),
            ("target", row.get("target")),
            ("foil", row.get("foil")),
        ):
            if value is not None and value != "":  # an empty CSV cell is a missing value
                example[key] = value
        _check_values(where, example)
        out.append(example)
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise ValueError(f"{source} holds no examples: give one JSON object per line (.jsonl) or a header row and "
                         "one row per example (.csv)")
    for option, name, default in (("--label-field", label, "label"), ("--evidence-field", evidence, "evidence")):
        # (the default fields are optional; one named on purpose that no row has would leave the run without it)
        if name != default and name not in fields:
            raise ValueError(f"{source} has no {name!r} field in any example (they have {sorted(fields)}): pick "
                             f"it with {option}, or leave {option} out")
    return out


def _digest(value: Any) -> str:
    """sha256 of a JSON-able value (the examples: part of a run's settings, so a resumed run is known to read the
    same data; the settings: the run's identity)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode("utf-8")).hexdigest()


# -- append-only record logs -----------------------------------------------------------------------------


def _complete_lines(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Records of one part file and the byte length of its complete lines (a torn last line is dropped)."""
    data = read_regular(path, follow_symlinks=False)
    end = data.rfind(b"\n") + 1
    records = []
    for number, line in enumerate(data[:end].splitlines(), start=1):
        if line.strip():
            try:
                record = json_value(line)
            except ValueError:
                record = None
            if not isinstance(record, dict) or not isinstance(record.get("index"), int):
                raise ValueError(
                    f"{path}:{number} is corrupt (not a JSON record with an index): delete that line or the folder "
                    "to redo it"
                )
            records.append(record)
    return records, end


def read_records(out_dir: str | Path) -> dict[int, dict[str, Any]]:
    """Every completed record under ``out_dir/parts``, by dataset index (as a killed run left them)."""
    done: dict[int, dict[str, Any]] = {}
    for part in sorted((Path(out_dir) / _PARTS).glob("part-*.jsonl")):
        for record in _complete_lines(part)[0]:
            done.setdefault(int(record["index"]), record)
    return done


class _Log:
    """One process's append-only part file: one JSON line per record, on disk before the next starts."""

    def __init__(self, path: Path) -> None:
        end = _complete_lines(path)[1] if os.path.lexists(path) else 0
        # O_NOFOLLOW: a link planted there since run_dataset looked is refused, never written through
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            os.ftruncate(fd, end)  # cut a torn last line, so the next record starts a fresh line
        except BaseException:
            os.close(fd)
            raise
        self._fh = os.fdopen(fd, "ab")

    def append(self, record: Mapping[str, Any]) -> None:
        self._fh.write(json.dumps(record).encode("utf-8") + b"\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self._fh.close()


# -- sharded, resumable runs -----------------------------------------------------------------------------


class _OneProcess:
    """The process view when accelerate is not installed: a plain single-process run."""

    process_index, num_processes, is_main_process = 0, 1, True

    def wait_for_everyone(self) -> None:
        pass


class _TensorParallel(_OneProcess):
    """The process view under tensor parallelism (``--tp``, torchrun): the ranks compute every forward together, so
    for the data they are one process, which scores every example in the same order (examples split between ranks
    would meet in each other's collectives). Rank 0 alone reads and writes the output folder; it sends the others
    what is left to do."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.is_main_process = dist.get_rank() == 0

    def share(self, todo: list[int] | None) -> list[int] | None:
        """Rank 0's ``todo`` (None: it failed before it knew), on every rank; the others raise when it is None (a
        ValueError, as what stops rank 0 there is the output folder or the settings: one line, not a traceback)."""
        import torch.distributed as dist

        sent = [todo]
        dist.broadcast_object_list(sent, src=0)
        if sent[0] is None and not self.is_main_process:
            raise ValueError("rank 0 stopped before scoring; its own error line says what to fix")
        return sent[0]


def _state() -> Any:
    """accelerate's view of this process (one process when not launched by ``accelerate launch``)."""
    import torch

    try:
        from accelerate import PartialState
    except ImportError:
        return _OneProcess()
    # With no GPU, accelerate only forms a multi-process group when told to use the CPU.
    return PartialState(cpu=not torch.cuda.is_available())


def _identity(settings: Mapping[str, Any]) -> dict[str, Any]:
    """What ``run.json`` holds for a run with these (JSON-able) settings: them, and the version of nxl_hooks that
    scores it. Another version's records are another run's: a fix between two versions changes numbers, and a run
    resumed across them would mix both versions' numbers in one summary.

    The other packages' versions (torch, transformers, bitsandbytes...: ``made_with``) are left out on purpose, so a
    run resumed after one changed goes on. nxl_hooks's code defines what each number and field of a record means,
    and the summary adds records up on that definition; the other packages are the environment the run measures
    (a quantized deployment's kernels), not what its numbers mean. A patch release of torch mostly changes no digit,
    and refusing would cost every finished example of a long audit; where one does change numbers, that is a fact
    for the reader to weigh, so it is said, never hidden: each record keeps the set that made it, and the summary
    lists each set with how many examples it made (:func:`scored`), so no one set is claimed for all."""
    return {**json.loads(json.dumps(settings)), _VERSION: VERSION}


def run_id(settings: Mapping[str, Any]) -> str:
    """The identity of a run with these (JSON-able) settings, made by this version, carried by each of its records."""
    return _digest(_identity(settings))[:16]


def _check_run(out_dir: Path, settings: Mapping[str, Any], done: Mapping[int, Mapping[str, Any]]) -> str:
    """Whether ``out_dir`` holds this run ("resume"), nothing of use ("fresh": no record, or only failures of
    another run), or another run's results (:class:`SettingsMismatchError`). Judged by the records' own
    ``run_id``; ``run.json`` only names what differs (records from before run ids count when it matches)."""
    path = out_dir / _SETTINGS
    try:
        saved = json.loads(path.read_text(encoding="utf-8")) if path.exists() else None
    except (ValueError, UnicodeDecodeError):
        saved = None  # unreadable: the records say whose they are
    wanted = _identity(settings)
    ours = run_id(settings)

    def foreign(record: Mapping[str, Any]) -> bool:
        if _RUN_ID in record:
            return record[_RUN_ID] != ours
        return saved != wanted  # written before run ids: this run's only when run.json says so

    others = [r for r in done.values() if foreign(r)]
    if not others:
        return "resume" if done else "fresh"
    if all("error" in r for r in others):
        return "fresh"  # every record of the other run failed: nothing is lost by starting over
    if isinstance(saved, dict) and saved.get(_VERSION) != VERSION:
        # (the settings an earlier version wrote lack what this one adds: naming those keys would blame the user)
        made = (f"nxl_hooks {saved[_VERSION]}" if isinstance(saved.get(_VERSION), str)
                else "an nxl_hooks that did not record its version (0.3 or before, or an early 0.4 build)")
        raise SettingsMismatchError(
            f"{out_dir} holds a run made by {made}, whose records nxl_hooks {VERSION} does not resume (its numbers may "
            "differ); use another --out folder, or delete this one to start over"
        )
    if isinstance(saved, dict) and saved != wanted:
        changed = sorted(k for k in set(saved) | set(wanted) if saved.get(k) != wanted.get(k))
        why = f"(different: {', '.join(changed)})"
    else:
        why = (f"({len(others)} of its records carry another run's identity: other model, data, options or nxl_hooks "
               "version)")
    raise SettingsMismatchError(
        f"{out_dir} holds a run with other settings {why}; use another --out folder, or delete this one to start over"
    )


def run_files(out_dir: str | Path) -> list[Path]:
    """What a run in ``out_dir`` writes: ``run.json``, the merged results, and (last) the folder of its part files."""
    out_dir = Path(out_dir)
    return [out_dir / _SETTINGS, *(out_dir / name for name in _OUTPUTS), out_dir / _PARTS]


def _refuse_links(out_dir: Path) -> None:
    """A ValueError (one line) when what a run in ``out_dir`` reads, appends to or replaces is not a regular file: a
    symbolic link planted there would have the run write into the link's target. Before anything is read or made."""
    *paths, parts = run_files(out_dir)
    paths += [parts] if parts.is_symlink() else sorted(parts.glob("part-*.jsonl"))
    for path in paths:
        why = unwritable(path)
        if why is not None:
            raise ValueError(why)


def _stop_all_if_one_failed(state: Any, failed: bool) -> None:
    """Tell every process whether any failed, so one failure stops all of them instead of leaving the others
    waiting at a barrier forever. Every process must call it exactly once (it is a collective)."""
    if state.num_processes == 1:
        return
    from accelerate.utils import gather_object

    if any(gather_object([failed])) and not failed:
        raise RuntimeError("another process failed (its error is printed above); rerun the command to resume")


def write_json(path: str | Path, value: Any) -> Path:
    """Write JSON atomically (temp file + rename), so a reader never sees half a file."""
    return write_text(path, json.dumps(value, indent=1) + "\n")


def _failure(example: Mapping[str, Any], error: Exception) -> dict[str, Any]:
    """The record of an example whose scoring raised: its id and the reason, on one line."""
    return {"id": example.get("id"), "error": typed(error, 2000)}


def _prepare(state: Any, out_dir: Path, settings: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
    """The records of ``out_dir`` this run resumes from (none for a fresh run), its parts folder made, another run's
    failures cleared and ``run.json`` written; every process raises alike, before anyone writes."""
    parts = out_dir / _PARTS
    _refuse_links(out_dir)
    if state.is_main_process:
        parts.mkdir(parents=True, exist_ok=True)
    state.wait_for_everyone()
    done = read_records(out_dir)
    status = _check_run(out_dir, settings, done)
    state.wait_for_everyone()  # all have read the parts before anyone cuts or appends
    if status == "fresh" and done:  # only failures of another run: start over
        done = {}
        if state.is_main_process:
            shutil.rmtree(parts)
            parts.mkdir()
        state.wait_for_everyone()
    if state.is_main_process:
        write_json(out_dir / _SETTINGS, _identity(settings))
    return done


def run_dataset(
    examples: Sequence[Mapping[str, Any]],
    score: Callable[[Mapping[str, Any]], Mapping[str, Any]],
    out_dir: str | Path,
    *,
    settings: Mapping[str, Any],
    desc: str = "examples",
    record_failures: bool = True,
    tp: bool = False,
    made_with: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]] | None:
    """Score every example once, sharded and resumable; all records in dataset order on the main process.

    ``records = run_dataset(examples, lambda ex: ev.score_example(model, tok, ex), "out", settings={...})``

    ``score`` maps one example to a JSON-able record (``index`` is added: the example's position).
    ``settings`` (JSON-able) identify the run; an ``out_dir`` holding another run's records is an error
    (unless they all failed). When ``score`` raises (an Exception), the example's record is
    ``{"index", "id", "error"}`` and the run goes on; a rerun does not retry it (:func:`scored` separates them).
    With ``record_failures=False`` the run stops instead: every process raises (the others a ``RuntimeError``)
    when each has finished its share, and every record written is kept for the rerun. A Ctrl-C raises a
    ``KeyboardInterrupt`` that says how many records are kept and that the same call goes on from them. Returns the
    merged records on the main process and ``None`` on the others. ``tp=True`` (a model sharded by ``tp_plan="auto"``,
    under torchrun): every rank scores every example, in the same order, and rank 0 alone records them.
    ``made_with`` (JSON-able: each model's :func:`~nxl_hooks.hooks.plan.made_by`, by role) is what this process makes
    its records with: each record written now carries it, and it is no part of the run's identity (:func:`_identity`
    says why), so records resumed from an earlier process may carry another.
    """
    from tqdm.auto import tqdm

    state = _TensorParallel() if tp else _state()
    out_dir = Path(out_dir)
    records_here = state.is_main_process or not tp  # the other ranks of --tp compute alongside rank 0, silently
    done: dict[int, dict[str, Any]] = {}
    todo = None
    try:
        if records_here:
            done = _prepare(state, out_dir, settings)
            todo = [i for i in range(len(examples)) if i not in done]
    finally:
        if tp:
            todo = state.share(todo)
    if made_with is not None:  # each record carries it: one that is no JSON fails here, not after the first example
        try:
            made_with = json.loads(json.dumps(made_with))
        except (TypeError, ValueError) as error:
            raise ValueError(f"made_with is not JSON ({error}): give each model's made_by(model), by role") from None
    identity = {_RUN_ID: run_id(settings), **({} if made_with is None else {_MADE_WITH: made_with})}
    mine = todo[state.process_index :: state.num_processes]
    log = _Log(out_dir / _PARTS / f"part-{state.process_index}.jsonl") if records_here else None
    label = f"{desc} [process {state.process_index + 1}/{state.num_processes}]" if state.num_processes > 1 else desc
    try:
        for index in tqdm(
            mine,
            desc=label,
            unit="ex",
            disable=not state.is_main_process,
            dynamic_ncols=True,
            postfix={"resumed": len(done)} if done else None,
        ):
            try:
                record = score(examples[index])
            except Exception as error:  # noqa: BLE001 - one failing example is recorded, the run goes on
                if not record_failures:
                    raise
                record = _failure(examples[index], error)
                if log is not None:
                    # the newline in the one write (tqdm writes `end` apart): torchrun ranks share an unbuffered stderr
                    failed = f"{desc}: example {index} failed, recorded: {record['error']}\n"
                    tqdm.write(failed, file=sys.stderr, end="")
            if log is not None:
                log.append({**record, "index": index, **identity})
    except Exception:
        _stop_all_if_one_failed(state, failed=True)
        raise
    except KeyboardInterrupt:
        if log is None or not state.is_main_process:  # (every process's Ctrl-C: the main one's line says it)
            raise
        # what is on disk is whole and the run resumes from it: said in the line Ctrl-C ends the command with
        raise KeyboardInterrupt(f"{len(read_records(out_dir))} of {len(examples)} examples are kept in {out_dir}; "
                                "run the same command again to go on from there") from None
    finally:
        if log is not None:
            log.close()
    _stop_all_if_one_failed(state, failed=False)
    state.wait_for_everyone()
    if not state.is_main_process:
        return None
    merged = read_records(out_dir)
    missing = [i for i in range(len(examples)) if i not in merged]
    if missing:
        raise ValueError(
            f"records missing for examples {missing[:10]} after every process finished; rerun to fill them in"
        )
    return [{k: v for k, v in merged[i].items() if k != _RUN_ID} for i in range(len(examples))]


def scored(
    records: Sequence[Mapping[str, Any]], aggregate: Callable[[Sequence[Mapping[str, Any]]], dict[str, Any]]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(the records of the examples that scored, their summary): ``aggregate`` of them plus ``failed``, the index,
    id and reason of each example that failed, ``notes``, each distinct note of the records once with how many
    examples it concerns (``{"note", "examples"}``), and ``made_with`` where a record says what made it
    (:func:`_made_with`). ValueError when none scored.
    ``ok, summary = scored(records, agg)``"""
    ok = [dict(r) for r in records if "error" not in r]
    failed = [{"index": r["index"], "id": r.get("id"), "error": r["error"]} for r in records if "error" in r]
    if not ok:
        raise ValueError(f"every example failed ({len(failed)}); the first: example {failed[0]['index']}: "
                         f"{failed[0]['error']}")
    # (an example counts once per note; Counter keeps the order notes were first seen)
    counts = collections.Counter(note for record in ok for note in dict.fromkeys(record.get("notes") or ()))
    notes = [{"note": note, "examples": count} for note, count in counts.items()]
    made_with = _made_with(ok)
    return ok, {**aggregate(ok), "failed": failed, "notes": notes, **({} if made_with is None else
                                                                       {_MADE_WITH: made_with})}


def _made_with(records: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """Each distinct set of models and versions that made ``records`` (:func:`run_dataset`'s ``made_with``; ``None``
    for a record that does not say: an earlier build's) once, in the order first seen, with how many records it made
    (``{"examples", "models"}``); each record's ``made_with`` becomes the position of its own set in that list. None
    (and the records unchanged) when no record says: a library caller that passed no ``made_with``."""
    if not any(_MADE_WITH in record for record in records):
        return None
    made: list[Any] = []  # (dicts: a list, not a set; a run has one or a few)
    for record in records:
        models = record.get(_MADE_WITH)
        if models not in made:
            made.append(models)
        record[_MADE_WITH] = made.index(models)
    return [{"examples": sum(r[_MADE_WITH] == i for r in records), "models": models} for i, models in enumerate(made)]


# -- the commands built on it ----------------------------------------------------------------------------


def place(model: Any) -> Any:
    """Move an undispatched, unquantized model to this process's device (its GPU under ``accelerate launch``).

    Without accelerate or without a GPU the model stays where it is (the CPU).
    """
    device = getattr(_state(), "device", None)
    if device is not None and not getattr(model, "hf_device_map", None) and not getattr(model, "is_quantized", False):
        model.to(device)
    return model


def write_outputs(
    out_dir: str | Path, records: Sequence[Mapping[str, Any]], summary: Mapping[str, Any], report: str, *,
    command: str = "nxl",
) -> None:
    """The merged results of a run: ``records.jsonl`` (dataset order), ``summary.json``, ``report.html``; then one
    on stderr (``command`` first) one line for each of the first ``NOTES_SHOWN`` of the records' notes
    (``summary["notes"]``), which change what their examples' numbers mean (a target read otherwise than written)
    and would be in records.jsonl alone; one when the records were made with more than one set of models and
    versions (``summary["made_with"]``: a run resumed after a package changed); last, one counting the examples that
    failed (``summary["failed"]``), which no figure counts: each was said as it failed, but a resumed run does not
    retry it, so nothing else would say it."""
    records_path, summary_path, report_path = (Path(out_dir) / name for name in _OUTPUTS)
    with replacing(records_path) as fh:
        for record in records:
            fh.write(json.dumps(record).encode("utf-8") + b"\n")
    write_json(summary_path, summary)
    write_text(report_path, report)
    print(f"wrote {summary_path}, {records_path} and {report_path}")
    sys.stdout.flush()  # (before the lines below, where both go to one terminal)
    notes = summary.get("notes") or []
    for entry in notes[:NOTES_SHOWN]:
        say(f"{command}: note on {entry['examples']} of {len(records)} examples: {entry['note']}")
    if len(notes) > NOTES_SHOWN:
        say(f"{command}: and {len(notes) - NOTES_SHOWN} other notes (summary.json's notes lists each)")
    made_with = summary.get(_MADE_WITH) or []
    if len(made_with) > 1:
        say(f"{command}: the records were made with {len(made_with)} different sets of models and package versions "
            f"({', '.join(str(entry['examples']) for entry in made_with)} examples; a run resumed after a change): "
            "summary.json's made_with lists each, and each record's made_with is the position of its own there")
    failed = summary.get("failed") or []
    if failed:  # last: what no figure counts
        first = failed[0]
        say(f"{command}: {len(failed)} of {len(records) + len(failed)} examples failed and "
            f"{'is' if len(failed) == 1 else 'are'} in none of the figures (summary.json's failed lists each with its "
            f"reason); the first: example {first['index']}: {first['error']}")


def check_out(args: Any, *models: str | None) -> None:
    """A dataset command's ``--out``, before anything loads: ``args.out`` becomes the one folder to write
    (:func:`~nxl_hooks.apps.options.check_output_folder`), none of its run's files may be the data or lie in a model
    folder (``models``: the command's MODEL arguments) (:func:`~nxl_hooks.apps.options.check_apart`), and none may
    be a symbolic link or other non-regular file."""
    args.out = check_output_folder(args.out)
    check_apart("--out", args.out, [*models, args.data], writes=run_files(args.out))
    _refuse_links(Path(args.out))  # (run_dataset checks again, for a library caller)


def examples_from_args(args: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The examples a dataset command reads, and the settings that identify them (for resuming)."""
    examples = load_examples(
        args.data, text=args.text_field, label=args.label_field, evidence=args.evidence_field, limit=args.limit
    )
    settings = {
        "data": str(args.data),
        "examples_sha256": _digest(list(examples)),
        "fields": [args.text_field, args.label_field, args.evidence_field],
        "limit": args.limit,
        "head": args.head,
    }
    return examples, settings
