"""Several threads on one attached model: every forward, generate call and pipeline call recorded separately and
equal to its single-threaded oracle; the host's outputs unchanged; detaching while another thread generates harms
nothing."""

import logging
import sys
import threading
import time

import pytest
import torch
from transformers import pipeline

import nxl_hooks as nxl
import tiny
from nxl_hooks.hooks.generate import REQUEST_ID
from oracle import check_call, llama, normxlogit

THREADS, CALLS = 4, 25


@pytest.fixture(scope="module")
def model():
    model = tiny.build_model("llama")
    model.generation_config.eos_token_id = None  # random weights: every call generates its full length
    model.generation_config.pad_token_id = 0
    return model


def _forward_inputs(thread: int, index: int) -> dict[str, torch.Tensor]:
    """Plain-forward inputs of several batch shapes; two-row batches are right-padded."""
    generator = torch.Generator().manual_seed(1000 * thread + index)
    rows, length = 1 + (index + thread) % 3, 3 + (index * 7 + thread) % 8
    ids = torch.randint(5, len(tiny.VOCAB), (rows, length), generator=generator)
    mask = torch.ones(rows, length, dtype=torch.long)
    if rows > 1:
        mask[0, length - 2:], ids[0, length - 2:] = 0, 0
    return {"input_ids": ids, "attention_mask": mask}


def _prompt(thread: int, index: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(5000 + 1000 * thread + index)
    return torch.randint(5, len(tiny.VOCAB), (1, 2 + (index + 3 * thread) % 9), generator=generator)


_WORDS = ["the film was", "a plot is very", "the movie", "good and bad but quite"]


def _kind(thread: int, index: int) -> str:
    return ("forward", "greedy", "sampled", "pipeline")[(index + thread) % 4]


def _generate(model, thread: int, index: int, sampled: bool) -> torch.Tensor:
    sampling = dict(do_sample=True, temperature=2.0, top_k=0) if sampled else dict(do_sample=False)
    return model.generate(input_ids=_prompt(thread, index), max_new_tokens=2 + index % 4, **sampling)


def _work(model, probe, generator_pipeline, thread: int, index: int) -> tuple[str, object, object]:
    """Call ``index`` of ``thread``: (kind, host output, the thread's result() for forwards)."""
    kind = _kind(thread, index)
    if kind == "forward":
        with torch.no_grad():
            logits = model(**_forward_inputs(thread, index)).logits
        return kind, logits, probe.result()
    if kind == "pipeline":  # no request id set: the call gets a generated one
        text = generator_pipeline(_WORDS[index % 4], max_new_tokens=3, do_sample=False)[0]["generated_text"]
        return kind, text, None
    token = REQUEST_ID.set(f"t{thread}-c{index}")
    try:
        out = _generate(model, thread, index, sampled=kind == "sampled")
    finally:
        REQUEST_ID.reset(token)
    return kind, out, None


def test_four_threads_of_mixed_calls_each_equal_their_oracle(model):
    tokenizer = tiny.tokenizer()
    # single-threaded references, unattached
    references: dict = {}
    refs_pipeline = pipeline("text-generation", model=model, tokenizer=tokenizer)
    for t in range(THREADS):
        for i in range(CALLS):
            kind = _kind(t, i)
            if kind == "forward":
                with torch.no_grad():
                    references[t, i] = model(**_forward_inputs(t, i), output_hidden_states=True)
            elif kind == "greedy":
                references[t, i] = _generate(model, t, i, sampled=False)
            elif kind == "pipeline":
                references[t, i] = refs_pipeline(_WORDS[i % 4], max_new_tokens=3, do_sample=False)[0]["generated_text"]

    results: dict = {}
    errors: list[BaseException] = []

    def worker(thread: int) -> None:
        own_pipeline = pipeline("text-generation", model=model, tokenizer=tokenizer)
        try:
            for index in range(CALLS):
                results[thread, index] = _work(model, probe, own_pipeline, thread, index)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    with nxl.attach(model, layers="all", tokenizer=tokenizer) as probe:
        workers = [threading.Thread(target=worker, args=(t,), name=f"worker-{t}") for t in range(THREADS)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=300)
        assert not any(w.is_alive() for w in workers), "a worker thread hung"
        with pytest.raises(RuntimeError, match="no forward has run under this probe yet"):
            probe.result()  # this thread ran none: results belong to the thread that ran the forward
    assert errors == [] and len(results) == THREADS * CALLS

    hand = llama(model)
    calls = list(probe.calls)
    by_request = {call.request_id: call for call in calls}
    assert len(by_request) == len(calls) == THREADS * CALLS * 3 // 4  # unique ids, every generate-style call kept
    pipeline_calls = [call for call in calls if not call.request_id.startswith("t")]
    for (thread, index), (kind, output, attribution) in results.items():
        if kind == "forward":
            expected = references[thread, index]
            assert torch.equal(output, expected.logits)  # the host's own output, unchanged
            mask = _forward_inputs(thread, index)["attention_mask"]
            last = mask.sum(dim=1) - 1  # right padding: the last real token predicts
            rows = torch.arange(mask.shape[0])
            target = expected.logits[rows, last].argmax(-1)
            logat, nx = normxlogit(hand.layer_logits(expected.hidden_states), expected.hidden_states[0], target)
            assert attribution.target.tolist() == target.tolist()
            assert attribution.position.tolist() == last.tolist()
            torch.testing.assert_close(attribution.logat, logat, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(attribution.normxlogit, nx, rtol=1e-4, atol=1e-4)
        elif kind == "pipeline":
            assert output == references[thread, index]
        else:
            call = by_request[f"t{thread}-c{index}"]
            assert call.thread == f"worker-{thread}"
            check_call(model, call, 2 + index % 4, hand)
            assert torch.equal(call.sequences, output)
            if kind == "greedy":
                assert torch.equal(output, references[thread, index])
    assert len(pipeline_calls) == THREADS * CALLS // 4
    for call in pipeline_calls:
        assert call.thread.startswith("worker-") and len(call.request_id) == 32  # a generated uuid4 hex
        check_call(model, call, 3, hand)


def test_detach_while_another_thread_generates(model, tmp_path, caplog):
    ids = _prompt(0, 99)
    plain = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False)
    inside, resume = threading.Event(), threading.Event()

    def on_step(step: nxl.Step) -> None:
        if step.step == 3:  # hold the generating thread mid-call while the main thread detaches
            inside.set()
            resume.wait(timeout=60)

    outcome: dict = {}

    def generate() -> None:
        try:
            outcome["out"] = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False)
        except BaseException as error:  # noqa: BLE001 - reported below
            outcome["error"] = error

    path = tmp_path / "detached.nxl"
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"):
        probe = nxl.attach(model, sink=path, on_step=on_step)
        worker = threading.Thread(target=generate, name="generating")
        worker.start()
        assert inside.wait(timeout=60)
        probe.detach()
        detached = time.time()
        resume.set()
        worker.join(timeout=60)
    assert not worker.is_alive() and "error" not in outcome
    assert torch.equal(outcome["out"], plain)  # the host's generate finished, unchanged
    (call,) = probe.calls
    assert not call.complete and "detached" in call.error and call.thread == "generating"
    assert [s.step for s in call.steps] == [0, 1, 2, 3] and torch.equal(call.sequences, plain)
    # it ended when it stopped being recorded, at the detach (it was left None for good, in memory and on disk)
    assert call.ended is not None and call.started <= call.ended <= detached
    (read,) = nxl.read_stream(path)  # the sink was closed cleanly and stays readable
    assert not read.complete and "detached" in read.error and len(read.steps) == 4 and read.ended == call.ended
    assert [r for r in caplog.records if r.name == "nxl_hooks"] == []  # nothing failed: no warning
    assert "generate" not in vars(model)


def test_detach_while_another_thread_runs_a_forward_leaves_it_no_result_of_another(model):
    """A plain forward that the probe detached in the middle of reaches none of the probe's end hooks: its thread's
    result() gave that thread's forward before it, of other ids, as this one's. It says now that the forward did not
    end under the probe; the host's output is its own."""
    first, held = _forward_inputs(0, 1), {"input_ids": _prompt(1, 2)}
    assert first["input_ids"].shape != held["input_ids"].shape
    inside, resume, outcome = threading.Event(), threading.Event(), {}

    def hold(module, args, output):
        if threading.current_thread().name == "held":
            inside.set()
            resume.wait(timeout=60)

    def forwards() -> None:
        with torch.no_grad():
            model(**first)
            outcome["first"] = probe.result()
            handle = model.model.layers[0].register_forward_hook(hold)
            try:
                outcome["logits"] = model(**held).logits
            finally:
                handle.remove()
        try:
            outcome["result"] = probe.result()
        except RuntimeError as error:
            outcome["result"] = error

    probe = nxl.attach(model)
    worker = threading.Thread(target=forwards, name="held")
    worker.start()
    assert inside.wait(timeout=60)
    probe.detach()
    resume.set()
    worker.join(timeout=60)
    assert not worker.is_alive() and tiny.nxl_hooks_on(model) == 0
    with torch.no_grad():
        assert torch.equal(outcome["logits"], model(**held).logits)
    assert outcome["first"].normxlogit.shape[-1] == first["input_ids"].shape[1]
    assert isinstance(outcome["result"], RuntimeError) and "probe detached while it ran" in str(outcome["result"])


def test_a_forward_running_when_another_thread_attaches_says_so_and_the_next_is_recorded(model):
    """A forward whose backbone started before the attach (nxl attach PID into a busy process) reaches the probe's
    block hooks with no capture open: its result told the user to set `backbone` in the model's registry entry,
    which was not the cause. It says now that the forward started before the probe attached; the thread's next is
    recorded."""
    held, after = {"input_ids": _prompt(2, 3)}, _forward_inputs(2, 4)
    inside, resume, outcome, box = threading.Event(), threading.Event(), {}, {}

    def hold(module, args, output):
        inside.set()
        resume.wait(timeout=60)

    def forwards() -> None:
        with torch.no_grad():
            model(**held)
            try:
                box["probe"].result()
            except RuntimeError as error:
                outcome["straddled"] = str(error)
            handle.remove()
            outcome["reference"] = model(**after, output_hidden_states=True)
            model(**after)
            outcome["after"] = box["probe"].result()

    handle = model.model.embed_tokens.register_forward_hook(hold)
    worker = threading.Thread(target=forwards, name="straddling")
    worker.start()
    assert inside.wait(timeout=60)
    with nxl.attach(model) as probe:
        box["probe"] = probe
        resume.set()
        worker.join(timeout=60)
    assert not worker.is_alive()
    assert "started before the probe attached" in outcome["straddled"] and "backbone" not in outcome["straddled"]
    expected, mask = outcome["reference"], after["attention_mask"]
    last = mask.sum(dim=1) - 1
    target = expected.logits[torch.arange(mask.shape[0]), last].argmax(-1)
    _, nx = normxlogit(llama(model).layer_logits(expected.hidden_states), expected.hidden_states[0], target)
    torch.testing.assert_close(outcome["after"].normxlogit, nx, rtol=1e-4, atol=1e-4)


def test_keep_calls_bounds_the_ended_calls_and_keeps_every_running_one(model):
    """keep_calls=1 with a call still running while three others start and end: the running one stays in
    probe.calls (the live feed of nxl run and its lookups by request id find a request through it; it was dropped
    as soon as another call started, and its steps went out with no request id), beside the last call that ended;
    once it ends it is the oldest ended call, and goes."""
    inside, resume = threading.Event(), threading.Event()

    def on_step(step: nxl.Step) -> None:
        if threading.current_thread().name == "held" and step.step == 1:
            inside.set()
            resume.wait(timeout=60)

    def generate(request_id: str) -> None:
        token = REQUEST_ID.set(request_id)
        try:
            model.generate(input_ids=_prompt(0, 7), max_new_tokens=4, do_sample=False)
        finally:
            REQUEST_ID.reset(token)

    with nxl.attach(model, keep_calls=1, on_step=on_step) as probe:
        worker = threading.Thread(target=generate, args=("long",), name="held")
        worker.start()
        assert inside.wait(timeout=60)
        for index in range(3):
            generate(f"short-{index}")
        held = [(call.request_id, call.ended is None) for call in probe.calls]
        resume.set()
        worker.join(timeout=60)
        after = [call.request_id for call in probe.calls]
    assert not worker.is_alive()
    assert held == [("long", True), ("short-2", False)] and after == ["short-2"]


def _waits_to_explain(thread: threading.Thread) -> bool:
    """Whether ``thread`` is in nxl.explain, waiting for another thread's explain of the model to detach."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == "_one_at_a_time":
            return True
        frame = frame.f_back
    return False


def test_threads_explaining_one_model_at_once_each_get_their_own_text_explained(model):
    """nxl.explain from two threads on one model (a server explaining each request): the thread whose explain came
    while the other's forward ran was refused, told to leave a `with nxl.attach(...)` block it never opened (one
    probe per model). It now waits for the other to detach, and each gets its own text's attribution, equal to the
    oracle."""
    tokenizer = tiny.tokenizer()
    texts = {"held": "the film was very good", "second": "a plot is"}
    inside, resume, outcome = threading.Event(), threading.Event(), {}

    def hold(module, args, output):
        if threading.current_thread().name == "held":  # the first explain's forward, its probe attached
            inside.set()
            resume.wait(timeout=60)

    def explain(name: str) -> None:
        try:
            outcome[name] = nxl.explain(model, tokenizer, texts[name], layers="all")
        except BaseException as error:  # noqa: BLE001 - reported below
            outcome[name] = error

    handle = model.model.layers[0].register_forward_hook(hold)
    try:
        held = threading.Thread(target=explain, args=("held",), name="held")
        held.start()
        assert inside.wait(timeout=60)
        second = threading.Thread(target=explain, args=("second",), name="second")
        second.start()
        deadline = time.monotonic() + 60  # until the second has come to the model: refused, or waiting its turn
        while second.is_alive() and not _waits_to_explain(second) and time.monotonic() < deadline:
            time.sleep(0.01)
        resume.set()
        held.join(timeout=60)
        second.join(timeout=60)
    finally:
        resume.set()
        handle.remove()
    assert not held.is_alive() and not second.is_alive() and tiny.nxl_hooks_on(model) == 0
    hand = llama(model)
    for name, text in texts.items():
        res = outcome[name]
        assert isinstance(res, nxl.Attribution), res
        with torch.no_grad():
            expected = model(**tokenizer(text, return_tensors="pt"), output_hidden_states=True)
        target = expected.logits[:, -1].argmax(-1)
        _, nx = normxlogit(hand.layer_logits(expected.hidden_states), expected.hidden_states[0], target)
        assert res.target.tolist() == target.tolist()
        torch.testing.assert_close(res.normxlogit, nx, rtol=1e-4, atol=1e-4)
