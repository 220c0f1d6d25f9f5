"""The record pipeline (nxl_hooks.hooks.publish): sinks are fed from a thread of their own, so a sink that raises
anything (SystemExit, KeyboardInterrupt) or blocks never raises into or stalls the host's generate; it is stopped,
counted and reported, and the records in memory stay whole (checked against the uncached oracle)."""

import logging
import threading
import time

import pytest
import torch
from transformers import LlamaForCausalLM

import nxl_hooks as nxl
import tiny
from nxl_hooks.hooks import publish
from oracle import check_call

VOCAB = tiny.GEN_VOCAB


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny.generating_llama()


def _ids(seed: int, rows: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (rows, 5), generator=torch.Generator().manual_seed(seed))


class _Raising:
    """A third-party sink whose write_step raises ``error`` at the second step."""

    def __init__(self, error: BaseException) -> None:
        self.error, self.kinds, self.closed = error, [], False

    def write_call(self, call, meta):
        self.kinds.append("call")

    def write_step(self, step):
        if step.step == 1:
            raise self.error
        self.kinds.append("step")

    def write_end(self, call):
        self.kinds.append("end")

    def close(self):
        self.closed = True


@pytest.mark.parametrize("error", [SystemExit(3), KeyboardInterrupt(), OSError(28, "No space left on device")],
                         ids=["SystemExit", "KeyboardInterrupt", "OSError"])
def test_a_sink_that_raises_anything_never_reaches_generate(model, error):
    ids = _ids(1)
    plain = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    sink = _Raising(error)
    with nxl.attach(model, sink=sink) as probe:
        out = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)  # raises nothing
        again = model.generate(input_ids=ids, max_new_tokens=2, do_sample=False)
    assert torch.equal(out, plain) and torch.equal(again, plain[:, :7])
    assert probe.sink_fault == f"{type(error).__name__}: {error}".rstrip(": ") or probe.sink_fault.startswith(
        type(error).__name__)
    assert probe.unwritten == 3 + 2  # steps 1-3 of the first call, both of the second
    assert sink.kinds == ["call", "step"] and sink.closed  # stopped at the fault, its file released
    first, second = probe.calls
    assert first.notes == second.notes == [f"not written to the sink, which stopped: {probe.sink_fault}"]
    check_call(model, first, 4)  # the records in memory are whole and right
    check_call(model, second, 2)


class _Blocking:
    """A sink whose first write blocks until the test releases it (a sink on a hung network share)."""

    def __init__(self) -> None:
        self.release, self.closed = threading.Event(), threading.Event()
        self.returned, self.steps = 0, 0

    def write_call(self, call, meta):
        self.release.wait(timeout=120)
        self.returned += 1

    def write_step(self, step):
        self.steps += 1

    def write_end(self, call):
        pass

    def close(self):
        self.closed.set()


def test_a_blocked_sink_never_stalls_generate_nor_detach(model, monkeypatch, caplog):
    monkeypatch.setattr(publish, "DRAIN_SECONDS", 0.5)
    sink = _Blocking()
    probe = nxl.attach(model, sink=sink)
    try:
        model.generate(input_ids=_ids(2, rows=2), max_new_tokens=6, do_sample=False)
        # generate returned while the sink could not have written a frame: it never waited for the sink
        assert sink.returned == 0 and len(probe.steps) == 6  # every record is kept as the call returns
        assert probe.sink_fault is None  # 8 frames queued: within SINK_QUEUE
    finally:
        with caplog.at_level(logging.WARNING, logger="nxl_hooks"):
            probe.detach()  # waits DRAIN_SECONDS for the blocked sink, then leaves it
    assert sink.returned == 0 and not sink.closed.is_set()
    assert probe.sink_fault.startswith("it was still writing when the probe detached")
    # what was still queued is counted at the detach (the sink may never give its thread back); the frames its
    # thread holds when it does
    assert 0 < probe.unwritten <= 6
    # and said in the log with that count: a probe detached at interpreter exit (its finalizer) is read by nobody
    assert [r.getMessage() for r in caplog.records if r.name == "nxl_hooks"] == [
        "nxl_hooks: records sent to the sink _Blocking not written (it was still writing 0.5 s after the probe "
        f"detached: {probe.unwritten} step record(s) were still queued for it); the model's own call is unaffected"]
    sink.release.set()
    assert probe.flush(timeout=60)  # the sink thread closes it once the sink gives its thread back
    assert sink.closed.is_set() and sink.steps == 0 and probe.unwritten == 6
    assert probe.calls[0].notes == [f"not written to the sink, which stopped: {probe.sink_fault}"]
    check_call(model, probe.calls[0], 6)


class _HungAtSecondCall(_Blocking):
    """Blocks in its first write until released, then hangs for good (an NFS mount gone away) in the first step
    write of the second call, after its thread took that call's records from the queue."""

    def __init__(self) -> None:
        super().__init__()
        self.hung, self.unhang = threading.Event(), threading.Event()

    def write_step(self, step):
        if step.call == 1:
            self.hung.set()
            self.unhang.wait(timeout=120)
        super().write_step(step)


def test_a_sink_hung_at_detach_counts_the_records_its_thread_had_taken(model, monkeypatch):
    monkeypatch.setattr(publish, "DRAIN_SECONDS", 0.5)
    sink = _HungAtSecondCall()
    probe = nxl.attach(model, sink=sink)
    try:
        model.generate(input_ids=_ids(7), max_new_tokens=1, do_sample=False)
        model.generate(input_ids=_ids(8), max_new_tokens=6, do_sample=False)
        deadline = time.monotonic() + 60  # every frame waits behind the first: step and end of call 0, all of 1
        while probe._hub._frames_waiting < 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        sink.release.set()  # the sink thread takes every frame at once, then hangs at call 1's first step
        assert sink.hung.wait(timeout=60)
    finally:
        probe.detach()
    # the steps after the one the sink holds are counted at the detach, and noted on their call
    assert probe.sink_fault.startswith("it was still writing when the probe detached") and probe.unwritten == 5
    assert probe.calls[0].notes == [] and probe.calls[1].notes == [
        f"not written to the sink, which stopped: {probe.sink_fault}"]
    sink.unhang.set()
    assert probe.flush(timeout=60) and sink.closed.is_set()  # the sink came back: it wrote the step it held
    assert sink.steps == 2 and probe.unwritten == 5  # each record counted once, written or not
    check_call(model, probe.calls[1], 6)


class _SlowClose:
    """A sink that writes its file at close (as Parquet does), taking longer than the detach waits; ``fails``: and
    then fails there, losing the step records it took (its ``lost``)."""

    def __init__(self, fails: bool) -> None:
        self.fails, self.steps, self.lost, self.closed = fails, 0, 0, threading.Event()

    def write_call(self, call, meta):
        pass

    def write_step(self, step):
        self.steps += 1

    def write_end(self, call):
        pass

    def close(self):
        time.sleep(1.0)
        self.closed.set()
        if self.fails:
            self.lost = self.steps
            raise OSError(28, "No space left on device")


@pytest.mark.parametrize("fails", [False, True], ids=["finishes", "fails"])
def test_a_sink_still_closing_after_the_detach_is_said_as_what_becomes_of_it(model, monkeypatch, fails):
    """Every frame was written: the sink is not said to have lost records for closing slowly; if its close then
    fails, the records it had taken and lost are counted and said on the call."""
    monkeypatch.setattr(publish, "DRAIN_SECONDS", 0.3)
    sink = _SlowClose(fails)
    with nxl.attach(model, sink=sink) as probe:
        model.generate(input_ids=_ids(2), max_new_tokens=4, do_sample=False)
    assert not sink.closed.is_set() and probe.sink_fault is None and probe.unwritten == 0
    assert probe.flush(timeout=60) and sink.closed.is_set() and sink.steps == 4
    if fails:
        assert probe.sink_fault == "OSError: [Errno 28] No space left on device" and probe.unwritten == 4
        assert probe.calls[0].notes == [f"not written to the sink, which stopped: {probe.sink_fault}"]
    else:
        assert probe.sink_fault is None and probe.unwritten == 0 and probe.calls[0].notes == []


@pytest.mark.parametrize("fails", [False, True], ids=["finishes", "fails"])
def test_a_probe_that_saw_no_call_waits_for_its_sink_to_close_no_longer_than_after_one(model, monkeypatch, caplog,
                                                                                       fails):
    """A server detached before its first request: the sink's close (a hung network share) is left to finish in
    its own thread after DRAIN_SECONDS, said so, as after a call; what becomes of it is said once it has."""
    monkeypatch.setattr(publish, "DRAIN_SECONDS", 0.3)
    sink = _SlowClose(fails)
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"), nxl.attach(model, sink=sink) as probe:
        pass
    assert not sink.closed.is_set() and probe.sink_fault is None  # the detach returned while it was closing
    assert "the sink _SlowClose is still closing 0.3 s after the probe detached" in caplog.text
    assert probe.flush(timeout=60) and sink.closed.is_set() and probe.unwritten == 0
    assert probe.sink_fault == ("OSError: [Errno 28] No space left on device" if fails else None)


def test_a_probe_that_saw_no_call_closes_its_sink_where_no_thread_can_start(model, monkeypatch):
    """At interpreter shutdown no thread starts: the sink is closed in the detaching thread, never an error."""
    sink = _Raising(OSError())
    probe = nxl.attach(model, sink=sink)

    def refuse(thread):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    probe.detach()
    assert sink.closed and probe.sink_fault is None


class _QuietlyStopped(_Raising):
    """Stops by itself at the second step and says so with an empty ``fault``."""

    fault = None

    def write_step(self, step):
        if step.step == 1:
            self.fault = ""
        self.kinds.append("step")


class _StoppedLater(_Raising):
    """Has no ``fault`` until it stops at the second step (a sink written before the attribute was a protocol)."""

    def write_step(self, step):
        if step.step == 1:
            self.fault = ""
        self.kinds.append("step")


@pytest.mark.parametrize("kind", [_QuietlyStopped, _StoppedLater], ids=["declared", "set-when-stopping"])
def test_a_sink_that_stops_with_an_empty_fault_is_said_to_have_stopped(model, kind, caplog):
    sink = kind(OSError())
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"), nxl.attach(model, sink=sink) as probe:
        model.generate(input_ids=_ids(9), max_new_tokens=4, do_sample=False)
    assert probe.sink_fault == f"the sink {kind.__name__} stopped writing without saying why"
    assert [r.getMessage() for r in caplog.records if r.name == "nxl_hooks"] == [
        f"nxl_hooks: records sent to the sink {kind.__name__} not written ({probe.sink_fault}); the model's own "
        "call is unaffected"]  # in the log too, as a sink that raises is
    assert probe.unwritten == 3 and sink.closed  # its fault came with step 1: that step and the two after it
    assert probe.calls[0].notes == [f"not written to the sink, which stopped: {probe.sink_fault}"]
    check_call(model, probe.calls[0], 4)


def test_a_sink_that_falls_behind_is_stopped(model, monkeypatch, caplog):
    monkeypatch.setattr(publish, "SINK_QUEUE", 2)
    sink = _Blocking()
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"), nxl.attach(model, sink=sink) as probe:
        model.generate(input_ids=_ids(5), max_new_tokens=6, do_sample=False)
        assert probe.sink_fault.startswith("it fell behind: 2 frames were waiting")  # known when generate returns
        assert sink.returned == 0 and len(probe.steps) == 6
        sink.release.set()
    assert sink.closed.is_set() and sink.steps == 0 and probe.unwritten == 6
    assert probe.calls[0].notes == [f"not written to the sink, which stopped: {probe.sink_fault}"]
    # said once in the log, as a sink that raises is: a script that never reads sink_fault still hears of it
    assert [r.getMessage() for r in caplog.records if r.name == "nxl_hooks"] == [
        f"nxl_hooks: records sent to the sink _Blocking not written ({probe.sink_fault}); the model's own call is "
        "unaffected"]
    check_call(model, probe.calls[0], 6)


class _FailsWhenReleased(_Blocking):
    """Blocks in its first write until released, then raises: the write in flight when the sink was stopped."""

    def write_call(self, call, meta):
        super().write_call(call, meta)
        raise OSError(5, "Input/output error")


@pytest.mark.parametrize("behind", [True, False], ids=["fell-behind", "detach-deadline"])
def test_a_stopped_sink_whose_write_in_flight_then_fails_is_said_once(model, monkeypatch, caplog, behind):
    # the failure comes after the stop: the sink is stopped already, and a second line would contradict the first
    if behind:
        monkeypatch.setattr(publish, "SINK_QUEUE", 2)
    else:
        monkeypatch.setattr(publish, "DRAIN_SECONDS", 0.5)
    sink = _FailsWhenReleased()
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"):
        probe = nxl.attach(model, sink=sink)
        try:
            model.generate(input_ids=_ids(10), max_new_tokens=6, do_sample=False)
            if behind:
                assert probe.sink_fault.startswith("it fell behind") and sink.returned == 0
                sink.release.set()
        finally:
            probe.detach()  # else still blocked at the deadline: stopped there
        sink.release.set()
        assert probe.flush(timeout=60) and sink.closed.is_set() and sink.returned == 1  # its write failed after
    if behind:
        why = probe.sink_fault
    else:
        assert probe.sink_fault.startswith("it was still writing when the probe detached")
        why = "it was still writing 0.5 s after the probe detached: 6 step record(s) were still queued for it"
    assert [r.getMessage() for r in caplog.records if r.name == "nxl_hooks"] == [
        f"nxl_hooks: records sent to the sink _FailsWhenReleased not written ({why}); the model's own call is "
        "unaffected"]
    assert probe.unwritten == 6 and sink.steps == 0
    assert probe.calls[0].notes == [f"not written to the sink, which stopped: {probe.sink_fault}"]
    check_call(model, probe.calls[0], 6)


def test_flush_zero_says_whether_every_record_is_written_now(model):
    """flush(0) answered False whatever the pipeline held, even nothing at all: with nothing on its way it is True
    (everything is flushed), while a record the sink still holds makes it False."""
    gate = threading.Event()

    class Held:  # holds the call's first frame until the gate opens
        def __init__(self):
            self.steps = 0

        def write_call(self, call, meta):
            gate.wait(timeout=60)

        def write_step(self, step):
            self.steps += 1

        def write_end(self, call):
            pass

        def close(self):
            pass

    sink = Held()
    with nxl.attach(model, sink=sink) as probe:
        assert probe.flush(0)  # nothing made yet
        model.generate(input_ids=_ids(4), max_new_tokens=3, do_sample=False)
        assert not probe.flush(0) and sink.steps == 0  # the sink holds the call's first frame
        gate.set()
        assert probe.flush(timeout=60) and sink.steps == 3
        assert probe.flush(0) and probe.flush(0.0)
    check_call(model, probe.calls[0], 3)
    with nxl.attach(model) as probe:  # no sink: the records kept in memory
        model.generate(input_ids=_ids(4), max_new_tokens=2, do_sample=False)
        assert probe.flush(timeout=60) and probe.flush(0)
        assert len(probe.steps) == 2


def test_flush_zero_is_false_while_a_call_end_made_in_its_own_thread_is_still_on_its_way():
    """flush(0) asked the counts of what is on its way, then whether the thread making a call's end (end_later) was
    alive: that thread could hand the end on and finish in between, and flush(0) said True with the end unwritten.
    The thread here hands the end on as it is asked (the moment the race needs); the sink holds the end frame."""
    gate, ends = threading.Event(), []

    class Held:
        def write_call(self, call, meta):
            pass

        def write_step(self, step):
            pass

        def write_end(self, call):
            gate.wait(timeout=60)
            ends.append(call)

        def close(self):
            pass

    hub = publish.Hub(on_step=None, sink=Held(), keep_steps=True)
    call = hub.begin([0], request_id="r", thread=None)

    class Finishing:  # an end_later thread still running when flush(0) waits no time for it (its first question),
        asked = 0  # that ends the call and finishes as flush then asks whether anything is on its way

        def join(self, timeout=None):
            pass

        def is_alive(self):
            self.asked += 1
            if self.asked == 1:
                return True
            if hub._later is self:
                hub._later = None
                hub.end(call, None, "ended", wait=False)
            return False

    hub._later = Finishing()
    try:
        assert not hub.flush(0) and ends == []
    finally:
        gate.set()
    assert hub.flush(60) and ends == [call] and hub.flush(0)
    hub.close()


def test_a_slow_sink_within_its_queue_gets_every_record_by_detach(model, tmp_path):
    ids = _ids(3)
    path = tmp_path / "run.nxl"
    gate = threading.Event()
    file_sink = nxl.Sink(path)

    class Late:  # holds every frame until generate has returned, then writes them all
        def write_call(self, call, meta):
            gate.wait(timeout=60)
            file_sink.write_call(call, meta)

        def write_step(self, step):
            file_sink.write_step(step)

        def write_end(self, call):
            file_sink.write_end(call)

        def close(self):
            file_sink.close()

    with nxl.attach(model, sink=Late()) as probe:
        model.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
        assert path.read_bytes() == b"nxl_hooks.stream/2\n"  # nothing written yet, the call has returned
        gate.set()
        assert probe.flush()
        assert len(nxl.read_stream(path)[0].steps) == 5
    (call,) = nxl.read_stream(path)
    assert call.complete and probe.sink_fault is None and probe.unwritten == 0
    for read, kept in zip(call.steps, probe.steps, strict=True):
        assert torch.equal(read.normxlogit, kept.normxlogit) and torch.equal(read.token, kept.token)
    check_call(model, call, 5)


def test_a_full_stream_file_is_released(model, tmp_path):
    """A stream sink whose disk fills up (its file descriptor pointed at /dev/full after it opened) stops, and
    closes its file descriptor (the folder can be unmounted)."""
    import os

    sink = nxl.Sink(tmp_path / "run.nxl")
    try:
        full = os.open("/dev/full", os.O_WRONLY)
    except OSError:
        pytest.skip("no /dev/full here")
    os.dup2(full, sink._fd)
    os.close(full)
    fd = sink._fd
    with nxl.attach(model, sink=sink) as probe:
        model.generate(input_ids=_ids(4), max_new_tokens=2, do_sample=False)
    assert probe.sink_fault == "OSError: [Errno 28] No space left on device" and probe.unwritten == 2
    assert sink._fd is None
    link = f"/proc/self/fd/{fd}"  # released: that descriptor no longer points at the full disk
    assert not os.path.exists(link) or os.readlink(link) != "/dev/full"
    check_call(model, probe.calls[0], 2)


class _Batching(_Blocking):
    """A blocking sink that also takes several steps at once (``write_steps``, as nxl.Sink does); ``fail``: its
    batch write raises."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail, self.batches = fail, []

    def write_steps(self, steps):
        if self.fail:
            raise OSError(28, "No space left on device")
        self.batches.append([step.step for step in steps])


@pytest.mark.parametrize("fail", [False, True], ids=["written", "raising"])
def test_a_backlog_reaches_the_sink_as_one_batch(model, fail):
    """Records that wait for a busy sink are written together (write_steps) when it comes back, in order; a
    batch that fails counts each of its records as not written."""
    sink = _Batching(fail)
    with nxl.attach(model, sink=sink) as probe:
        model.generate(input_ids=_ids(6), max_new_tokens=6, do_sample=False)
        # generate returned; the publisher may still be moving the last records to the host: wait until all 6
        # step frames (and the call's end) wait for the sink, then give them the sink thread's next wake-up
        deadline = time.monotonic() + 60
        while probe._hub._frames_waiting < 7 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        sink.release.set()  # the sink was blocked in write_call while all 6 step records waited
        probe.flush(timeout=60)
    if fail:
        assert probe.sink_fault == "OSError: [Errno 28] No space left on device" and probe.unwritten == 6
        assert sink.batches == [] and probe.calls[0].notes == [
            f"not written to the sink, which stopped: {probe.sink_fault}"]
    else:
        # the first steps may go with the call frame (what was queued when the sink thread first woke); the rest
        # waited for the blocked sink: one batch, never step by step
        assert sum(sink.batches, []) == [0, 1, 2, 3, 4, 5] and len(sink.batches) <= 2
        assert sink.steps == 0
        assert probe.sink_fault is None and probe.unwritten == 0
    check_call(model, probe.calls[0], 6)


def test_a_call_scored_elsewhere_returns_before_its_last_records_and_its_readers_wait_for_them(model, monkeypatch):
    """Where a call's steps are scored in the publisher (a GPU's), the call returns without waiting for the ones it
    emitted last, while nothing reads them live: scoring them is off its critical path. Whoever reads the records
    (probe.calls, probe.steps, sink_fault...) waits for them, and they are whole; the next call waits for this one's
    (the publisher is never more than one call behind)."""
    from nxl_hooks.hooks import generate

    monkeypatch.setattr(generate, "SCORED_ELSEWHERE", generate.SCORED_ELSEWHERE | {"cpu"})
    record, scoring, release = generate.Run._record, threading.Event(), threading.Event()

    def held(self, emitted, context):  # the publisher holds the first call's last batch until released
        if self.call.index == 0 and emitted[-1].n - self._prompt_len == 5:
            scoring.set()
            assert release.wait(60)
        return record(self, emitted, context)

    monkeypatch.setattr(generate.Run, "_record", held)
    with nxl.attach(model, layers="all") as probe:
        out = model.generate(input_ids=_ids(3), max_new_tokens=6, do_sample=False)  # returns while held
        assert scoring.wait(30) and not release.is_set()
        second = threading.Thread(target=model.generate, kwargs=dict(input_ids=_ids(4), max_new_tokens=2,
                                                                    do_sample=False))
        second.start()
        second.join(1.0)
        assert second.is_alive()  # the second call's end waits for the first call's records
        threading.Timer(0.5, release.set).start()
        calls = probe.calls  # waits for both calls' records
        second.join(30)
    assert release.is_set() and [len(call.steps) for call in calls] == [6, 2]
    assert torch.equal(calls[0].sequences, out)
    check_call(model, calls[0], 6)


def test_a_sinks_optional_parts_are_typed_protocols_of_their_own(tmp_path):
    """``write_steps``, ``fault`` and ``lost`` are runtime-checkable protocols a sink follows, not attribute names
    the pipeline looks up."""
    from nxl_hooks.records.sinks import BatchingSink, FaultingSink, LosingSink

    plain = _Raising(OSError())
    assert isinstance(_Batching(), BatchingSink) and isinstance(_QuietlyStopped(OSError()), FaultingSink)
    assert isinstance(_SlowClose(fails=True), LosingSink)
    assert not any(isinstance(plain, protocol) for protocol in (BatchingSink, FaultingSink, LosingSink))
    stream = nxl.Sink(tmp_path / "a.nxl")
    assert isinstance(stream, BatchingSink)
    stream.close()


def test_records_a_detach_leaves_to_a_call_in_another_thread_say_why_they_are_unwritten(model, tmp_path, monkeypatch):
    """A probe detached while a call runs in another thread: the steps that call made while attached and had not
    handed on yet (scored together, at its end) reach memory only. They were counted in probe.unwritten with
    sink_fault None and no note on the call, so `nxl run` status showed a count with no reason; now sink_fault and
    the call's notes say the detach closed the sink. The records kept are the oracle's."""
    from nxl_hooks.hooks import generate
    from oracle import check_steps

    monkeypatch.setattr(generate, "BATCH_SECONDS", None)  # the steps wait for the call's end, however slow a token
    started, go = threading.Event(), threading.Event()

    class Gate:  # holds generate after its third token until the probe has detached
        def __call__(self, input_ids, scores, **kwargs):
            if input_ids.shape[1] == 8:
                started.set()
                assert go.wait(60)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    path = tmp_path / "run.nxl"
    probe = nxl.attach(model, sink=str(path))
    thread = threading.Thread(target=model.generate, kwargs=dict(
        input_ids=_ids(5), max_new_tokens=10, do_sample=False, stopping_criteria=[Gate()]))
    thread.start()
    assert started.wait(60)
    probe.detach()
    go.set()
    thread.join(60)
    (streamed,) = nxl.read_stream(path)
    (call,) = probe.calls
    assert streamed.steps == [] and streamed.error == call.error == publish.DETACHED
    assert probe.unwritten == len(call.steps) > 0
    assert probe.sink_fault == publish.CLOSED_AT_DETACH
    assert call.notes == [f"not written to the sink, which stopped: {publish.CLOSED_AT_DETACH}"]
    check_steps(model, call)
