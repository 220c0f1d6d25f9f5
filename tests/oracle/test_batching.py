"""Continuous batching (``generate_batch``, a ContinuousBatchingManager as ``transformers serve`` uses it): every
request gets its own call, each step equal to an uncached oracle of that request alone; the requests run unchanged."""

import logging
import sys
import threading
import time

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import GenerationConfig
from transformers.generation.continuous_batching import continuous_api, input_outputs
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor
from transformers.generation.continuous_batching.requests import RequestState

import nxl_hooks as nxl
import tiny
from nxl_hooks.hooks.generate import BATCH_STEPS, Run
from oracle import check_call

NEW = 5


_config = tiny.cb_config


def _greedy(new: int = NEW) -> GenerationConfig:
    return GenerationConfig(do_sample=False, max_new_tokens=new, eos_token_id=-1, pad_token_id=0)


@pytest.fixture(scope="module")
def model():
    return tiny.build_model("llama")


def _prompts(lengths, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(5, len(tiny.VOCAB), (n,), generator=generator).tolist() for n in lengths]


class _Layout:
    """Test-side tap: (position_ids, cu_seq_lens_q, logits_indices) of every packed forward, to prove which
    scenarios a test ran through."""

    def __init__(self, model) -> None:
        self.forwards: list[tuple[list[int], list[int], list[int]]] = []
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs) -> None:
        if "cu_seq_lens_q" in kwargs:
            self.forwards.append((kwargs["position_ids"][0].tolist(), kwargs["cu_seq_lens_q"].tolist(),
                                  kwargs["logits_indices"].tolist()))

    def remove(self) -> None:
        self._handle.remove()

    def segments(self) -> list[list[tuple[int, int, bool]]]:
        """Per forward: (first position, length, yields a token) of each request's slice."""
        out = []
        for positions, cumulative, logits in self.forwards:
            out.append([(positions[a], b - a, b - 1 in logits) for a, b in zip(cumulative, cumulative[1:])])
        return out


def _drain(subscription, timeout: float = 60) -> list:
    got: list = []
    reader = threading.Thread(target=lambda: got.extend(subscription))
    reader.start()
    reader.join(timeout)
    assert not reader.is_alive(), "the stream did not end"
    return got


def _wrapped() -> bool:
    return any(hasattr(method, "__nxl_hook__") for method in (ContinuousBatchProcessor._generation_step,
                                                                RequestState.update_and_check_completion))


def _tokens(outputs: dict) -> dict:
    return {key: (list(out.prompt_ids), list(out.generated_tokens)) for key, out in outputs.items()}


def test_generate_batch_gives_each_request_its_oracle(model):
    prompts = _prompts((5, 23, 9, 3, 17))
    plain = model.generate_batch(prompts, generation_config=_greedy(), continuous_batching_config=_config())
    layout = _Layout(model)
    try:
        with nxl.attach(model, layers="all") as probe:
            assert _wrapped()  # transformers' classes are wrapped while a probe is attached, and only then
            out = model.generate_batch(prompts, generation_config=_greedy(), continuous_batching_config=_config())
            assert probe._hub._running == []  # every request's call ended with its request
    finally:
        layout.remove()
    assert not _wrapped()
    assert _tokens(out) == _tokens(plain)
    calls = {call.request_id: call for call in probe.calls}
    assert sorted(calls) == sorted(out) == [f"req_{i}" for i in range(5)]
    for request_id, call in calls.items():
        assert call.thread.endswith("(_run_generation_loop)") and call.error is None
        assert call.prompt_ids.tolist() == [out[request_id].prompt_ids]
        check_call(model, call, NEW)
        assert [int(s.token) for s in call.steps] == out[request_id].generated_tokens
    forwards = layout.segments()
    # the scenarios this test claims: prefill and decode in one forward, and a prompt prefilled in chunks
    assert any({length == 1 for _, length, _ in f} == {True, False} for f in forwards)
    assert any(length > 1 and not new for f in forwards for _, length, new in f)


def test_a_method_wrapped_again_while_attached_leaves_the_next_probe_whole(model, monkeypatch):
    """A profiler wraps ContinuousBatchProcessor._generation_step over the probe's wrapper while attached: that
    wrapper stays at detach (taking it out would drop the profiler's), and follows nothing more; the next probe's
    requests are each equal to their oracle (the left wrapper once opened every step a second time, and left every
    request of the next probe unrecorded)."""
    prompts = _prompts((5, 23, 9))
    plain = model.generate_batch(prompts, generation_config=_greedy(), continuous_batching_config=_config())
    steps = []
    # the class's own method back when the test ends (its undo runs last), not the wrapper the profiler wrapped
    monkeypatch.setattr(ContinuousBatchProcessor, "_generation_step", ContinuousBatchProcessor._generation_step)
    with nxl.attach(model, layers="all"):
        inner = ContinuousBatchProcessor._generation_step

        def profiled(self, *args, **kwargs):
            steps.append(1)
            return inner(self, *args, **kwargs)

        monkeypatch.setattr(ContinuousBatchProcessor, "_generation_step", profiled)
    for _ in range(2):  # the next probe, and the one after it (over its own left wrapper too)
        with nxl.attach(model, layers="all") as probe:
            out = model.generate_batch(prompts, generation_config=_greedy(), continuous_batching_config=_config())
        assert _tokens(out) == _tokens(plain) and len(probe.calls) == len(prompts) and steps
        for call in probe.calls:
            check_call(model, call, NEW)
            assert [int(s.token) for s in call.steps] == out[call.request_id].generated_tokens


@pytest.mark.parametrize("scored", ["manager", "publisher"])
def test_requests_run_again_from_the_start_under_cache_pressure_are_recorded_whole(model, scored, monkeypatch):
    """With too few cache blocks for every request, the manager drops a running request's cache and runs it again
    from position 0, its generated tokens now part of its prompt (a soft reset): the request's record is fed from
    position 0 again, those tokens' ids included, and each of its steps still equals its oracle. Also with the steps
    scored in the publisher thread (as on a GPU), while the manager goes on feeding the runs; what waits when a run is
    rewritten is scored at once, in the manager's thread (scored later, it would keep the buffer the rewrite goes
    over)."""
    from nxl_hooks.hooks import generate

    threads = set()
    if scored == "publisher":
        monkeypatch.setattr(generate, "SCORED_ELSEWHERE", generate.SCORED_ELSEWHERE | {"cpu"})
    record = generate.Run._record
    monkeypatch.setattr(generate.Run, "_record", lambda self, *args: threads.add(threading.current_thread().name)
                        or record(self, *args))
    prompts, new = _prompts((10, 10, 10, 10), seed=3), 30
    plain = model.generate_batch(prompts, generation_config=_greedy(new),
                                 continuous_batching_config=_config(num_blocks=3))
    layout = _Layout(model)
    try:
        with nxl.attach(model, layers="all") as probe:
            out = model.generate_batch(prompts, generation_config=_greedy(new),
                                       continuous_batching_config=_config(num_blocks=3))
    finally:
        layout.remove()
    assert _tokens(out) == _tokens(plain)
    # the scenario: more slices start at position 0 than there are requests (some ran again from the start)
    assert sum(first == 0 for forward in layout.segments() for first, _, _ in forward) > len(prompts)
    calls = {call.request_id: call for call in probe.calls}
    assert sorted(calls) == sorted(out)
    for request_id, call in calls.items():
        assert call.error is None, call.error
        check_call(model, call, new)
        assert [int(s.token) for s in call.steps] == out[request_id].generated_tokens
    manager = {name for name in threads if name.endswith("(_run_generation_loop)")}
    assert len(manager) == 1
    # in the publisher, but what waits when a run is rewritten from position 0: scored at once, in the manager's
    assert threads == ({"nxl_hooks-publisher", *manager} if scored == "publisher" else manager)


def _a_thread_waits_in(function: str, file: str, timeout: float = 60) -> bool:
    """Whether a thread is seen waiting (in ``threading``'s ``wait``) inside ``function`` of ``file`` (every thread's
    stack, polled) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for frame in sys._current_frames().values():
            if frame.f_code.co_name != "wait" or not frame.f_code.co_filename.endswith("threading.py"):
                continue
            while frame is not None:
                if frame.f_code.co_name == function and frame.f_code.co_filename.endswith(file):
                    return True
                frame = frame.f_back
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("ends_wait", [False, True], ids=["default", "ENGINE_ENDS_WAIT"])
def test_requests_end_without_the_manager_waiting_for_the_publisher(model, ends_wait, monkeypatch):
    """With the steps scored in the publisher thread (as on a GPU) and the publisher held on the last batch of the
    request that ends first, the manager still ends every request and returns: a request's end does not make the
    loop that runs every request's steps wait for the records of the request that ended before it (a ``generate``
    call's end does; so does a request's under ENGINE_ENDS_WAIT, the switch bench_batching.py compares). Once the
    publisher goes on, every request's records are whole."""
    from nxl_hooks.hooks import generate

    monkeypatch.setattr(generate, "SCORED_ELSEWHERE", generate.SCORED_ELSEWHERE | {"cpu"})
    monkeypatch.setattr(generate, "ENGINE_ENDS_WAIT", ends_wait)
    record, scoring, release = generate.Run._record, threading.Event(), threading.Event()

    def held(self, emitted, context):
        if emitted[-1].n == self._prompt_len + NEW - 1 and not scoring.is_set():
            scoring.set()
            assert release.wait(60)
        return record(self, emitted, context)

    monkeypatch.setattr(generate.Run, "_record", held)
    prompts, out = _prompts((5, 9, 3)), {}
    with nxl.attach(model, layers="all") as probe:
        manager = threading.Thread(target=lambda: out.update(model.generate_batch(
            prompts, generation_config=_greedy(), continuous_batching_config=_config())))
        manager.start()
        try:
            assert scoring.wait(60)
            if ends_wait:  # the manager's loop comes to wait in a request's end, for the held records
                assert _a_thread_waits_in("end", "publish.py"), "no thread waited in Hub.end"
            else:  # every request ended while the publisher held the first one's records
                manager.join(60)
                assert not manager.is_alive() and not release.is_set()
        finally:
            release.set()
            manager.join(30)
        calls = {call.request_id: call for call in probe.calls}  # waits for their records
    assert sorted(calls) == sorted(out) == ["req_0", "req_1", "req_2"]
    for request_id, call in calls.items():
        assert call.error is None and call.complete, call.error
        check_call(model, call, NEW)
        assert [int(s.token) for s in call.steps] == out[request_id].generated_tokens


def test_decoding_positions_nobody_scores_wait_at_most_batch_steps(model, monkeypatch):
    """keep_steps=False and nothing else listening: no step is scored, yet a request's decoding positions, which wait
    as views of their step's gathered rows (keeping every request's rows of that step alive), go into its feature
    cache every BATCH_STEPS positions instead of piling up for the request's whole life."""
    waiting, feed = [], Run.feed

    def counted(self, *args, **kwargs):
        feed(self, *args, **kwargs)
        waiting.append(len(self._unfed))

    monkeypatch.setattr(Run, "feed", counted)
    with nxl.attach(model, layers="all", keep_steps=False) as probe:
        model.generate_batch(_prompts((5, 7)), generation_config=_greedy(2 * BATCH_STEPS + 5),
                             continuous_batching_config=_config())
    assert [call.complete for call in probe.calls] == [True, True]
    assert max(waiting) == BATCH_STEPS  # they did wait, up to the bound


def test_manager_with_custom_ids_sampling_stream_and_sink(model, tmp_path):
    requests = {"client-a": (_prompts((7,), 2)[0], 3), "client-b": (_prompts((19,), 3)[0], 6),
                "client-c": (_prompts((4,), 4)[0], 4)}
    sampling = GenerationConfig(do_sample=True, temperature=3.0, top_k=0, max_new_tokens=8, eos_token_id=-1,
                                pad_token_id=0)
    path = tmp_path / "cb.nxl"
    torch.manual_seed(0)
    with nxl.attach(model, layers=[0, -1], sink=path) as probe:
        manager = model.init_continuous_batching(generation_config=sampling, continuous_batching_config=_config())
        manager.start()
        try:
            stream = probe.subscribe(request_id="client-b")
            following = probe.subscribe(request_id="client-c", follow=True)
            for request_id, (prompt, new) in requests.items():
                manager.add_request(prompt, request_id=request_id, max_new_tokens=new)
            results, deadline = {}, time.monotonic() + 60
            while len(results) < len(requests) and time.monotonic() < deadline:
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
            streamed = _drain(stream)
            late = _drain(probe.subscribe(request_id="client-a"))  # it ended already: its kept steps, then the end
            following.close()  # a follow stream runs until its reader closes it
            followed = _drain(following)
        finally:
            manager.stop(block=True, timeout=30)
    assert sorted(results) == sorted(requests)
    calls = {call.request_id: call for call in probe.calls}
    argmax_differs = False
    for request_id, (prompt, new) in requests.items():
        call = calls[request_id]
        assert [int(s.token) for s in call.steps] == results[request_id].generated_tokens
        assert call.layers == [0, 2]
        hand_argmax = check_call(model, call, new)
        argmax_differs |= any(int(a) != int(s.token) for a, s in zip(hand_argmax, call.steps))
        assert call.steps[0].normxlogit.shape == (2, 1, len(prompt))
    assert argmax_differs, "sampling at temperature 3 should leave the argmax at least once"
    assert streamed == calls["client-b"].steps and followed == calls["client-c"].steps
    assert late == calls["client-a"].steps
    (read,) = nxl.read_stream(path, request_id="client-b")
    assert read.complete and torch.equal(read.sequences, calls["client-b"].sequences)
    for disk, memory in zip(read.steps, calls["client-b"].steps, strict=True):
        assert torch.equal(disk.normxlogit, memory.normxlogit) and torch.equal(disk.token, memory.token)


def _shared_prefix_prompts() -> list[list[int]]:
    shared = _prompts((37,), 5)[0]  # two full 16-token pages, shareable between requests
    return [shared + [5, 6], shared + [7], shared + [8, 9, 10]]


def _check_whole(model, probe, prompts: dict[str, list[int]], new: int = 3) -> None:
    """Every request's call is complete, holds its own prompt ids and equals its uncached oracle."""
    calls = {call.request_id: call for call in probe.calls}
    assert set(calls) == set(prompts)
    for request_id, prompt in prompts.items():
        assert calls[request_id].prompt_ids.tolist() == [prompt]
        check_call(model, calls[request_id], new)


def test_requests_that_reuse_a_running_requests_prefix_are_recorded_whole(model):
    """Prefix sharing stays on while attached: requests whose caches reuse another's prompt blocks start
    mid-sequence exactly as they do unattached, and their records take the prefix's rows from the request that ran
    it, which is still running: every step equals the uncached oracle of that request alone."""
    prompts, config = _shared_prefix_prompts(), dict(max_batch_tokens=40)
    layout = _Layout(model)
    try:
        plain = model.generate_batch(prompts, generation_config=_greedy(3), continuous_batching_config=_config(**config))
        plain_layout = layout.segments()
        layout.forwards.clear()
        with nxl.attach(model) as probe:
            out = model.generate_batch(prompts, generation_config=_greedy(3),
                                       continuous_batching_config=_config(**config))
        attached_layout = layout.segments()
    finally:
        layout.remove()
    shared_starts = [s for f in attached_layout for s in f if s[0] > 0 and s[1] > 1]
    assert shared_starts, "some request should reuse the shared prefix and start mid-sequence"
    assert attached_layout == plain_layout  # the same forwards as unattached: nothing re-runs the prefix
    assert _tokens(out) == _tokens(plain)
    _check_whole(model, probe, {request_id: list(result.prompt_ids) for request_id, result in out.items()})


def _serve(manager, request_id: str, prompt: list[int], new: int = 3):
    manager.add_request(prompt, request_id=request_id, max_new_tokens=new)
    return _finished(manager, request_id)


def _finished(manager, request_id: str):
    """The tokens ``request_id`` generated, once it finished (within a minute)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        result = manager.get_result(request_id=request_id, timeout=1)
        if result is not None and result.is_finished():
            return result.generated_tokens
    raise AssertionError(f"{request_id} did not finish")


def test_attach_to_a_running_manager_whose_cache_shares_a_prefix(model, caplog):
    first, second = _shared_prefix_prompts()[:2]

    def run(attached: bool):
        manager = model.init_continuous_batching(generation_config=_greedy(3),
                                                 continuous_batching_config=_config(max_batch_tokens=40))
        manager.start()
        try:
            tokens = [_serve(manager, "first", first)]
            cache = manager.batch_processor.cache
            if not attached:
                return tokens + [_serve(manager, "second", second)], None
            with nxl.attach(model) as probe:
                tokens.append(_serve(manager, "second", second))
            assert cache.use_prefix_sharing is True  # attaching leaves the cache as it is
            return tokens, probe
        finally:
            manager.stop(block=True, timeout=30)

    plain, _ = run(attached=False)
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"):
        tokens, probe = run(attached=True)
    assert tokens == plain
    (call,) = probe.calls  # the second request reused the first one's cached prefix before the probe saw the cache
    assert call.request_id == "second" and not call.complete and "another request" in call.error
    assert "let go" not in call.error  # nothing was: what it says is what may have happened
    assert [r.levelno for r in caplog.records if r.name == "nxl_hooks"] == [logging.WARNING]


@pytest.mark.parametrize("kept", [True, False], ids=["kept", "let-go"])
def test_a_request_that_reuses_a_finished_requests_prefix(model, kept, monkeypatch, caplog):
    """One request after another on a running manager: the second reuses the first's cached prefix after the first
    finished, so its rows come from what the probe kept of the finished request; every step equals the oracle.
    With nothing kept (no room for it), the second request is said not recorded, with why and what to do."""
    from nxl_hooks.hooks.engines import prefixes

    if not kept:
        monkeypatch.setattr(prefixes, "SHARED_BYTES", 0)
    first, second = _shared_prefix_prompts()[:2]
    layout = _Layout(model)
    with nxl.attach(model) as probe:
        manager = model.init_continuous_batching(generation_config=_greedy(3),
                                                 continuous_batching_config=_config(max_batch_tokens=40))
        manager.start()
        try:
            _serve(manager, "first", first)
            layout.forwards.clear()
            _serve(manager, "second", second)
        finally:
            manager.stop(block=True, timeout=30)
            layout.remove()
    assert layout.segments()[0][0][0] == 32, "the second request should start after the first's two shared pages"
    if kept:
        _check_whole(model, probe, {"first": first, "second": second})
    else:
        calls = {call.request_id: call for call in probe.calls}
        check_call(model, calls["first"], 3)
        assert not calls["second"].complete and "does not hold" in calls["second"].error
        assert "let go to stay within nxl_hooks.hooks.engines.prefixes.SHARED_BYTES" in calls["second"].error
        assert "allow_block_sharing=False" in calls["second"].error


def _at_forward(model, at: int, action):
    """A hook that calls ``action()`` as the ``at``-th packed forward of ``model`` from now starts, and the event it
    sets then."""
    forwards, reached = [], threading.Event()

    def hook(module, args, kwargs):
        if "cu_seq_lens_q" in kwargs:
            forwards.append(1)
            if len(forwards) == at:
                reached.set()
                action()

    return model.register_forward_pre_hook(hook, with_kwargs=True), reached


def _gone(manager, request_id: str) -> None:
    """Wait until ``manager``'s scheduler holds ``request_id`` no more (a cancel is taken in its loop)."""
    scheduler, deadline = manager.batch_processor.scheduler, time.monotonic() + 60
    while request_id in scheduler.active_requests or request_id in scheduler.waiting_requests:
        assert time.monotonic() < deadline, f"{request_id} was never cancelled"
        time.sleep(0.01)


@pytest.mark.parametrize("then", ["another request", "its id again", "nothing"])
def test_cancelled_request_ends_incomplete_and_frees_its_features(model, then):
    """The next forward finds it gone. Or the manager idles after the cancel (no step opens to find it gone) and a
    client sends the same id again (a retry with its X-Request-ID): two calls then, the retry its own and equal to
    the oracle (it was fed into the cancelled request's call, which then said it completed). Or nothing comes after
    it: it ends as the manager idles (it stayed running, unended and holding its features, until a next request)."""
    prompt, again = _prompts((6,), 6)[0], _prompts((11,), 7)[0]
    with nxl.attach(model) as probe:
        manager = model.init_continuous_batching(generation_config=_greedy(500), continuous_batching_config=_config())
        manager.start()
        try:
            stream = probe.subscribe(request_id="long")
            manager.add_request(prompt, request_id="long", max_new_tokens=500)
            for _ in zip(range(3), stream):  # three steps of it are recorded: it is running
                pass
            manager.cancel_request("long")
            if then == "another request":
                _serve(manager, "next", _prompts((4,), 7)[0])
            elif then == "nothing":
                deadline = time.monotonic() + 30
                while probe._hub._running and time.monotonic() < deadline:
                    time.sleep(0.01)
            else:
                _gone(manager, "long")
                _serve(manager, "long", again, new=4)
            long = next(c for c in probe.calls if c.request_id == "long")
            assert not long.complete and "left the manager" in long.error and len(long.steps) >= 3
            assert long.prompt_ids[0].tolist() == prompt and probe._hub._running == []
            (batching,) = [ref() for ref in probe._attachment._engines]
            assert all(not table for table in batching._tables.values())  # no feature cache left behind
        finally:
            manager.stop(block=True, timeout=30)
    if then == "its id again":
        retry = [c for c in probe.calls if c.request_id == "long"][1]
        assert retry.prompt_ids[0].tolist() == again
        check_call(model, retry, 4)


def test_a_request_whose_manager_fails_ends_at_once_saying_why_and_reaches_the_sink(model, tmp_path):
    """A prompt larger than the paged cache fails the manager's loop (transformers' own error, probe or not: no
    step runs after it). The request's call ends then, incomplete, with the manager's error, and is written: it
    stayed running for ever (no later step found it gone), in no file, and was counted as recorded."""
    prompt = _prompts((300,), 9)[0]  # 16 pages of 16 positions hold 256
    with nxl.attach(model, sink=tmp_path / "run.nxl") as probe:
        manager = model.init_continuous_batching(generation_config=_greedy(), continuous_batching_config=_config())
        manager.start()
        try:
            manager.add_request(prompt, request_id="big", max_new_tokens=3)
            deadline = time.monotonic() + 60
            while not [c for c in probe.calls if c.ended is not None] and time.monotonic() < deadline:
                time.sleep(0.05)
            (call,) = probe.calls
            assert call.ended is not None and probe._hub._running == [], "the request never ended"
            assert not manager.is_running()  # its loop failed: the scenario this test is about
            probe.flush()
        finally:
            manager.stop(block=True, timeout=30)
    assert not call.complete and "left the manager before it finished (its manager stopped: " in call.error
    (read,) = nxl.read_stream(tmp_path / "run.nxl", strict=True)
    assert (read.request_id, read.error, read.complete) == ("big", call.error, False)


def test_a_request_still_queued_when_its_manager_fails_is_said_not_recorded():
    """Two pages: the first request's prefill takes them, the manager can neither schedule nor offload, and fails
    both. The one that started said why it ended; the one still queued had no record at all (no step of it ran)."""
    model = tiny.generating_llama()
    config = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=tiny.GEN_PAD)
    with nxl.attach(model) as probe:
        out = model.generate_batch([list(range(1, 41)), [1, 2, 3, 4, 5]], generation_config=config,
                                   continuous_batching_config=tiny.cb_config(num_blocks=2))
        probe.flush()
    assert all(result.error for result in out.values())  # transformers failed both: the scenario of this test
    calls = {call.request_id: call for call in probe.calls}
    assert sorted(calls) == sorted(out)
    started, queued = (calls[r] for r in sorted(out))
    assert "left the manager before it finished (its manager stopped: " in started.error
    assert queued.steps == [] and not queued.complete
    assert queued.error.startswith("not recorded: the request was still queued when its manager stopped (")


# transformers 5.18's manager, stopped and started again with its cache kept, fails its first forward (its own
# error, probe or not: "The size of tensor a (11) must match the size of tensor b (43)"); 5.24 runs it
_RESTART = pytest.mark.skipif(Version(transformers.__version__) < Version("5.24"),
                              reason="this transformers fails the first forward after a restart that keeps the cache")


@pytest.mark.parametrize("left, at, retry", [("cancelled", 1, "B"), ("cancelled", 4, "B"), ("cancelled", 4, "A"),
                                               pytest.param("stopped", 4, "B", marks=_RESTART),
                                               pytest.param("failed", 4, "B", marks=_RESTART)],
                         ids=["cancelled in its chunked prefill", "cancelled decoding", "cancelled, sent again",
                              "its manager stopped", "its forward raised"])
def test_a_request_that_reuses_the_prefix_of_one_that_left_unfinished(model, left, at, retry):
    """A request that leaves its manager unfinished (cancelled: its client went away; or failed, when its manager is
    stopped or its forward raises, and the manager is started again) leaves its cached pages to the requests that
    reuse them, as one that finished does: a later request with the same first pages (another, or the client sending
    it again under its id) starts after them, and its rows come from what the probe kept of the one that left; every
    step equals the oracle (it was said not recorded, its prefix blamed on the probe attaching late or on
    SHARED_BYTES). One that left in its chunked prefill, a page and a half in, leaves one whole page: the later
    request takes no more of its rows than that, and runs the rest itself."""
    prefix = _prompts((40,), 8)[0]
    prompts = {"A": prefix + [7, 8], "B": prefix + [9, 10, 11]}

    def leave(manager):  # as the manager's forward `at` starts (a stop is the caller's, once it has)
        if left == "cancelled":
            manager.cancel_request("A")
        elif left == "failed":
            raise RuntimeError("a forward that fails")

    def run(attached: bool):
        manager = model.init_continuous_batching(generation_config=_greedy(500), continuous_batching_config=_config())
        (handle, reached), layout = _at_forward(model, at, lambda: leave(manager)), _Layout(model)
        probe = nxl.attach(model) if attached else None
        manager.start()
        try:
            manager.add_request(prompts["A"], request_id="A", max_new_tokens=500)
            assert reached.wait(60)
            if left == "cancelled":
                _gone(manager, "A")
            else:  # kept for its next session (a failed loop has stopped already): its cache keeps its pages
                manager.stop(block=True, timeout=30, keep_for_next_session=True, hard_stop=True)
                manager.start()
            layout.forwards.clear()
            tokens = _serve(manager, retry, prompts[retry], new=4)
        finally:
            manager.stop(block=True, timeout=30)
            model.destroy_cached_continuous_batching_manager()
            handle.remove()
            layout.remove()
            if probe is not None:
                probe.detach()
        return tokens, layout.segments()[0][0][0], probe

    plain, plain_start = run(attached=False)[:2]
    tokens, start, probe = run(attached=True)
    assert tokens == plain and start == plain_start  # the same forwards as unattached: nothing re-runs the prefix
    assert start == (16 if at == 1 else 32), "the later request should start after the first one's pages"
    first, later = probe.calls
    assert first.request_id == "A" and not first.complete
    assert ("forward raised" if left == "failed" else "left the manager") in first.error  # the way it went
    assert later.request_id == retry and later.prompt_ids[0].tolist() == prompts[retry]
    check_call(model, later, 4)


def test_a_cancelled_requests_id_sent_again_beside_a_request_that_shares_the_new_prompts_prefix(model):
    """A request cancelled while its manager idles, then its id sent again with another prompt, in one batch with a
    request whose cache reuses that prompt's first pages (which a finished request left): the cancelled request's run,
    under that id until the batch opens, ends before the other request looks for its prefix (that request was given
    the cancelled prompt's rows as the new prompt's, its records silently wrong). Every step equals the oracle."""
    shared, cancelled = _prompts((40, 42), 9)
    prompts = {"C": shared + [5, 6], "B": shared + [9, 10], "A": shared + [7, 8]}

    def run(attached: bool):
        manager = model.init_continuous_batching(generation_config=_greedy(500), continuous_batching_config=_config())
        probe = nxl.attach(model) if attached else None
        manager.start()
        try:
            tokens = {"C": _serve(manager, "C", prompts["C"])}
            handle, decoding = _at_forward(model, 4, lambda: manager.cancel_request("A"))
            try:
                manager.add_request(cancelled, request_id="A", max_new_tokens=500)
                assert decoding.wait(60)
                _gone(manager, "A")
            finally:
                handle.remove()
            layout = _Layout(model)
            try:
                with manager.pause():  # the two land in one batch, B first
                    for request_id in "BA":
                        manager.add_request(prompts[request_id], request_id=request_id, max_new_tokens=3)
                tokens.update({request_id: _finished(manager, request_id) for request_id in "BA"})
            finally:
                layout.remove()
        finally:
            manager.stop(block=True, timeout=30)
            if probe is not None:
                probe.detach()
        return tokens, layout.segments()[0], probe

    plain, plain_batch = run(attached=False)[:2]
    tokens, batch, probe = run(attached=True)
    assert tokens == plain and batch == plain_batch == [(32, 10, True), (32, 10, True)]  # both after C's pages
    calls = [call for call in probe.calls if call.complete]
    assert [call.request_id for call in calls] == ["C", "B", "A"]
    for call in calls:
        assert call.prompt_ids[0].tolist() == prompts[call.request_id]
        check_call(model, call, 3)


@pytest.mark.parametrize("blocks", [4, 6])
def test_num_return_sequences_children_that_wait_for_room_are_recorded(model, blocks):
    """A cache too small for every child of a sampled request: a child that could not be forked is queued whole
    (transformers marks it like a soft reset, with nothing generated), and one forked after its parent finished
    reuses the parent's first positions without prefix sharing. Both are recorded, equal to the oracle (they were
    said not recorded, with reasons that did not hold)."""
    prompts = _prompts((40,), 4)
    config = GenerationConfig(do_sample=True, temperature=2.0, top_k=0, max_new_tokens=4, eos_token_id=-1,
                              pad_token_id=0, num_return_sequences=3)
    cb = dict(num_blocks=blocks, max_batch_tokens=48, allow_block_sharing=False)
    torch.manual_seed(0)
    plain = model.generate_batch(prompts, generation_config=config, continuous_batching_config=_config(**cb))
    torch.manual_seed(0)
    with nxl.attach(model) as probe:
        out = model.generate_batch(prompts, generation_config=config, continuous_batching_config=_config(**cb))
    assert _tokens(out) == _tokens(plain) and len(out) == 3
    calls = {call.request_id: call for call in probe.calls}
    assert sorted(calls) == sorted(out)
    for request_id, call in calls.items():
        assert call.error is None, call.error
        check_call(model, call, 4)


@pytest.mark.parametrize("prompts, cb, children", [((5, 23, 9), {}, 1), ((3, 2, 5, 2), {"max_batch_tokens": 5}, 2)],
                         ids=["chunked prompts", "one-token slices, some yielding no token"])
def test_every_step_has_the_probability_of_the_unbatched_oracle(model, prompts, cb, children):
    """The model's own probability of each token, read at the row the manager sampled it from: with
    ``logits_to_keep`` one row per request that samples, whatever the shapes say (a step whose every slice is one
    token long, some yielding none, was read as one row per packed token)."""
    if children > 1:  # (a layout this model's tokens give: its requests finish and fork as that needs)
        model, generator = tiny.generating_llama(), torch.Generator().manual_seed(17)
        prompts = [torch.randint(1, tiny.GEN_VOCAB, (n,), generator=generator).tolist() for n in prompts]
    else:
        prompts = _prompts(prompts)
    config = (_greedy() if children == 1 else GenerationConfig(
        do_sample=True, top_k=1, max_new_tokens=NEW, eos_token_id=-1, pad_token_id=0, num_return_sequences=children))
    with nxl.attach(model, layers="last") as probe:
        out = model.generate_batch(prompts, generation_config=config, continuous_batching_config=_config(**cb))
    calls = {call.request_id: call for call in probe.calls}
    assert sorted(calls) == sorted(out)
    for request_id, call in calls.items():
        assert call.error is None, call.error
        sequence = call.sequences
        for step in call.steps:
            with torch.no_grad():  # the model alone, uncached and unbatched, on the prefix before this token
                logits = model(input_ids=sequence[:, : step.position]).logits[:, -1].float()
            expected = logits.softmax(-1)[0, int(step.token)]
            assert step.probability is not None and step.probability.shape == (1,)
            torch.testing.assert_close(step.probability[0], expected, rtol=1e-4, atol=1e-6)
        if children > 1:
            continue
        # and the same as generate's own record of that request alone (greedy: the same tokens)
        with nxl.attach(model, layers="last") as alone:
            model.generate(input_ids=sequence[:, : len(out[request_id].prompt_ids)], max_new_tokens=NEW,
                           do_sample=False, eos_token_id=-1, pad_token_id=0)
        generated = torch.stack([s.probability for s in alone.steps])
        torch.testing.assert_close(torch.stack([s.probability for s in call.steps]), generated, rtol=1e-4, atol=1e-6)


def test_a_request_in_its_chunked_prefill_when_the_probe_attaches_says_so(model):
    """Its first chunks ran unseen: not recorded, saying that, the same text as ``probe.unrecorded`` (it blamed
    prefix sharing alone, and the call's error lacked the ``not recorded:`` its docs give it); a request added
    after attaching is recorded."""
    long = _prompts((200,), 41)[0]
    third, attached, forwards = threading.Event(), threading.Event(), []

    def hold(module, args, kwargs):  # the manager's third packed forward waits until the probe is on
        if "cu_seq_lens_q" in kwargs:
            forwards.append(1)
            if len(forwards) == 3:
                third.set()
                attached.wait(60)

    handle = model.register_forward_pre_hook(hold, with_kwargs=True)
    manager = model.init_continuous_batching(generation_config=_greedy(4),
                                             continuous_batching_config=_config(max_batch_tokens=24))
    manager.start()
    try:
        manager.add_request(long, request_id="long", max_new_tokens=4)
        assert third.wait(60)
        with nxl.attach(model) as probe:
            attached.set()
            _finished(manager, "long")
            _serve(manager, "later", _prompts((7,), 3)[0], new=4)
    finally:
        attached.set()
        manager.stop(block=True, timeout=30)
        handle.remove()
    calls = {call.request_id: call for call in probe.calls}
    assert calls["long"].error.startswith("not recorded: its first ") and "ran before the probe attached" in \
        calls["long"].error
    assert calls["long"].error == probe.unrecorded and not calls["long"].steps
    check_call(model, calls["later"], 4)


@pytest.mark.parametrize("path", ["moved_internal", "async_batching"])
def test_paths_that_cannot_be_followed_log_once_and_run_unchanged(model, path, monkeypatch, caplog):
    prompts = _prompts((5, 18, 9))
    if path == "moved_internal":
        # a transformers whose processor's step moved elsewhere: the class transformers uses has no _generation_step
        # of its own (it runs the inherited one), so nothing is wrapped and the reason names what is missing
        moved = type("ContinuousBatchProcessor", (continuous_api.ContinuousBatchProcessor,), {})
        monkeypatch.setattr(continuous_api, "ContinuousBatchProcessor", moved)
    else:  # asynchronous batching (CUDA or XPU only) keeps a pair of IOs, forced on the CPU's synchronous IOs
        monkeypatch.setattr(input_outputs.ContinuousBatchingIOs, "io_pairs", (), raising=False)
    plain = model.generate_batch(prompts, generation_config=_greedy(4), continuous_batching_config=_config())
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"), nxl.attach(model) as probe:
        out = model.generate_batch(prompts, generation_config=_greedy(4), continuous_batching_config=_config())
        model(input_ids=torch.tensor([prompts[0]]))  # a plain forward is still recorded
        assert probe.result().normxlogit.shape == (3, 1, 5)
    assert _tokens(out) == _tokens(plain)
    (record,) = [r for r in caplog.records if r.name == "nxl_hooks"]
    assert ("ContinuousBatchProcessor._generation_step" if path == "moved_internal" else "asynchronously"
            ) in record.getMessage()
    if path == "moved_internal":  # transformers' classes are not even wrapped: no request is seen
        assert probe.calls == [] and "has no ContinuousBatchProcessor._generation_step" in probe.unrecorded
    else:  # never silent: each request's call record says why, and what makes it recordable
        assert sorted(c.request_id for c in probe.calls) == sorted(out)
        for call in probe.calls:
            assert call.steps == [] and call.error.startswith("not recorded: ") and "asynchronously" in call.error
            assert "use_async_batching=False" in call.error
        assert probe.unrecorded == probe.calls[0].error


def test_a_raising_on_step_stops_recording_that_request_only(model, caplog):
    prompts = _prompts((6, 11))
    plain = model.generate_batch(prompts, generation_config=_greedy(), continuous_batching_config=_config())
    def on_step(step: nxl.Step) -> None:
        if step.position == 12:  # req_1's second step (its prompt has 11 tokens, req_0's only 6)
            raise ValueError("the user's callback failed")

    with caplog.at_level(logging.WARNING, logger="nxl_hooks"), nxl.attach(model, on_step=on_step) as probe:
        out = model.generate_batch(prompts, generation_config=_greedy(), continuous_batching_config=_config())
    assert _tokens(out) == _tokens(plain)  # the manager's loop never saw the callback's exception
    by_id = {c.request_id: c for c in probe.calls}
    assert "callback failed" in by_id["req_1"].error and len(by_id["req_1"].steps) == 2
    check_call(model, by_id["req_0"], NEW)
    assert len([r for r in caplog.records if r.name == "nxl_hooks"]) == 1


def test_a_packed_plain_forward_is_reported_not_misread(model):
    ids, cumulative = torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([0, 3, 5], dtype=torch.int32)
    packed = dict(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 0, 1]]), cu_seq_lens_q=cumulative,
                  cu_seq_lens_k=cumulative, max_length_q=3, max_length_k=3)  # two sequences in one row
    with torch.no_grad():
        plain = model(**packed).logits
        with nxl.attach(model) as probe:
            model(input_ids=ids[:, :2])
            attached = model(**packed).logits
            with pytest.raises(RuntimeError, match="packed several sequences into one row"):
                probe.result()  # not the previous forward's record, and not one read as a single sequence
    assert torch.equal(plain, attached)


def test_detach_while_the_manager_runs_a_request(model, caplog):
    prompt = _prompts((8,), 8)[0]

    def serve(attach: bool):
        manager = model.init_continuous_batching(generation_config=_greedy(40), continuous_batching_config=_config())
        manager.start()
        try:
            if not attach:
                return _serve(manager, "r", prompt, 40), None
            inside, resume = threading.Event(), threading.Event()

            def on_step(step: nxl.Step) -> None:
                if step.step == 3:  # hold the manager's thread inside the request while the probe detaches
                    inside.set()
                    resume.wait(timeout=60)

            probe = nxl.attach(model, on_step=on_step)
            manager.add_request(prompt, request_id="r", max_new_tokens=40)
            assert inside.wait(timeout=60)
            probe.detach()
            resume.set()
            assert not _wrapped()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                result = manager.get_result(request_id="r", timeout=1)
                if result is not None and result.is_finished():
                    return result.generated_tokens, probe
            raise AssertionError("the request did not finish after the probe detached")
        finally:
            manager.stop(block=True, timeout=30)

    plain, _ = serve(attach=False)
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"):
        tokens, probe = serve(attach=True)
    assert tokens == plain and len(tokens) == 40
    (call,) = probe.calls
    assert not call.complete and "detached" in call.error and [s.step for s in call.steps] == [0, 1, 2, 3]
    assert [r for r in caplog.records if r.name == "nxl_hooks"] == []


@pytest.mark.parametrize("held", ["between steps", "in a forward"])
def test_detach_says_how_many_steps_waiting_to_be_scored_it_dropped(model, held, monkeypatch):
    """Detached while the manager runs a request whose last steps wait to be scored together (nothing reads them
    live): its call says how many of them were dropped, as a collected manager's requests do (it said only that the
    probe detached). Held between two steps, the detach ends it; held in a forward, the manager's thread ends it as
    it leaves that step (detach does not wait for it). The count: the tokens the manager had handed the request
    then, less the steps recorded."""
    prompt, at, new = _prompts((8,), 8)[0], BATCH_STEPS + 3, 40
    reached, release, handed = threading.Event(), threading.Event(), []

    def hold(processor) -> None:  # once, in the manager's thread, when the request has been handed `at` tokens
        state = processor.scheduler.active_requests.get("r")
        if state is not None and len(state.generated_tokens) == at and not reached.is_set():
            handed.extend(state.generated_tokens)
            reached.set()
            assert release.wait(60)

    manager = model.init_continuous_batching(generation_config=_greedy(new), continuous_batching_config=_config())
    handle = None
    if held == "between steps":  # after a step's tokens were handed out, before the next step opens
        update = ContinuousBatchProcessor.update_batch
        monkeypatch.setattr(ContinuousBatchProcessor, "update_batch", lambda self: (update(self), hold(self))[0])
    else:  # (in a module the probe does not hook: a hook it takes off while the module's hooks run breaks that call)
        handle = model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: hold(manager.batch_processor))
    probe = nxl.attach(model)
    manager.start()
    try:
        manager.add_request(prompt, request_id="r", max_new_tokens=new)
        assert reached.wait(60)
        probe.detach()
        release.set()
        tokens = _finished(manager, "r")  # (the manager's thread left the step it was held in before)
    finally:
        release.set()
        manager.stop(block=True, timeout=30)
        if handle is not None:
            handle.remove()
        probe.detach()
    (call,) = probe.calls
    dropped = len(handed) - len(call.steps)
    assert 0 < dropped < BATCH_STEPS and len(tokens) == new
    assert call.error == f"the probe detached while this call ran; its last {dropped} steps were not scored"
    assert [int(s.token) for s in call.steps] == handed[: len(call.steps)] == tokens[: len(call.steps)]


def test_nxl_eager_makes_managers_of_followed_models_without_cuda_graphs_or_async_batching(model, monkeypatch):
    from transformers import ContinuousBatchingConfig

    seen = []
    original = continuous_api.resolve_continuous_batching_config

    def resolve(config, cb_config, *args, **kwargs):  # what the manager is made with
        seen.append((cb_config.use_cuda_graph, cb_config.use_async_batching))
        return original(config, cb_config, *args, **kwargs)

    monkeypatch.setattr(continuous_api, "resolve_continuous_batching_config", resolve)
    # asked for explicitly: the advice in an asynchronous manager's records (NXL_EAGER=1) must make it recordable
    asked = ContinuousBatchingConfig(use_cuda_graph=True, use_async_batching=True)
    attention = model.config._attn_implementation
    try:
        for eager in ("0", "1"):
            monkeypatch.setenv("NXL_EAGER", eager)
            with nxl.attach(model):
                continuous_api.ContinuousBatchingManager(model, _greedy(), asked)
        continuous_api.ContinuousBatchingManager(model, _greedy(), asked)  # no probe: as asked
    finally:  # a manager made sets the model's attention to its paged one, and only stopping one gives it back: the
        # module's model ran the later tests' oracle forwards paged (transformers 5.18: "called without a paged
        # attention cache"), whichever tests ran after this one in its worker
        model.set_attn_implementation(attention)
    assert seen == [(True, True), (False, False), (True, True)]
    assert asked.use_cuda_graph is True and asked.use_async_batching is True  # the caller's object as written
