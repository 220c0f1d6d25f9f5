"""Stream files that cannot read back wrong without a word, and readers that cannot hang (issue 19, items 1-2).

Every frame's checksum holds in the ordering cases: a step frame removed, written twice, two swapped, a rotated file
deleted from the middle of a folder. Each is damage that names the call and the steps, keeps what comes before,
and raises with ``strict=True``. Readers refuse FIFOs, devices and sockets before opening them, the damage scan
examines a number of bytes linear in the file's size, Ctrl-C interrupts a long read, and 0.1's files still read.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import json
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

import nxl_hooks as nxl
from nxl_hooks.apps.cli import main
from nxl_hooks.records import reader, writer
from oracle import llama, normxlogit, prefix_logits
import tiny

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.fixture(scope="module")
def model():
    return tiny.generating_llama()


@pytest.fixture(scope="module")
def recorded(model, tmp_path_factory):
    """A stream file of one call with 4 steps, and the probe that wrote it."""
    path = tmp_path_factory.mktemp("integrity") / "run.nxl"
    ids = torch.randint(1, 100, (1, 5), generator=torch.Generator().manual_seed(4))
    with nxl.attach(model, layers=[0, -1], sink=path) as probe:
        model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    return path.read_bytes(), probe


def _split(data: bytes) -> tuple[bytes, list[bytes]]:
    """The magic line and the frames of a stream file."""
    magic, offset, frames = data[:19], 19, []
    while offset < len(data):
        (length,) = struct.unpack_from("<Q", data, offset + 4)
        frames.append(data[offset: offset + 16 + length])
        offset += 16 + length
    return magic, frames


def _damaged(path: Path, strict_match: str) -> nxl.read_stream:
    with pytest.raises(nxl.StreamError, match=strict_match):
        nxl.read_stream(path, strict=True)
    with pytest.warns(nxl.StreamDamageWarning, match=strict_match):  # (public, as the docs name it)
        return nxl.read_stream(path)


@pytest.mark.parametrize("how, frames, reason, kept", [
    ("a middle step removed", lambda f: f[:2] + f[3:], r"call 0: step 2 follows step 0 \(step 1 missing\)", [0]),
    ("a step written twice", lambda f: f[:3] + f[2:], r"call 0: step 1 recorded twice", [0, 1]),
    ("two steps swapped", lambda f: f[:2] + [f[3], f[2]] + f[4:], r"call 0: step 2 follows step 0 \(step 1 missing\)",
     [0]),
    ("the first steps swapped", lambda f: f[:1] + [f[2], f[1]] + f[3:],
     r"call 0: its first step record is step 1 \(step 0 missing\)", []),
    ("the end frame repeated", lambda f: f + f[-1:], r"frame number 5 where 6 was expected", [0, 1, 2, 3]),
])
def test_frames_missing_repeated_or_moved_are_damage_naming_call_and_steps(recorded, tmp_path, how, frames, reason,
                                                                         kept):
    data, probe = recorded
    magic, whole = _split(data)
    assert len(whole) == 6  # call, 4 steps, end
    path = tmp_path / "bad.nxl"
    path.write_bytes(magic + b"".join(frames(whole)))
    calls = _damaged(path, reason)
    (call,) = calls
    assert [s.step for s in call.steps] == kept and calls.damage.steps_recovered == len(kept)
    assert not calls.damage.torn and (calls.damage.call == 0 or "frame number" in reason)
    for read, live in zip(call.steps, probe.steps):  # what was kept is exact
        assert torch.equal(read.normxlogit, live.normxlogit)


def test_a_rotated_file_missing_from_the_middle_is_damage(model, tmp_path):
    folder = tmp_path / "rot"
    ids = torch.randint(1, 100, (1, 5), generator=torch.Generator().manual_seed(6))
    with nxl.attach(model, layers="last", sink=nxl.RotatingSink(folder, max_bytes=1500)) as probe:
        model.generate(input_ids=ids, max_new_tokens=12, do_sample=False)
    files = sorted(folder.iterdir())
    assert len(files) >= 4
    whole = nxl.read_stream(folder)
    assert whole.damage is None and [s.step for s in whole[0].steps] == list(range(12))
    lost = files[2]
    before = nxl.read_stream(files[1])[0].steps[-1].step  # the last step of the file before the lost one
    lost.unlink()
    calls = _damaged(folder, rf"{lost.name} is missing \(deleted or lost\) between {files[1].name} and "
                             rf"{files[3].name}; records of call 0 \(after step {before}\) break off there")
    assert [s.step for s in calls[0].steps] == list(range(before + 1)) and not calls[0].complete
    assert calls.damage.steps_recovered == before + 1
    assert all(torch.equal(a.normxlogit, b.normxlogit) for a, b in zip(calls[0].steps, probe.steps))
    files[0].unlink()  # the oldest gone too: retention, not damage, before the first kept file
    assert nxl.read_stream(files[1])[0].steps  # one rotated file still reads on its own
    renamed = folder / f"{int(files[3].name[:8]) + 5:08d}-{files[3].name[9:]}"
    files[3].rename(renamed)
    with pytest.raises(nxl.StreamError, match="renamed or copied"):
        nxl.read_stream(renamed, strict=True)


def test_a_rotating_folder_whose_numbers_pass_eight_digits_keeps_its_retention_and_reads_in_order(model, tmp_path):
    """File numbers go on from the files already in the folder, past 99999999 after 10^8 rotations (a small
    ``max_bytes`` on a server that runs for weeks): the files named with nine digits were no rotated files to the
    retention (kept for ever, the disk filling) nor to the reader (each read alone, its calls' first steps said
    missing), and by name 100000000 came before 99999999."""
    folder = tmp_path / "rot"
    folder.mkdir()
    (folder / "99999997-00000001.nxl").touch()  # an earlier writer's last file: the numbering has come this far
    ids = torch.randint(1, 100, (1, 5), generator=torch.Generator().manual_seed(7))
    sequence = model.generate(input_ids=ids, max_new_tokens=16, do_sample=False)
    with nxl.attach(model, layers="last", sink=nxl.RotatingSink(folder, max_bytes=1500, max_files=100)):
        model.generate(input_ids=ids, max_new_tokens=16, do_sample=False)
    names = {path.name for path in folder.iterdir()}
    assert {"99999998-99999998.nxl", "99999999-99999998.nxl", "100000000-99999998.nxl"} <= names
    (call,) = nxl.read_stream(folder, strict=True)  # every file, in order across 99999999 -> 100000000
    assert call.complete and [step.step for step in call.steps] == list(range(16))
    assert torch.equal(call.sequences, sequence)  # generate's own output
    hand = llama(model)
    for step in call.steps:
        logits, embeddings = prefix_logits(model, hand, sequence[:, :step.position],
                                           torch.ones(1, step.position, dtype=torch.bool))
        torch.testing.assert_close(step.normxlogit, normxlogit(logits, embeddings, step.token)[1][-1:],
                                   rtol=1e-4, atol=1e-4)
    with nxl.attach(model, layers="last", sink=nxl.RotatingSink(folder, max_bytes=1500, max_files=1)):
        model.generate(input_ids=ids, max_new_tokens=1, do_sample=False)
    (kept,) = folder.iterdir()  # the retention deleted every older file, nine digits or eight
    writer = max(int(name.split("-")[0]) for name in names) + 1  # numbers go on: its first file's, nine digits
    assert kept.name.endswith(f"-{writer}.nxl") and nxl.read_stream(folder, strict=True)[0].complete


def test_a_rotated_file_cut_short_before_the_last_says_which_call_breaks_off_and_counts_the_writers_steps(
        model, tmp_path):
    """A rotated file that is not its writer's last, cut inside its last frame (a copy cut short): its end is no
    killed writer's, so it is damage, and says which call's records break off there, as an altered frame or a
    missing file says it (the reason named none, ``damage.call`` was None). ``steps_recovered`` counts the steps
    read from the writer's files before it, as a missing file's damage counts them (it counted that file's only)."""
    folder = tmp_path / "rot"
    ids = torch.randint(1, 100, (1, 5), generator=torch.Generator().manual_seed(6))
    with nxl.attach(model, layers="last", sink=nxl.RotatingSink(folder, max_bytes=1500)):
        model.generate(input_ids=ids, max_new_tokens=12, do_sample=False)
    files = sorted(folder.iterdir())
    assert len(files) >= 4
    cut = files[2]
    _, frames = _split(cut.read_bytes())
    steps = [reader._decode(memoryview(frame)[16:])[0].get("step") for frame in frames]
    last = max(step for step in steps[:-1] if step is not None)  # the step read last: the cut frame's is lost
    cut.write_bytes(cut.read_bytes()[:-10])
    calls = _damaged(folder, rf"the frame announces .* only .* follow; records of call 0 \(after step {last}\) break "
                             "off there")
    assert not calls.damage.torn and calls.damage.call == 0 and calls.damage.path == str(cut)
    assert [s.step for s in calls[0].steps] == list(range(last + 1)) and not calls[0].complete
    assert calls.damage.steps_recovered == last + 1 == len(calls[0].steps)


def test_a_folder_reads_while_its_writer_starts_a_file_or_its_retention_deletes_one(model, tmp_path, monkeypatch):
    """Read while written: the newest file, just created, holds no magic line yet (or part of it): torn, as a
    single file cut short in its header is; a file is deleted by the writer's retention after the ones before it
    were read, so the folder is read again from its oldest kept file. Neither is damage nor an error."""
    folder = tmp_path / "rot"
    ids = torch.randint(1, 100, (1, 5), generator=torch.Generator().manual_seed(6))
    with nxl.attach(model, layers="last", sink=nxl.RotatingSink(folder, max_bytes=1500)):
        model.generate(input_ids=ids, max_new_tokens=12, do_sample=False)
    files = sorted(folder.iterdir())
    number, writer_number = int(files[-1].name[:8]), int(files[-1].name[9:17])
    starting = folder / f"{number + 1:08d}-{writer_number:08d}.nxl"
    for started in (b"", writer._FILE_MAGIC[:5]):
        starting.write_bytes(started)
        read = nxl.read_stream(folder, strict=True)
        # steps_recovered: the writer's steps read before it, in its earlier files
        assert read.damage.torn and read.damage.path == str(starting) and read.damage.steps_recovered == 12
        assert [s.step for s in read[0].steps] == list(range(12)) and read[0].complete
    starting.unlink()
    real, deleted = reader.read_regular, []

    def retention_meanwhile(path, *args, **kwargs):  # the second file goes, and the first, once the first was read
        if path == files[1] and not deleted:
            deleted.extend(files[:2])
            for old in files[:2]:
                old.unlink()
            raise FileNotFoundError(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(reader, "read_regular", retention_meanwhile)
    (call,) = nxl.read_stream(folder)
    assert deleted and call.complete  # read again: from the oldest file kept, the call's steps from there on
    expected = nxl.read_stream(files[2])[0].steps[0].step
    assert [s.step for s in call.steps] == list(range(expected, 12))


@pytest.mark.parametrize("kept", [0, 7, len(writer._FILE_MAGIC) - 1])
def test_a_file_whose_writer_was_killed_in_its_header_reads_as_torn_and_exports_saying_so(tmp_path, capsys, kept):
    """A writer SIGKILLed in its first write leaves a part of the magic line (nothing, once it emptied the file to
    write it): no record reached it, so it reads as none, torn as a cut last frame is, alone or in a folder (it
    was "not an nxl_hooks stream file", and nxl export refused it). An empty file of another origin reads so too."""
    pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "run.nxl"
    path.write_bytes(writer._FILE_MAGIC[:kept])
    reason = (f"only {kept} bytes of the {len(writer._FILE_MAGIC)}-byte file header: its writer stopped before its "
              "first record")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torn is no damage: no warning, strict or not
        for read in (nxl.read_stream(path, strict=True), nxl.read_stream(tmp_path)):
            assert read == [] and read.damage.torn and read.damage.reason == reason
            assert (read.damage.path, read.damage.steps_recovered, read.damage.bytes_dropped) == (str(path), 0, kept)
    capsys.readouterr()
    assert main(["export", str(path), str(tmp_path / "o.parquet"), "--strict"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line == (f"{tmp_path / 'o.parquet'}: 0 rows from 0 call(s); {path}: torn, its end left out (a writer "
                    f"killed mid-write): frame 0 at byte 0: {reason}; 0 step record(s) recovered before it ({kept} "
                    "bytes left out)"), line


def test_a_call_whose_first_steps_a_rotating_sink_deleted_reads_as_its_own_file_as_a_page_and_by_its_texts(tmp_path):
    """read_stream(folder) gives a call whose first files retention deleted from its first kept step. The file
    stream_bytes makes of it (the endpoint's /frames of a request no longer in memory) read as damaged ("its first
    step record is step 18 (steps 0-17 missing)"), generation_html raised IndexError, and top() named even the
    prompt's tokens by their position: its prompt's texts were dropped with the unknown ones."""
    from nxl_hooks.records.html import generation_html

    model, tok = tiny.build_model("llama"), tiny.tokenizer()
    folder, ids = tmp_path / "rot", torch.tensor([[5, 6, 7, 8]])
    with nxl.attach(model, sink=nxl.RotatingSink(folder, max_bytes=3000, max_files=2), tokenizer=tok):
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, min_new_tokens=20,
                       do_sample=False, pad_token_id=0, eos_token_id=None)
    (call,) = nxl.read_stream(folder, strict=True)
    first = call.steps[0].step
    assert first > 1 and [s.step for s in call.steps] == list(range(first, 20)) and call.complete
    one = tmp_path / "one.nxl"
    one.write_bytes(writer.stream_bytes(call, {}))
    (again,) = nxl.read_stream(one, strict=True)
    assert [s.step for s in again.steps] == list(range(first, 20)) and again.complete
    assert all(torch.equal(a.normxlogit, b.normxlogit) for a, b in zip(again.steps, call.steps))
    # without its mark, a first step record that is not step 0 is still steps missing
    _, frames = _split(one.read_bytes())
    unmarked = tmp_path / "unmarked.nxl"
    unmarked.write_bytes(writer._FILE_MAGIC + frames[0] + _reencoded(frames[1], lambda h: h.pop("first_kept"))
                         + b"".join(frames[2:]))
    _damaged(unmarked, rf"its first step record is step {first} \(steps 0-{first - 1} missing\)")
    words = tok.convert_ids_to_tokens(ids[0].tolist())  # the prompt's texts, from the tokenizer

    def text(p):  # position p's text: the prompt's word, "@p" for a deleted step's token, else the kept step's
        return words[p] if p < 4 else f"@{p}" if p < 4 + first else again.steps[p - 4 - first].readable[0]

    step = again.steps[-1]
    named = again.attribution(step).top(step.position)
    assert any(p < 4 for p, _, _ in named) and all(name == text(p) for p, name, _ in named)
    page = generation_html(again)
    assert f"the record starts at step {first}: a rotating sink deleted the files" in page
    assert " ".join(words) in page  # the prompt as it reads
    columns = json.loads(page.split('id="nxl-data">')[1].split("</script>")[0])["columns"]
    assert columns == [f"{p}: {text(p)}" for p in range(4 + 20)]


def _reencoded(frame: bytes, header=lambda h: None, tensors=lambda t: None) -> bytes:
    """``frame`` with its header and tensors changed in place by the two functions, and a valid checksum again."""
    (payload,) = [p for _, _, p, _ in reader._frames(bytearray(writer._FILE_MAGIC + frame))]
    head, stored = reader._decode(payload)
    header(head)
    tensors(stored)
    return writer._encode(stored, {k: v for k, v in head.items() if k != "seq"}, head.get("seq"))


@pytest.mark.parametrize("frame, change", [
    (0, lambda h, t: h.update(readable=[["a"]])),  # a prompt of 5 tokens
    (0, lambda h, t: h.update(readable=[["a"] * 5, ["b"] * 5])),  # a batch of 1
    (0, lambda h, t: h.update(readable=[1] * 100_000)),  # (its error is one short line)
    (1, lambda h, t: h.update(readable=["x", "y"])),
    (1, lambda h, t: h.update(readable=[["x"]])),
    (1, lambda h, t: h.update(time=float("inf"))),
    (1, lambda h, t: h.update(time=float("nan"))),
    (1, lambda h, t: h.update(time=1e300)),
    (0, lambda h, t: h.update(call=2 ** 63)),
    (0, lambda h, t: h.update(layers=[0, 2 ** 40])),
    (0, lambda h, t: h.update(special_ids=[2 ** 63])),
    (0, lambda h, t: t.update(prompt_mask=torch.ones(1_000_000, 0, dtype=torch.bool), prompt_ids=None)),
], ids=["call texts short", "call texts rows", "call texts not texts", "step texts rows", "step texts nested",
        "time infinite", "time nan", "time huge", "call index", "layer", "special id", "rows of nothing"])
def test_a_frame_with_header_values_no_writer_makes_is_refused_in_one_short_line(recorded, tmp_path, frame, change):
    """Values no writer puts in a frame (texts that do not fit the record, numbers out of any range a record has) are
    a frame nxl_hooks did not write: refused when read. They were read, and every reader of the records (repr, the
    views, HTML, the Parquet export) failed on them later, or used memory the file's few bytes chose."""
    data, _ = recorded
    magic, frames = _split(data)
    path = tmp_path / "crafted.nxl"
    # the frame changed is the file's last: nothing after it refuses it on other grounds (a step of another call)
    path.write_bytes(magic + b"".join(frames[:frame] + [_reencoded(frames[frame])]))
    read = nxl.read_stream(path, strict=True)  # re-encoded as it was, the frame reads
    assert read.damage is None and len(read[0].steps) == frame

    replaced: dict = {}  # tensors the change replaces (None: removed), applied after its header's

    def tensors(stored: dict) -> None:
        for name, value in replaced.items():
            stored.pop(name) if value is None else stored.__setitem__(name, value)

    crafted = _reencoded(frames[frame], header=lambda h: change(h, replaced), tensors=tensors)
    path.write_bytes(magic + b"".join(frames[:frame] + [crafted]))
    for strict in (True, False):
        with pytest.raises(nxl.StreamError, match="has a valid checksum but is not a record") as failed:
            nxl.read_stream(path, strict=strict)
        assert len(str(failed.value)) < 400 and "\n" not in str(failed.value)


def test_a_calls_error_with_control_characters_reads_as_written_and_prints_escaped(recorded, tmp_path, model):
    """An end frame whose error holds an escape sequence, a bell and a bidi override (a crafted file, or a host's
    exception message): the call reads it as written, and its repr, its page and the terminal's stop reason show
    it escaped. print(call) sent them to the terminal raw."""
    from nxl_hooks.apps.terminal import stop_reason
    from nxl_hooks.records.html import generation_html

    magic, frames = _split(recorded[0])
    error = "recording stopped\x1b]0;owned\x07\x1b[2J\u202egnp.exe"
    crafted = _reencoded(frames[-1], lambda h: h.update(error=error, complete=False))
    (tmp_path / "crafted.nxl").write_bytes(magic + b"".join(frames[:-1]) + crafted)
    (call,) = nxl.read_stream(tmp_path / "crafted.nxl", strict=True)
    assert call.error == error
    shown = r"recording stopped\x1b]0;owned\x07\x1b[2J\u202egnp.exe"  # each character's escape, by hand
    for printed in (repr(call), generation_html(call), stop_reason(model, None, call, 4)):
        assert shown in printed and not any(char in printed for char in "\x1b\x07\u202e")


def test_a_folder_reads_while_its_writer_rotates_away_every_file_it_listed(recorded, tmp_path, monkeypatch):
    """The writer's retention deletes the files the reader listed before it opens the first (one file kept, or
    all of them rotated away at once): the folder is listed again (it raised FileNotFoundError, or read nothing and
    said no damage)."""
    path = tmp_path / "one.nxl"
    path.write_bytes(recorded[0])
    (call,) = nxl.read_stream(path)
    for kept, first in ((1, 1), (2, 2)):
        folder = tmp_path / f"rot{kept}"
        sink = nxl.RotatingSink(folder, max_bytes=900, max_files=kept)
        sink.write_call(call, {})
        for step in call.steps[:first]:
            sink.write_step(step)
        listed = sorted(folder.iterdir())
        real, rotated = reader.read_regular, []

        def writer_meanwhile(file, *args, **kwargs):  # the writer goes on between the listing and the first open
            if not rotated:
                rotated.append(file)
                for step in call.steps[first:]:
                    sink.write_step(step)  # each one a file of its own, the oldest deleted
                sink.write_end(call)
            return real(file, *args, **kwargs)

        monkeypatch.setattr(reader, "read_regular", writer_meanwhile)
        read = nxl.read_stream(folder, strict=True)
        monkeypatch.setattr(reader, "read_regular", real)
        sink.close()
        assert not set(listed) & set(folder.iterdir())  # every file listed first was gone when it was opened
        steps = [s.step for s in read[0].steps]  # the last ones, those in the files kept
        assert len(read) == 1 and read[0].complete and steps == list(range(len(call.steps) - len(steps),
                                                                            len(call.steps)))


def test_a_folder_nested_deeper_than_the_recursion_limit_reads(recorded, tmp_path):
    """Python 3.11's rglob recursed once per level: a deep folder raised RecursionError. The limit is Python's
    default here (torch's compilers raise it for the process, and 2000 levels of a path pass PATH_MAX)."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    try:
        _read_deeper_than_the_recursion_limit(recorded, tmp_path)
    finally:
        sys.setrecursionlimit(limit)


def _read_deeper_than_the_recursion_limit(recorded, tmp_path):
    depth = sys.getrecursionlimit() + 200
    levels = [tmp_path.joinpath(*["d"] * level) for level in range(1, depth + 1)]
    for level in levels:  # (pathlib's and os's own makedirs recurse too)
        level.mkdir()
    (levels[-1] / "run.nxl").write_bytes(recorded[0])
    (tmp_path / "top.nxl").write_bytes(recorded[0])
    try:
        assert [call.complete for call in nxl.read_stream(tmp_path)] == [True, True]
    finally:  # (as does the removal of pytest's temporary folders)
        (levels[-1] / "run.nxl").unlink()
        for level in reversed(levels):
            level.rmdir()


def test_a_folder_below_that_cannot_be_listed_is_passed_over(recorded, tmp_path, monkeypatch):
    """As ``lost+found`` at a mount's root is to its owner's readers; the folder given itself is not."""
    (tmp_path / "locked").mkdir()
    (tmp_path / "run.nxl").write_bytes(recorded[0])
    scandir = os.scandir

    def refused(path):
        if os.path.basename(path) == "locked":
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(reader.os, "scandir", refused)
    assert [call.complete for call in nxl.read_stream(tmp_path)] == [True]
    with pytest.raises(PermissionError):
        nxl.read_stream(tmp_path / "locked")


def _in_thread(fn) -> BaseException | None:
    """Run ``fn`` in a thread for at most 10 s; the exception it raised (a hang fails the test)."""
    out: list = []

    def run() -> None:
        try:
            fn()
        except BaseException as error:  # noqa: BLE001 - handed back to the test
            out.append(error)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the reader blocked"
    return out[0] if out else None


@pytest.mark.parametrize("reader, error", [(nxl.read_stream, nxl.StreamError),
                                           (nxl.Attribution.load, nxl.RecordError)])
def test_readers_refuse_a_fifo_a_device_and_a_socket_before_opening(tmp_path, reader, error):
    fifo = tmp_path / "run.nxl"
    os.mkfifo(fifo)
    failed = _in_thread(lambda: reader(fifo))
    assert isinstance(failed, error) and "is a FIFO (named pipe), not a regular file" in str(failed)
    start = time.monotonic()
    failed = _in_thread(lambda: reader("/dev/zero"))
    assert isinstance(failed, error) and "/dev/zero is a character device, not a regular file" in str(failed)
    assert time.monotonic() - start < 2  # refused at once, nothing read
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(tmp_path / "s.nxl"))
        failed = _in_thread(lambda: reader(tmp_path / "s.nxl"))
    assert isinstance(failed, error) and "is a socket, not a regular file" in str(failed)
    assert nxl.read_stream(tmp_path) == []  # a folder walk skips what is not a regular file


_TOO_LARGE = textwrap.dedent("""
    import resource, sys
    import nxl_hooks as nxl
    from nxl_hooks.apps.cli import main
    # no allocation of 4 GiB or more succeeds, whatever the machine's overcommit (one that overcommits would take
    # the 1 TiB and be killed filling it)
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))
    for reader in (nxl.read_stream, nxl.Attribution.load):
        try:
            reader(sys.argv[1])
        except nxl.RecordError as error:
            print(type(error).__name__, error)
    print("exit", main(["export", sys.argv[1], sys.argv[2]]))
""")


def test_a_file_larger_than_memory_is_one_line(tmp_path):
    """A 1 TiB stream or attribution file (sparse: no disk used): read_stream and Attribution.load raised
    MemoryError, nxl export ended in its traceback with exit 1."""
    path = tmp_path / "run.nxl"
    with path.open("wb") as fh:
        fh.write(writer._FILE_MAGIC)
        fh.truncate(1 << 40)
    done = subprocess.run([sys.executable, "-c", _TOO_LARGE, str(path), str(tmp_path / "o.parquet")],
                          capture_output=True, text=True, timeout=300)
    line = (f"{path} holds {1 << 40} bytes, more than this machine's free memory can hold (nxl_hooks reads a records "
            "file whole): read it on a machine with more memory free")
    assert done.stdout == f"StreamError {line}\nRecordError {line}\nexit 2\n", done.stdout + done.stderr
    assert done.stderr.endswith(f"nxl export: error: {line}\n") and "Traceback" not in done.stderr, done.stderr


def test_an_attribution_file_whose_tensors_do_not_fit_in_memory_is_said_so(recorded, tmp_path, monkeypatch):
    """Read whole, a file's tensors are copies again: memory running out there is no "not a safetensors file"."""
    from nxl_hooks.records import attribution

    path = recorded[1].calls[-1].steps[0].to_attribution().save(tmp_path / "a.safetensors")

    def no_memory(data: bytes) -> None:
        raise MemoryError

    monkeypatch.setattr(attribution, "_load_blob", no_memory)
    with pytest.raises(nxl.RecordError) as error:
        nxl.Attribution.load(path)
    assert str(error.value) == (f"{path} holds {path.stat().st_size} bytes, more than this machine's free memory can "
                                "hold (nxl_hooks reads a records file whole): read it on a machine with more memory "
                                "free")


def _counting(monkeypatch) -> list[int]:
    """Count the payload bytes the reader checksums."""
    seen, crc = [0], reader._crc
    monkeypatch.setattr(reader, "_crc", lambda view: seen.__setitem__(0, seen[0] + len(view)) or crc(view))
    return seen


def _crafted(size: int, kind: str) -> bytes:
    """A stream file of about ``size`` bytes built to make a naive damage scan quadratic."""
    body = bytearray()
    if kind == "markers":  # frame markers everywhere, each announcing what runs past the end
        body = bytearray(b"NXLF" * (size // 4))
    else:  # candidates that fit, each announcing the rest of the file, with wrong checksums
        step = 32
        count = size // step
        for i in range(count):
            rest = (count - i) * step - 16
            body += struct.pack("<4sQI", b"NXLF", rest, 0) + bytes(step - 16)
    return writer._FILE_MAGIC + bytes(body)


@pytest.mark.parametrize("kind", ["markers", "fitting"])
def test_the_damage_scan_examines_bytes_linear_in_the_file_size(tmp_path, monkeypatch, kind):
    seen = _counting(monkeypatch)
    examined = []
    for size in (1 << 14, 1 << 15, 1 << 16, 1 << 17):
        path = tmp_path / f"{kind}-{size}.nxl"
        path.write_bytes(_crafted(size, kind))
        seen[0] = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", reader.StreamDamageWarning)
            calls = nxl.read_stream(path)
        assert calls == [] and calls.damage is not None and calls.damage.frame == 0
        examined.append(seen[0])
        assert seen[0] <= 2 * path.stat().st_size  # at most twice the file: a quadratic scan passes this at 16 KiB
    if kind == "fitting":
        assert examined[-1] > 0


def test_a_real_damaged_file_is_scanned_once_and_frames_after_are_counted(recorded, tmp_path, monkeypatch):
    data, _ = recorded
    magic, frames = _split(data)
    big = bytearray(magic + b"".join(frames[:1] + frames[1:5] * 1 + frames[5:]))
    big[len(magic) + len(frames[0]) + 40] ^= 0xFF  # step 0's payload altered
    path = tmp_path / "flipped.nxl"
    path.write_bytes(bytes(big))
    seen = _counting(monkeypatch)
    # the frame names no call: the one running, whose records break off there, is named (the docs promised which)
    with pytest.warns(reader.StreamDamageWarning, match=r"checksum .*; records of call 0 \(no step yet\) break off"):
        calls = nxl.read_stream(path)
    assert calls.damage.frames_after == 4 and calls.damage.frame == 1 and calls.damage.call == 0
    assert seen[0] <= len(big)


@pytest.mark.parametrize("byte", [0, 3])
def test_a_last_frame_whose_length_was_altered_upward_is_damage_not_a_torn_end(recorded, tmp_path, byte):
    """The end frame's length raised by a flipped bit runs past the end of the file as a torn frame does, and was
    left out quietly (the call read as never ended); its payload is all there, its checksum holds: damage."""
    data, _ = recorded
    magic, frames = _split(data)
    altered = bytearray(data)
    altered[len(data) - len(frames[-1]) + 4 + byte] ^= 0x80  # the end frame's length (uint64 after its marker)
    path = tmp_path / "altered.nxl"
    path.write_bytes(bytes(altered))
    calls = _damaged(path, "frame 5 at byte .*: the frame announces")
    assert not calls.damage.torn and [s.step for s in calls[0].steps] == [0, 1, 2, 3]


def test_a_torn_file_does_not_hide_another_files_damage(recorded, tmp_path, capsys):
    """A folder of two writers' files: a.nxl ends torn (a killed writer: no damage), b.nxl has a flipped byte in its
    first step frame. ``damage`` is b's, ``damages`` both, and nxl export's summary names each file and what it lost
    (it said only "a torn last frame left out", and exited 0 with b's records dropped unsaid)."""
    pytest.importorskip("pyarrow.parquet")
    data, _ = recorded
    magic, frames = _split(data)
    folder = tmp_path / "runs"
    folder.mkdir()
    (folder / "a.nxl").write_bytes(data[:-7])  # the end frame torn
    flipped = bytearray(data)
    flipped[len(magic) + len(frames[0]) + 40] ^= 0xFF  # step 0's payload altered
    (folder / "b.nxl").write_bytes(bytes(flipped))
    with pytest.warns(nxl.StreamDamageWarning, match="b.nxl is damaged"):
        calls = nxl.read_stream(folder)
    a, b = str(folder / "a.nxl"), str(folder / "b.nxl")
    assert (calls.damage.path, calls.damage.torn) == (b, False)
    assert [(found.path, found.torn, found.frame) for found in calls.damages] == [(a, True, 5), (b, False, 1)]
    capsys.readouterr()
    assert main(["export", str(folder), str(tmp_path / "o.parquet")]) == 0  # as for one damaged file
    line = capsys.readouterr().out
    assert (f"; {a}: torn, its end left out (a writer killed mid-write): frame 5 at byte "
            f"{len(data) - len(frames[-1])}: ") in line, line
    assert (f"; {b}: damaged, read up to: frame 1 at byte {len(magic) + len(frames[0])}: checksum (CRC-32) mismatch"
            ": the frame was altered after it was written; records of call 0 (no step yet) break off there; 0 step "
            "record(s) recovered before it, 4 intact frame(s) after it not read") in line, line


_CTRL_C = textwrap.dedent("""
    import sys, time, warnings
    import nxl_hooks as nxl
    warnings.simplefilter("ignore")
    started = time.monotonic()
    nxl.read_stream(sys.argv[1])  # one whole read, uninterrupted: what a read takes on this machine now
    print(f"start {time.monotonic() - started:.3f}", flush=True)
    try:
        while True:
            nxl.read_stream(sys.argv[1])
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(7)
""")


def test_ctrl_c_interrupts_a_long_read(tmp_path):
    """Ctrl-C during reads of a 256 MiB frame ends them within about one read's time (the reader checks between
    pieces), measured against the child's own timing of one read: a bound that load stretches alike, unlike a fixed
    number of seconds (5 s failed on a busy machine). A read that swallowed the interrupt would read on."""
    path = tmp_path / "huge.nxl"
    size = 256 << 20
    with path.open("wb") as fh:  # one frame announcing a 256 MiB payload: read, then checksummed, in pieces
        fh.write(writer._FILE_MAGIC + struct.pack("<4sQI", b"NXLF", size, 1))
        fh.truncate(len(writer._FILE_MAGIC) + 16 + size)  # sparse: no disk used
    child = subprocess.Popen([sys.executable, "-c", _CTRL_C, str(path)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, preexec_fn=tiny.ctrl_c_reaches)
    try:
        word, one_read = child.stdout.readline().split()
        assert word == "start"
        time.sleep(min(1.0, float(one_read) / 2))  # inside a read
        child.send_signal(signal.SIGINT)
        sent = time.monotonic()
        out, _ = child.communicate(timeout=120)
        assert time.monotonic() - sent < 2 * float(one_read) + 3  # (a second read, and the interpreter's exit)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 7 and out.startswith("interrupted"), out


def test_a_stream_file_written_by_0_1_still_reads(model):
    """tests/data/stream-v1.nxl: written by nxl_hooks 0.1 (format 1, no frame numbers): generate on test_generate's
    model, ids from seed 5, layers [0, -1], 3 new tokens. Its records equal the oracle's."""
    (call,) = nxl.read_stream(DATA / "stream-v1.nxl", strict=True)
    assert (DATA / "stream-v1.nxl").read_bytes().startswith(b"nxl_hooks.stream/1\n")
    assert call.complete and len(call.steps) == 3 and call.layers == [0, 3]
    ids = torch.randint(1, 100, (2, 5), generator=torch.Generator().manual_seed(5))
    assert torch.equal(call.prompt_ids, ids)
    hand = llama(model)
    for step in call.steps:
        n = step.position
        logits, embeddings = prefix_logits(model, hand, call.sequences[:, :n], torch.ones(2, n, dtype=torch.bool))
        torch.testing.assert_close(step.normxlogit, normxlogit(logits, embeddings, step.token)[1][[0, 3]],
                                   rtol=1e-4, atol=1e-4)
        assert torch.equal(step.token, call.sequences[:, n])


def test_a_stream_file_written_by_0_2_reads_and_exports_without_the_new_fields(tmp_path):
    """tests/data/stream-v2.nxl: written by nxl_hooks at commit 1ff058c (format 2, before records had a model name,
    times and special-token ids): tests/bpe_tiny.py's model and tokenizer, a ChatML prompt with a system prompt,
    layers [0, -1], 2 new tokens. It reads whole, with None where those fields are, and exports to Parquet (null
    model and time)."""
    pq = pytest.importorskip("pyarrow.parquet")
    import bpe_tiny

    (call,) = nxl.read_stream(DATA / "stream-v2.nxl", strict=True)
    assert call.complete and len(call.steps) == 2 and call.layers == [0, 3] and call.prompt_template is not None
    assert (call.model, call.started, call.ended, call.special_ids) == (None, None, None, None)
    assert call.target_texts is None  # (nor the fixed targets' texts)
    assert [step.time for step in call.steps] == [None, None]
    tok = bpe_tiny.bpe_tokenizer()
    assert call.text == tok.decode(call.sequences[0, call.prompt_ids.shape[1]:])
    assert main(["export", str(DATA / "stream-v2.nxl"), str(tmp_path / "old.parquet")]) == 0
    table = pq.read_table(tmp_path / "old.parquet").to_pydict()
    assert set(table["model"]) == {None} and set(table["time"]) == {None} and not any(table["special"])
    assert any(table["template"]) and not any(r and t for r, t in zip(table["ranked"], table["template"]))


def test_read_regular_can_refuse_links_and_files_over_a_bound(tmp_path):
    """What nxl attach reads from a folder another user may write: no symbolic link followed, no size unbounded."""
    from nxl_hooks.records.files import read_regular

    (tmp_path / "answer").write_bytes(b"{}")
    (tmp_path / "link").symlink_to(tmp_path / "answer")
    assert read_regular(tmp_path / "link") == b"{}"  # followed by default, as every stream reader does
    with pytest.raises(ValueError, match="is a symbolic link, not a regular file"):
        read_regular(tmp_path / "link", follow_symlinks=False)
    assert read_regular(tmp_path / "answer", follow_symlinks=False, max_bytes=2) == b"{}"
    with pytest.raises(ValueError, match="holds 2 bytes, more than the 1 expected"):
        read_regular(tmp_path / "answer", max_bytes=1)


def test_write_steps_appends_a_batch_with_one_write_that_reads_back_and_tears_whole(recorded, tmp_path, monkeypatch):
    """The sink thread's batches: ``write_steps`` writes several step frames with one ``write`` (numbered in
    order), which read back as the steps written one at a time; killed mid-batch, the file keeps the whole frames
    before the cut and reports the last one torn. A rotating sink starts a new file within a batch that would
    pass ``max_bytes`` and the folder reads back whole."""
    _, probe = recorded
    (call,) = probe.calls
    writes = []
    real = writer._write_all
    monkeypatch.setattr(writer, "_write_all", lambda fd, data: (writes.append(len(data)), real(fd, data)))
    sink = nxl.Sink(tmp_path / "batch.nxl")
    writes.clear()  # the file magic
    sink.write_call(call, probe.describe())
    sink.write_steps(call.steps)
    sink.write_end(call)
    sink.close()
    assert len(writes) == 3  # the call, all 4 steps, the end
    (read,) = nxl.read_stream(tmp_path / "batch.nxl")
    assert read.complete and [s.step for s in read.steps] == [0, 1, 2, 3]
    for got, kept in zip(read.steps, call.steps, strict=True):
        assert torch.equal(got.normxlogit, kept.normxlogit) and torch.equal(got.token, kept.token)
    data = (tmp_path / "batch.nxl").read_bytes()
    magic, frames = _split(data)
    cut = tmp_path / "cut.nxl"
    cut.write_bytes(magic + b"".join(frames[:3]) + frames[3][: len(frames[3]) // 2])  # killed inside step 2's frame
    calls = nxl.read_stream(cut)
    assert [s.step for s in calls[0].steps] == [0, 1] and calls.damage.torn and not calls[0].complete

    folder = tmp_path / "rotating"
    rotating = nxl.RotatingSink(folder, max_bytes=len(frames[0]) + 2 * len(frames[1]) + 200)
    rotating.write_call(call, probe.describe())
    rotating.write_steps(call.steps)
    rotating.write_end(call)
    rotating.close()
    assert len(list(folder.iterdir())) > 1  # the batch did not fit one file
    (again,) = nxl.read_stream(folder)
    assert again.complete and [s.step for s in again.steps] == [0, 1, 2, 3]
    assert all(torch.equal(a.logat, b.logat) for a, b in zip(again.steps, call.steps, strict=True))


def test_a_call_whose_readable_texts_pass_safetensors_100_mb_header_bound_reads_back(recorded, tmp_path):
    """A call frame's header holds its prompt's readable texts (about 17 bytes a token and row: 48 rows of 128k
    tokens pass 100 MB), more than safetensors' own load accepts: the file still reads, every record of it."""
    import dataclasses

    _, probe = recorded
    (call,) = probe.calls
    width = call.prompt_mask.shape[1]
    long = dataclasses.replace(call, readable=[["x" * (100_000_000 // width)] * width])
    sink = nxl.Sink(tmp_path / "long.nxl")
    sink.write_call(long, probe.describe())
    sink.write_steps(call.steps)
    sink.write_end(call)
    sink.close()
    data = (tmp_path / "long.nxl").read_bytes()
    assert struct.unpack_from("<Q", data, len(writer._FILE_MAGIC) + writer._FRAME.size)[0] > 100_000_000
    del data
    (read,) = nxl.read_stream(tmp_path / "long.nxl", strict=True)
    assert read.complete and read.readable == long.readable and torch.equal(read.prompt_ids, call.prompt_ids)
    for got, kept in zip(read.steps, call.steps, strict=True):
        assert torch.equal(got.normxlogit, kept.normxlogit) and torch.equal(got.token, kept.token)


@pytest.mark.parametrize("calls, per_file", [(1, 1.05), (2, 1.5)])
def test_running_call_frames_that_fill_a_file_hold_rotation_back_by_a_files_worth_only(model, tmp_path, calls,
                                                                                          per_file):
    """One call frame just under max_bytes (with the next step it is not): a new file at each step wrote it again,
    once per step. Two whose frames each fit but together do not: rotation (and the max_files bound) stopped for
    as long as they ran, one file growing without end. A file now takes max_bytes of records after them."""
    import dataclasses

    ids = torch.randint(1, 100, (1, 5), generator=torch.Generator().manual_seed(4))
    with nxl.attach(model, layers=[0, -1]) as probe:
        for _ in range(calls):
            model.generate(input_ids=ids, max_new_tokens=24, do_sample=False)
    long = [dataclasses.replace(call, readable=[["x" * 2000] * call.prompt_mask.shape[1]]) for call in probe.calls]
    frames = [len(writer.encode_call(call, probe.describe(), seq=0)) for call in long]
    steps = [len(writer.encode_step(step, seq=0)) for call in probe.calls for step in call.steps]
    max_bytes = int(frames[0] * per_file)
    assert sum(frames) + steps[0] > max_bytes and sum(steps) > 2 * max_bytes  # (what the case is about)
    sink = nxl.RotatingSink(tmp_path / "rot", max_bytes=max_bytes, max_files=100)
    for call in long:
        sink.write_call(call, probe.describe())
    for kept in zip(*(call.steps for call in probe.calls)):  # their steps side by side: both calls running
        for step in kept:
            sink.write_step(step)
    for call in long:
        sink.write_end(call)
    sink.close()
    sizes = [path.stat().st_size for path in (tmp_path / "rot").iterdir()]
    bound = 32 + sum(frames) + max_bytes + 2 * max(steps)  # its head, the calls, a file's worth, the frames past it
    assert 1 < len(sizes) < len(steps) // 2 and max(sizes) <= bound, (sizes, bound)
    read = nxl.read_stream(tmp_path / "rot", strict=True)
    assert [len(call.steps) for call in read] == [len(call.steps) for call in probe.calls]
    assert all(torch.equal(got.normxlogit, kept.normxlogit)
               for back, call in zip(read, probe.calls) for got, kept in zip(back.steps, call.steps, strict=True))


def test_a_rotating_sink_writes_a_call_frame_larger_than_its_files_once_not_once_per_step(recorded, tmp_path):
    """A new file starts with the running calls' frames: where those alone pass max_bytes (a long prompt's texts),
    each new file would be as large and write them again, once per generated token. The file grows instead."""
    import dataclasses

    _, probe = recorded
    (call,) = probe.calls
    width = call.prompt_mask.shape[1]
    long = dataclasses.replace(call, readable=[["x" * 4000] * width])
    frame = len(writer.encode_call(long, probe.describe(), seq=0))
    sink = nxl.RotatingSink(tmp_path / "rot", max_bytes=frame // 2, max_files=100)
    sink.write_call(long, probe.describe())
    for step in call.steps:
        sink.write_step(step)
    sink.write_end(long)
    sink.close()
    assert sum(path.stat().st_size for path in (tmp_path / "rot").iterdir()) < 2 * frame
    (read,) = nxl.read_stream(tmp_path / "rot", strict=True)
    assert read.complete and read.readable == long.readable
    for got, kept in zip(read.steps, call.steps, strict=True):
        assert torch.equal(got.normxlogit, kept.normxlogit) and torch.equal(got.token, kept.token)


def test_a_file_put_there_while_the_sink_opens_it_is_never_removed(tmp_path, monkeypatch):
    """A stream sink removes the file it created when the file cannot be started; whether it created it was a check
    before the open, so a file another process put there in between (someone's data, refused as not a stream) was
    removed as the sink's own. The open itself now says whether it created the file."""
    path, real_open = tmp_path / "run.nxl", os.open

    def racing_open(name, flags, mode=0o777, **kwargs):  # another process writes its file just before this open
        if Path(name) == path and not path.exists():
            path.write_text("someone's data")
        return real_open(name, flags, mode, **kwargs)

    monkeypatch.setattr(os, "open", racing_open)
    with pytest.raises(ValueError, match="holds something other than an nxl_hooks stream"):
        writer.Sink(path)
    assert path.read_text() == "someone's data"
