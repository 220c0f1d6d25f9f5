"""Compiled code recorded (issue 25): transformers' own compiled static-cache generate (inductor, on the CPU with
``_compile_all_devices``), a user's ``torch.compile(..., fullgraph=True)`` after attaching, a forward compiled in
place before attaching, and a compiled model object; every step against the no-cache oracle, dynamo's counters
showing no graph break, a recorded call's compiled code the model's own, operation for operation, and the model's
compiled code as it was after detach."""

import copy
import threading
import time

import pytest
import torch
from torch._dynamo.utils import counters

import nxl_hooks as nxl
from nxl_hooks.hooks import forward
import tiny
from oracle import check_call, check_steps, full_mask, llama, normxlogit, prefix_logits

VOCAB, PAD = tiny.GEN_VOCAB, tiny.GEN_PAD


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # compiled code of one test must not decide what another one sees
    counters.clear()
    yield
    torch._dynamo.reset()


def _prompt(rows: int = 2, length: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (rows, length), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    if rows > 1:  # a left-padded row
        mask[1, :2] = 0
        ids[1, :2] = PAD
    return ids, mask


def _check(model, call, new_tokens: int) -> None:
    """Every step equals the oracle (check_call), and its probability is the model's own softmax of its token."""
    check_call(model, call, new_tokens)
    hand, attention = llama(model), full_mask(call)
    for step in call.steps:
        logits, _ = prefix_logits(model, hand, call.sequences[:, :step.position], attention[:, :step.position])
        expected = logits[-1, :, -1].log_softmax(-1).gather(-1, step.token[:, None])[:, 0].exp()
        torch.testing.assert_close(step.probability, expected, rtol=1e-4, atol=1e-5)


def _plain_oracle(model, ids: torch.Tensor) -> torch.Tensor:
    """NormXLogit (L+1, rows, seq) of an unpadded plain forward at the model's own prediction, by hand."""
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
        logits = llama(model).layer_logits(out.hidden_states)
        return normxlogit(logits, out.hidden_states[0], out.logits[:, -1].argmax(-1))[1]


def _no_graph_breaks() -> None:
    assert counters["stats"]["unique_graphs"] >= 1
    assert not counters["graph_break"], dict(counters["graph_break"])


def _static(model, ids, mask, config):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                          cache_implementation="static", compile_config=config)


def _scored_elsewhere_two_prompts(monkeypatch):
    """Steps scored off the calling thread, as on a GPU (the CPU made such a device); (model, a left-padded prompt,
    another with the same padding, its mask, generate's compile config). The eager backend: a compiled call's steps
    are run again eagerly whatever compiled them (inductor's call: test_generate_compiled_by_transformers_...)."""
    from nxl_hooks.hooks import generate

    monkeypatch.setattr(generate, "SCORED_ELSEWHERE", generate.SCORED_ELSEWHERE | {"cpu"})
    first, mask = _prompt()
    second = torch.where(mask.bool(), torch.randint(1, VOCAB, first.shape, generator=torch.Generator().manual_seed(6)),
                         PAD)
    config = tiny.cpu_compile(backend="eager")
    return tiny.generating_llama(seed=3), first, second, mask, config


def test_generate_compiled_by_transformers_is_recorded_step_by_step(monkeypatch):
    """Its steps are recorded when it returns, from the model run again over the positions after the prompt only,
    against what the call's cache holds of the prompt (its eager forward's keys and values)."""
    from nxl_hooks.hooks import generate

    refill, runs = generate.Generations.refill, []

    def counted(self, ids, mask, positions, keep, cache, start, extra):
        out = refill(self, ids, mask, positions, keep, cache, start, extra)
        runs.append((ids.shape[1], start, out[0].shape))
        return out

    monkeypatch.setattr(generate.Generations, "refill", counted)
    model = tiny.generating_llama(seed=3)
    ids, mask = _prompt()
    config = tiny.cpu_compile()  # inductor, as generate compiles on a GPU
    plain = _static(model, ids, mask, config)  # compiled before any probe: that code never calls the hooks
    kept = model._compiled_call
    with nxl.attach(model, layers="all") as probe:
        for _ in range(2):
            assert torch.equal(_static(model, ids, mask, config), plain)
    assert runs == [(10, 6, (2, 4))] * 2  # 10 positions ran (the last token never does), the 4 after the prompt
    _no_graph_breaks()
    assert counters["stats"]["unique_graphs"] == 1  # the model's own compiled call: attaching recompiles nothing
    assert probe.unrecorded is None and len(probe.calls) == 2
    for call in probe.calls:
        _check(model, call, 5)
    assert "get_compiled_call" not in vars(model) and model._compiled_call is kept  # its own compiled call back
    assert torch.equal(_static(model, ids, mask, config), plain)


def test_a_user_compile_after_attaching_is_fullgraph_and_recorded():
    model = tiny.generating_llama(seed=4)
    ids, mask = _prompt()
    with nxl.attach(model, layers="all", tokenizer=None) as probe:
        model.forward = torch.compile(model.forward, fullgraph=True, backend="eager")
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        model(input_ids=ids, attention_mask=mask)  # a plain forward too
        plain = probe.result()
        model(input_ids=ids[:1])  # one unpadded row, for the oracle
        alone = probe.result()
    del model.forward  # the oracle runs eagerly
    torch.testing.assert_close(alone.normxlogit, _plain_oracle(model, ids[:1]), rtol=1e-4, atol=1e-5)
    _no_graph_breaks()  # fullgraph=True would have raised on one
    assert probe.unrecorded is None
    (call,) = probe.calls
    assert torch.equal(call.sequences, out)
    _check(model, call, 4)
    with nxl.attach(model, layers="all") as probe:
        model(input_ids=ids, attention_mask=mask)
    eager = probe.result()
    torch.testing.assert_close(plain.normxlogit, eager.normxlogit, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(plain.probability, eager.probability)
    assert torch.equal(plain.target, eager.target)


def test_a_forward_compiled_in_place_without_a_mask_is_run_again_with_the_mask_generate_infers(monkeypatch):
    """Every forward of the call ran compiled (the prompt too) and no attention mask was given: generate infers one
    from the pad id, and the model run again when the call ends uses that one, with the model's forward uncompiled
    for that run alone (torch's process-wide stance, which would make every thread's compiled code run eagerly
    meanwhile, stays as it was)."""
    from torch._dynamo import eval_frame

    from nxl_hooks.hooks import generate

    monkeypatch.setattr(generate, "REFILL_POSITIONS", 4)  # the prompt's 6 positions and the first 2 generated apart
    stances, after_task = [], generate._Refilled.after_task

    def seen(self, output):  # while the model runs again
        stances.append(eval_frame._stance.stance)
        after_task(self, output)

    monkeypatch.setattr(generate._Refilled, "after_task", seen)
    model = tiny.generating_llama(seed=4)
    ids, mask = _prompt()  # row 1 starts with two pads
    with nxl.attach(model, layers="all") as probe:
        model.forward = torch.compile(model.forward, fullgraph=True, backend="eager")
        out = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    del model.forward
    assert stances == ["default"] * 3  # three chunks: positions 0..3, 4..7 and 8
    (call,) = probe.calls
    assert torch.equal(call.prompt_mask, mask.bool()) and torch.equal(call.sequences, out)
    _check(model, call, 4)


def test_a_right_padded_prompt_is_run_again_at_the_positions_generate_gave_its_tokens():
    """generate continues a right-padded row one past its prompt's last position id (the padding's, 0), not past its
    real tokens: the compiled steps, run again when the call ends, get the positions the eager steps had, and the
    same records (each checked against the no-cache oracle where the positions agree: the left-aligned row)."""
    model = tiny.generating_llama(seed=5)
    ids, mask = _prompt()
    ids[1], mask[1] = torch.roll(ids[1], -2), torch.roll(mask[1], -2)  # row 1: its two pads at the end
    config = tiny.cpu_compile(backend="eager")
    calls = []
    for compiled in (False, True):
        with nxl.attach(model, layers="all") as probe:
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                           cache_implementation="static", compile_config=config, disable_compile=not compiled)
        calls.append(probe.calls[0])
    eager, replayed = calls
    assert torch.equal(eager.sequences, replayed.sequences)
    for a, b in zip(eager.steps, replayed.steps, strict=True):
        torch.testing.assert_close(b.normxlogit, a.normxlogit, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(b.probability, a.probability, rtol=1e-4, atol=1e-6)


def test_a_forward_compiled_in_place_before_attaching_is_recorded_and_left_clean():
    model = tiny.generating_llama(seed=5)
    ids, mask = _prompt(rows=1)
    model.forward = torch.compile(model.forward, backend="eager")
    before = model(input_ids=ids).logits  # compiled without hooks
    with nxl.attach(model, layers="all") as probe:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    compiled = model.forward
    del model.forward  # the oracle runs eagerly
    assert probe.unrecorded is None
    assert torch.equal(probe.calls[0].sequences, out)
    _check(model, probe.calls[0], 3)
    model.forward = compiled
    seen = []
    from nxl_hooks.hooks import traced  # after detach the compiled code runs no hook of the probe: it recompiled

    original = traced.TracedForward.begin
    traced.TracedForward.begin = lambda self, arguments: (seen.append(1), original(self, arguments))[1]
    try:
        torch.testing.assert_close(model(input_ids=ids).logits, before)
    finally:
        traced.TracedForward.begin = original
    assert seen == []


def test_a_model_object_compiled_after_attaching_is_recorded():
    model = tiny.generating_llama(seed=6)
    ids, mask = _prompt()
    with nxl.attach(model, layers="all") as probe:
        model(input_ids=ids, attention_mask=mask)
        eager = probe.result()
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        compiled(input_ids=ids, attention_mask=mask)  # the task model's hooks are traced too
        traced = probe.result()
        compiled(input_ids=ids[:1])  # one unpadded row, for the oracle
        alone = probe.result()
    _no_graph_breaks()
    torch.testing.assert_close(alone.normxlogit, _plain_oracle(model, ids[:1]), rtol=1e-4, atol=1e-5)
    assert traced is not eager
    torch.testing.assert_close(traced.normxlogit, eager.normxlogit, rtol=1e-5, atol=1e-6)
    assert torch.equal(traced.target, eager.target) and torch.equal(traced.mask, eager.mask)


def test_the_result_is_the_last_forward_whether_it_ran_compiled_or_eagerly():
    """A forward the user's compiled copy ran is kept until the result is read; an eager forward after it is then the
    last one, and the other way round."""
    model = tiny.generating_llama(seed=4)
    short, long = _prompt(rows=1, length=6)[0], _prompt(rows=1, length=9)[0]
    with nxl.attach(model, layers="all") as probe:
        compiled = torch.compile(model.forward, fullgraph=True, backend="eager")
        compiled(input_ids=short)
        model(input_ids=long)
        eager_last = probe.result()
        model(input_ids=long)
        compiled(input_ids=short)
        compiled_last = probe.result()
    torch.testing.assert_close(eager_last.normxlogit, _plain_oracle(model, long), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(compiled_last.normxlogit, _plain_oracle(model, short), rtol=1e-4, atol=1e-5)


def test_a_forward_compiled_while_attached_is_recorded_where_its_class_ran_compiled_before():
    """Dynamo does not guard on a module's hooks: the code it compiled for the class's forward before attaching (for
    a plain twin here) never calls them, and would be reused by a compile while attached; that forward recompiles at
    its first call, tracing the hooks. At detach it recompiles again, and the twin runs without them."""
    model, twin = tiny.generating_llama(seed=4), tiny.generating_llama(seed=7)
    ids = _prompt(rows=1)[0]
    twin.forward = torch.compile(twin.forward, fullgraph=True, backend="eager")
    plain = twin(input_ids=ids).logits  # compiled without hooks
    with nxl.attach(model, layers="all") as probe:
        model.forward = torch.compile(model.forward, fullgraph=True, backend="eager")
        model(input_ids=ids)
        result = probe.result()
    del model.forward  # the oracle runs eagerly
    torch.testing.assert_close(result.normxlogit, _plain_oracle(model, ids), rtol=1e-4, atol=1e-5)
    _no_graph_breaks()
    from nxl_hooks.hooks import traced

    seen, original = [], traced.TracedForward.begin
    traced.TracedForward.begin = lambda self, arguments: (seen.append(1), original(self, arguments))[1]
    try:
        assert torch.equal(twin(input_ids=ids).logits, plain)
    finally:
        traced.TracedForward.begin = original
    assert seen == []  # recompiled at detach: no hook of the probe's in it


def test_a_compiled_copy_made_before_attaching_is_named_and_a_forward_called_directly_is_recorded():
    """A compiled copy of the forward made before attaching runs code that skips the hooks, and no hook of the task
    model runs (it calls the forward, not the model): result() says what to do. Done (force_eager), its forward runs
    eagerly, called directly: recorded, as a direct call of the forward or the backbone is, the head giving the
    logits."""
    model = tiny.generating_llama(seed=4)
    ids, short = _prompt(rows=1)[0], _prompt(rows=1, length=4)[0]
    copy = torch.compile(model.forward, fullgraph=True, backend="eager")
    copy(input_ids=ids)
    with nxl.attach(model, layers="all") as probe:
        copy(input_ids=ids)
        with pytest.raises(RuntimeError, match="no forward has run.*compiled copy.*force_eager"):
            probe.result()
        with torch.compiler.set_stance("force_eager"):
            copy(input_ids=ids)
        forced = probe.result()
        model.forward(input_ids=short)
        direct = probe.result()
        model.model(input_ids=ids)
        backbone = probe.result()
    torch.testing.assert_close(forced.normxlogit, _plain_oracle(model, ids), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(direct.normxlogit, _plain_oracle(model, short), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(backbone.normxlogit, _plain_oracle(model, ids), rtol=1e-4, atol=1e-5)


def test_every_step_of_a_compiled_call_is_scored_with_the_models_own_distribution(monkeypatch):
    """A compiled call's steps are recorded from the model run again over its tokens, with the whole distribution at
    each: contrastive (whose foil is the model's best other output) equals the oracle at every step, not only the
    last; here run again two positions at a time, each chunk against the cache the one before grew."""
    from nxl_hooks.hooks import generate

    monkeypatch.setattr(generate, "REFILL_POSITIONS", 2)
    model = tiny.generating_llama(seed=3)
    ids, mask = _prompt()
    config = tiny.cpu_compile(backend="eager")
    with nxl.attach(model, layers="all", methods=["contrastive"]) as probe:
        _static(model, ids, mask, config)
    call = probe.calls[-1]
    _check(model, call, 5)
    for step in call.steps:
        real = full_mask(call)[:, :step.position]
        logits, embeddings = prefix_logits(model, llama(model), call.sequences[:, :step.position], real)
        final = logits[-1, :, -1].clone()
        final.scatter_(-1, step.token[:, None], float("-inf"))

        def at(ids: torch.Tensor) -> torch.Tensor:  # (rows,) ids -> (L+1, rows, n) their logits at every position
            return logits.gather(-1, ids[None, :, None, None].expand(*logits.shape[:3], 1))[..., 0]

        expected = embeddings.float().norm(dim=-1) * (at(step.token) - at(final.argmax(-1)))
        torch.testing.assert_close(step.scores["contrastive"][:, real], expected[:, real], rtol=1e-4, atol=1e-5)


def test_a_compiled_calls_steps_scored_later_keep_their_probabilities_when_the_next_call_has_run(monkeypatch):
    """A compiled call's replayed steps may be scored in the hub's publisher thread after the call returns (on a GPU;
    here the CPU made such a device); by then the model's next compiled call has run, writing the model's static
    cache in place. Its steps keep what they read: the first call's records equal the oracle, the model's own
    probabilities included, though they are scored only once the second call (another prompt) has run."""
    from nxl_hooks.hooks import generate

    model, first, second, mask, config = _scored_elsewhere_two_prompts(monkeypatch)
    record, replay = generate.Run._record, generate.Run._replay
    replayed, rewritten = threading.Event(), threading.Event()

    def scored_later(self, emitted, context):  # the first call's steps wait until the second call has run
        if self.call.index == 0:
            # (what fails here loses the batch: the call then says so, and the checks below fail)
            assert threading.current_thread().name == "nxl_hooks-publisher" and rewritten.wait(120)
        return record(self, emitted, context)

    def replaying(self, sequences):
        replay(self, sequences)
        (replayed if self.call.index == 0 else rewritten).set()

    monkeypatch.setattr(generate.Run, "_record", scored_later)
    monkeypatch.setattr(generate.Run, "_replay", replaying)
    outputs = {}
    with nxl.attach(model, layers="all") as probe:
        calling = threading.Thread(target=lambda: outputs.update(first=_static(model, first, mask, config)))
        calling.start()
        assert replayed.wait(120)  # the first call is past its compiled forwards, its steps not scored yet
        outputs["second"] = _static(model, second, mask, config)
        calling.join(120)
    assert probe.unrecorded is None and [call.index for call in probe.calls] == [0, 1]
    assert not torch.equal(outputs["first"], outputs["second"])
    for call in probe.calls:
        _check(model, call, 5)


@pytest.mark.parametrize("embedding", ["layer_input", "word"])
def test_a_recorded_compiled_call_runs_the_models_own_graph_operation_for_operation(embedding, monkeypatch):
    """Nothing of the probe's goes into a recorded call's compiled code: inductor would fuse it into the model's
    kernels and tune them anew, and on a GPU the model's bf16 output changed (docs/benchmarks.md). Counted on the graphs
    dynamo hands its backend: a model compiled while attached (its first compiled call traces the hooks) compiles
    the very operations of its twin compiled plain, and every step still equals the oracle: recorded from the model
    run again eagerly over the call's tokens when it ends."""
    monkeypatch.setattr(forward, "HEAD_CHUNK", 2)  # the replay takes the head of its positions in several chunks
    model = tiny.generating_llama(seed=7)
    twin = copy.deepcopy(model)
    ids, mask = _prompt()
    kept = tiny.KeptGraphs()
    config = tiny.cpu_compile(backend=kept)
    plain = _static(model, ids, mask, config)
    torch._dynamo.reset()  # the twin's compiled call is traced anew (dynamo would reuse the plain one's code)
    with nxl.attach(twin, layers="all", embedding=embedding) as probe:
        assert torch.equal(_static(twin, ids, mask, config), plain)
    before, after = kept.graphs  # the plain model's compiled call, then its attached twin's
    assert kept.reductions(before) >= 2 * model.config.num_hidden_layers  # the model's own norms are counted
    assert kept.operations(after) == kept.operations(before)
    assert probe.unrecorded is None
    _check(twin, probe.calls[0], 5)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_compiled_call_returns_before_its_steps_are_recorded_in_a_thread_of_their_own(mode, monkeypatch):
    """Where a call's steps are scored off the calling thread (on a GPU; here the CPU made such a device), the eager
    forwards that record a compiled call's steps run in a thread of their own: generate returns first, and readers
    of the records wait for them. Held until the model's next compiled call (another prompt) has run, they still read
    the first call's own tokens and prompt cache (taken when it returned): its records equal the oracle, and both
    outputs are those of the model unattached. Also inside ``torch.inference_mode()``, whose tensors that thread
    writes into."""
    from nxl_hooks.hooks import generate

    model, first, second, mask, config = _scored_elsewhere_two_prompts(monkeypatch)
    with torch.no_grad():
        plain = [_static(model, first, mask, config), _static(model, second, mask, config)]
    refill, finish = generate.Generations.refill, generate.Run.finish
    rewritten, threads = threading.Event(), set()

    def held(self, *args):  # the first call's forwards wait until the second call has run compiled
        threads.add(threading.current_thread().name)
        assert rewritten.wait(120)
        return refill(self, *args)

    def finishing(self, sequences, *args, **kwargs):
        if self.call.index == 1:
            rewritten.set()
        finish(self, sequences, *args, **kwargs)

    monkeypatch.setattr(generate.Generations, "refill", held)
    monkeypatch.setattr(generate.Run, "finish", finishing)
    read: list = []
    with getattr(torch, mode)(), nxl.attach(model, layers="all") as probe:
        outputs = [_static(model, first, mask, config)]  # returns while its forwards wait
        reader = threading.Thread(target=lambda: read.extend((call.index, call.complete, len(call.steps))
                                                             for call in probe.calls))
        reader.start()
        reader.join(0.5)
        assert reader.is_alive() and not rewritten.is_set()  # the reader waits for the first call's records
        outputs.append(_static(model, second, mask, config))
        reader.join(120)
    assert threads == {"nxl_hooks-refill"}
    assert [torch.equal(out, expected) for out, expected in zip(outputs, plain)] == [True, True]
    assert read[0] == (0, True, 5)  # read once the first call's records were made
    assert probe.unrecorded is None and [call.index for call in probe.calls] == [0, 1]
    for call in probe.calls:
        _check(model, call, 5)


@pytest.mark.version_free
def test_detaching_right_after_a_compiled_call_waits_for_its_steps_and_a_failure_there_is_said(monkeypatch):
    """Leaving the ``with`` block as a compiled call's steps are being recorded in a thread of their own (as on a GPU)
    waits for them: the call is recorded whole. A failure in that thread never reaches the host: the next call
    returns its output, and its record says why it is not recorded."""
    from nxl_hooks.hooks import generate

    monkeypatch.setattr(generate, "SCORED_ELSEWHERE", generate.SCORED_ELSEWHERE | {"cpu"})
    model = tiny.generating_llama(seed=3)
    ids, mask = _prompt()
    config = tiny.cpu_compile(backend="eager")
    refill, calls = generate.Generations.refill, []

    def slow_then_failing(self, *args):
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            time.sleep(1)  # the probe detaches meanwhile
            return refill(self, *args)
        raise RuntimeError("refill failed on purpose")

    monkeypatch.setattr(generate.Generations, "refill", slow_then_failing)
    with nxl.attach(model, layers="all") as probe:
        _static(model, ids, mask, config)
    assert calls == ["nxl_hooks-refill"] and not probe.attached
    _check(model, probe.calls[0], 5)
    with nxl.attach(model, layers="all") as probe:
        out = _static(model, ids, mask, config)
    assert out.shape == (2, ids.shape[1] + 5)
    (call,) = probe.calls
    assert "refill failed on purpose" in call.error and probe.unrecorded_calls == 1


def test_weights_changed_before_a_compiled_calls_steps_are_run_again_are_said_never_recorded(monkeypatch):
    """As on a GPU a compiled call's steps are recorded by running the model again after it returns, beside the
    program: weights trained in place meanwhile gave records of neither model, said complete. The call now says its
    steps are not recorded and why; the next call, run again on the weights it ran with, equals the oracle."""
    from nxl_hooks.hooks import generate

    monkeypatch.setattr(generate, "SCORED_ELSEWHERE", generate.SCORED_ELSEWHERE | {"cpu"})
    model = tiny.generating_llama(seed=3)
    ids, mask = _prompt()
    config = tiny.cpu_compile(backend="eager")
    refill, trained = generate.Generations.refill, threading.Event()

    def after_training(self, *args):
        trained.wait()  # the program trains the model once the call returned, before its steps run again
        return refill(self, *args)

    monkeypatch.setattr(generate.Generations, "refill", after_training)
    with nxl.attach(model, layers="all") as probe:
        _static(model, ids, mask, config)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.mul_(1.5)
        trained.set()
        (call,) = probe.calls
        assert call.steps == [] and not call.complete and "weights changed" in call.error
        assert probe.unrecorded_calls == 1
        _static(model, ids, mask, config)
    _check(model, probe.calls[1], 5)


def test_offloaded_weights_loaded_at_each_forward_are_not_taken_for_weights_changed(monkeypatch):
    """accelerate puts an offloaded block's weights in place at each forward and takes them away after (new
    parameters each time): running the call's steps again is no change of its weights, and they are recorded."""
    from accelerate import cpu_offload

    from nxl_hooks.hooks import generate

    monkeypatch.setattr(generate, "SCORED_ELSEWHERE", generate.SCORED_ELSEWHERE | {"cpu"})
    model = tiny.generating_llama(seed=3)
    cpu_offload(model.model.layers[1], execution_device="cpu")
    ids, mask = _prompt()
    with nxl.attach(model, layers="all") as probe:
        _static(model, ids, mask, tiny.cpu_compile(backend="eager"))
    _check(model, probe.calls[0], 5)


@pytest.mark.version_free
def test_a_live_reader_closed_right_after_a_compiled_call_returns_gets_its_steps(monkeypatch):
    """A compiled call's steps are recorded after it returns, in a thread of their own (as on a GPU): a
    follow-subscription closed right then gets them all the same, the very records the call keeps (close ended it
    first: they were lost to it)."""
    from nxl_hooks.hooks import generate

    monkeypatch.setattr(generate, "SCORED_ELSEWHERE", generate.SCORED_ELSEWHERE | {"cpu"})
    model = tiny.generating_llama(seed=3)
    ids, mask = _prompt()
    refill = generate.Generations.refill

    def slow(self, *args):
        time.sleep(1)  # the reader is closed meanwhile
        return refill(self, *args)

    monkeypatch.setattr(generate.Generations, "refill", slow)
    with nxl.attach(model, layers="all") as probe:
        steps, seen = probe.subscribe(follow=True), []
        reader = threading.Thread(target=lambda: seen.extend(steps))
        reader.start()
        _static(model, ids, mask, tiny.cpu_compile(backend="eager"))
        steps.close()
        reader.join(60)
    (call,) = probe.calls
    assert len(seen) == 5 and all(a is b for a, b in zip(seen, call.steps))
    _check(model, call, 5)


@pytest.mark.version_free
def test_a_raising_on_step_stops_a_compiled_calls_records_where_it_stops_an_eager_ones(tmp_path, caplog):
    """An ``on_step`` callback that raises at step 2 of a compiled static-cache generate, whose steps are recorded
    together when it returns: as under the same call run eagerly, the call (in memory and in the sink) keeps the
    records the callback was handed, the one it raised on the last, each equal to the oracle; its error and the log
    line name that step, and generate's output is the model's own."""
    model = tiny.generating_llama(seed=3)
    ids, mask = _prompt()
    config = tiny.cpu_compile(backend="eager")
    plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    for compiled in (False, True):
        handed = []

        def on_step(step: nxl.Step) -> None:
            handed.append(step.step)
            if step.step == 2:
                raise ValueError("the user's callback failed")

        path = tmp_path / f"compiled{compiled}.nxl"
        caplog.clear()
        with caplog.at_level("WARNING", logger="nxl_hooks"), nxl.attach(model, on_step=on_step, sink=path) as probe:
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                 cache_implementation="static", compile_config=config, disable_compile=not compiled)
        (call,), (written,) = probe.calls, nxl.read_stream(path)
        assert torch.equal(out, plain) and torch.equal(call.sequences, out)
        assert handed == [0, 1, 2] and [step.step for step in call.steps] == [0, 1, 2]
        assert [step.step for step in written.steps] == [0, 1, 2]
        assert call.error == "the user's callback failed" and not call.complete
        (line,) = [record.getMessage() for record in caplog.records if record.name == "nxl_hooks"]
        assert line.startswith("nxl_hooks: not recorded after step 2 (") and "the user's callback failed" in line
        check_steps(model, call)


def _windowed(kind: str):
    """A Gemma 2 (its layers alternate sliding-window and full attention: generate hands its blocks a dict of masks)
    or a Mistral whose every layer's window (3) is shorter than the prompt, tiny and random, generating freely."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    sizes = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, pad_token_id=PAD)
    model = (Gemma2ForCausalLM(Gemma2Config(**sizes, head_dim=8, sliding_window=4)) if kind == "gemma2" else
             MistralForCausalLM(MistralConfig(**sizes, sliding_window=3))).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
@pytest.mark.parametrize("kind", ["gemma2", "mistral"])
def test_a_static_cache_of_windowed_attention_is_recorded(kind, compiled):
    """A static cache on a model with sliding-window layers, compiled by generate or run eagerly (``NXL_EAGER=1``):
    Gemma 2's blocks get a mask per layer type (its full-attention one says which tokens are padding), and a full
    window's mask covers only the keys of the window, which the prompt's last query does not all see. Every step
    equals the oracle, each row's padding as the prompt's mask says, the output the unattached model's."""
    from oracle import gemma

    model = _windowed(kind)
    ids, mask = _prompt(rows=3, length=7)
    mask[2, :3], ids[2, :3] = 0, PAD
    config = tiny.cpu_compile(backend="eager")  # (the mask is read from the prompt's eager forward either way)
    generation = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                      cache_implementation="static", compile_config=config, disable_compile=not compiled)
    plain = model.generate(**generation)
    with nxl.attach(model, layers="all") as probe:
        assert torch.equal(model.generate(**generation), plain)
    assert probe.unrecorded is None, probe.unrecorded
    (call,) = probe.calls
    assert call.steps[0].mask.tolist() == mask.bool().tolist()
    check_call(model, call, 5, hand=gemma(model) if kind == "gemma2" else llama(model))


@pytest.mark.version_free
def test_a_call_is_recorded_while_another_thread_compiles():
    """Whether the probe's hooks run traced is asked of dynamo (``is_dynamo_compiling``), not of
    ``torch.compiler.is_compiling()``, which torch 2.13 holds True in every thread while one compiles: while another
    thread's compile is under way (held in its backend here), an eager ``generate`` and a compiled one (compiled
    before: dynamo lets one thread compile at a time), whose eager refill then runs, are recorded whole, every step
    the oracle's."""
    model = tiny.generating_llama(seed=3)
    ids, mask = _prompt()
    config = tiny.cpu_compile(backend="eager")
    compiling, release = threading.Event(), threading.Event()

    def held(graph, inputs):  # a backend that keeps its thread compiling until released
        compiling.set()
        assert release.wait(120)
        return graph.forward

    other = threading.Thread(target=lambda: torch.compile(lambda x: x.sin() + 1, backend=held)(torch.ones(3)))
    with nxl.attach(model, layers="all") as probe:
        _static(model, ids, mask, config)  # compiled here, before the other thread holds dynamo
        other.start()
        try:
            assert compiling.wait(120)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
            _static(model, ids, mask, config)
            assert other.is_alive() and not release.is_set()  # both ran while the other thread compiled
        finally:
            release.set()
            other.join(120)
    assert probe.unrecorded is None, probe.unrecorded
    _check(model, probe.calls[1], 4)
    _check(model, probe.calls[2], 5)

@pytest.mark.parametrize("why", ["rescaled_rope", "no_thread"])
def test_a_compiled_calls_steps_are_recorded_in_the_calling_thread_where_another_cannot_run_them(why, monkeypatch):
    """Where the eager forwards that record a compiled call would run in a thread of their own (as on a GPU), they run
    in the calling thread instead when the model's forward writes its own state (a rotary embedding transformers
    rescales to the positions, ``dynamic``: the two threads would race on it, and the host's next call could see
    the refill's frequencies), or when no thread can be started: the call is recorded all the same."""
    model, ids, _, mask, config = _scored_elsewhere_two_prompts(monkeypatch)
    if why == "rescaled_rope":
        settings = model.config
        settings.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
        torch.manual_seed(3)
        model = type(model)(settings).eval()
        model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, PAD
        assert model.model.rotary_emb.rope_type == "dynamic"
    else:
        start = threading.Thread.start

        def refused(thread):
            if thread.name == "nxl_hooks-refill":
                raise RuntimeError("can't start new thread")
            start(thread)

        monkeypatch.setattr(threading.Thread, "start", refused)
    from nxl_hooks.hooks import generate

    refill, threads = generate.Generations.refill, []
    monkeypatch.setattr(generate.Generations, "refill",
                        lambda self, *args: threads.append(threading.current_thread().name) or refill(self, *args))
    with nxl.attach(model, layers="all") as probe:
        _static(model, ids, mask, config)
        assert probe.calls[0].complete  # (read while attached: nothing left waiting on a thread that never ran)
    assert threads == ["MainThread"] and probe.unrecorded is None, probe.unrecorded
    _check(model, probe.calls[0], 5)


def test_a_decoding_step_dynamo_runs_partly_eagerly_is_scored_with_its_own_logits():
    """Under ``set_stance("eager_on_recompile")`` a new length runs generate's compiled decoding steps eagerly but for
    the task model's hooks, which run as plain Python around them: those forwards never give the hooks their logits, so
    they are recorded as compiled ones (run again when the call ends), each step scored with its own forward's
    distribution: probabilities and contrastive scores equal the oracle, not the prefill's."""
    model = tiny.generating_llama(seed=3)
    ids, mask = _prompt()
    config = tiny.cpu_compile(backend="eager", dynamic=False)
    with nxl.attach(model, layers="all", methods=["contrastive"]) as probe:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                       cache_implementation="static", compile_config=config)
        with torch.compiler.set_stance("eager_on_recompile"):
            _static(model, ids, mask, config)
    assert probe.unrecorded is None
    call = probe.calls[-1]
    _check(model, call, 5)
    with nxl.attach(model, layers="all", methods=["contrastive"]) as eager:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, disable_compile=True)
    for step, expected in zip(call.steps, eager.calls[0].steps, strict=True):
        torch.testing.assert_close(step.scores["contrastive"], expected.scores["contrastive"], rtol=1e-4, atol=1e-5)


def test_attaching_again_does_not_recompile_generates_compiled_call():
    """Dynamo guards generate's compiled call on the ids of the probe's hooks that run on an exception too: they keep
    the id they first had on the model, so attaching again reuses the compiled code (a new id per attach recompiled
    it each time, and past dynamo's recompile_limit ran its steps partly eagerly)."""
    model = tiny.generating_llama(seed=3)
    ids, mask = _prompt()
    config = tiny.cpu_compile(backend="eager")
    calls = []
    for _ in range(3):
        with nxl.attach(model, layers="all") as probe:
            _static(model, ids, mask, config)
        assert not model._forward_hooks and not model.model._forward_hooks_always_called  # detached clean
        calls += probe.calls
    assert counters["stats"]["unique_graphs"] == 1
    for call in calls:  # (the oracle's output_hidden_states adds a hook of transformers' own to the blocks)
        _check(model, call, 5)


def test_a_compiled_calls_token_types_are_run_again_as_generate_extended_them():
    """GPT-2 generating with ``token_type_ids`` under generate's compiled call: the model run again over the call's
    tokens gets them too, as generate extends them (the last one repeated), so every step equals the oracle that
    passes them, and the same call run eagerly."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from oracle import layer_norm_decoder

    torch.manual_seed(7)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32)).eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, PAD
    ids = _prompt(length=7)[0]
    types = torch.zeros_like(ids)
    types[:, 4:] = 1  # two segments
    with nxl.attach(model, layers="all") as probe:
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=types,
                             max_new_tokens=4, do_sample=False, cache_implementation="static",
                             compile_config=tiny.cpu_compile(backend="eager"))
    (call,) = probe.calls
    assert call.error is None and torch.equal(call.sequences, out)
    extended = torch.cat([types, types[:, -1:].expand(-1, out.shape[1] - ids.shape[1])], dim=1)
    hand = layer_norm_decoder("transformer.ln_f")(model)
    for step in call.steps:
        n = step.position
        with torch.no_grad():
            run = model(input_ids=out[:, :n], token_type_ids=extended[:, :n], output_hidden_states=True)
        logits = hand.layer_logits(run.hidden_states)
        torch.testing.assert_close(step.normxlogit, normxlogit(logits, run.hidden_states[0], step.token)[1],
                                   rtol=1e-4, atol=1e-5)
        expected = run.logits[:, -1].log_softmax(-1).gather(-1, step.token[:, None])[:, 0].exp()
        torch.testing.assert_close(step.probability, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("how", ["backbone_before", "backbone_after", "blocks", "model_compile"])
def test_a_backbone_or_blocks_compiled_in_place_are_recorded_by_generate_and_a_plain_forward_says_why(how):
    """The backbone's forward compiled in place (before or after attaching), its blocks compiled one by one
    (transformers' regional compilation) or ``model.compile()`` after attaching: the backbone's hooks run eagerly
    around blocks that run compiled code, so a generate call is recorded from the model run again eagerly (each of
    those uncompiled for that run) when it returns, every step the oracle's; a plain forward whose blocks ran
    compiled says so and what to do."""
    model = tiny.generating_llama(seed=3)
    ids, mask = _prompt()
    if how == "backbone_before":
        model.model.forward = torch.compile(model.model.forward, backend="eager")
    with nxl.attach(model, layers="all") as probe:
        if how == "backbone_after":
            model.model.forward = torch.compile(model.model.forward, backend="eager")
        elif how == "blocks":
            for block in model.model.layers:
                block.compile(backend="eager")
        elif how == "model_compile":
            model.compile(backend="eager")
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        model(input_ids=ids[:1])
        try:
            plain = probe.result()
        except RuntimeError as error:
            plain = error
    vars(model.model).pop("forward", None)  # the oracle runs eagerly
    for module in (model, *model.model.layers):
        module._compiled_call_impl = None
    (call,) = probe.calls
    assert call.error is None, call.error
    _check(model, call, 3)
    if how == "model_compile":  # the task model's hooks traced too: recorded
        torch.testing.assert_close(plain.normxlogit, _plain_oracle(model, ids[:1]), rtol=1e-4, atol=1e-5)
    else:
        assert isinstance(plain, RuntimeError)
        assert "blocks ran code compiled" in str(plain) and "force_eager" in str(plain)


def test_a_compiled_calls_own_position_ids_are_run_again_as_generate_continued_them():
    """generate given the user's ``position_ids`` (gaps between tokens, two prompts, each repeated for
    ``num_return_sequences``) under its compiled call: the model run again over the call's tokens gets the user's
    positions for the prompt and last + 1, + 2, ... after it, as generate continues them, so every step equals the
    no-cache oracle run at those positions."""
    model = tiny.generating_llama(seed=5)
    with torch.no_grad():  # weights large enough that attention depends clearly on position
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(parameter.numel()))
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))  # no padding
    given = torch.stack([torch.arange(6) * 3, torch.arange(6) * 2 + 1])
    with nxl.attach(model, layers="all") as probe:
        out = model.generate(input_ids=ids, position_ids=given, max_new_tokens=4, do_sample=True,
                             num_return_sequences=2, cache_implementation="static",
                             compile_config=tiny.cpu_compile(backend="eager"))
    (call,) = probe.calls
    assert call.error is None and torch.equal(call.sequences, out) and len(call.steps) == 4
    prompt = given.repeat_interleave(2, dim=0)
    positions = torch.cat([prompt, prompt[:, -1:] + 1 + torch.arange(out.shape[1] - 6)], dim=1)
    hand = llama(model)
    for step in call.steps:
        n = step.position
        with torch.no_grad():
            # (a mask given: with none and no cache, transformers reads gaps in position_ids as packed sequences)
            run = model(input_ids=out[:, :n], attention_mask=torch.ones_like(out[:, :n]),
                        position_ids=positions[:, :n], output_hidden_states=True, use_cache=False)
        logits = hand.layer_logits(run.hidden_states)
        torch.testing.assert_close(step.normxlogit, normxlogit(logits, run.hidden_states[0], step.token)[1],
                                   rtol=1e-4, atol=1e-5)
        expected = run.logits[:, -1].log_softmax(-1).gather(-1, step.token[:, None])[:, 0].exp()
        torch.testing.assert_close(step.probability, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.version_free
def test_a_compiled_calls_records_stop_where_a_methods_failure_stops_them(monkeypatch):
    """A compiled call's steps, recorded when it returns by running the model again over them two positions at a
    time, whose method fails at step 2 alone (scored in the calling thread): the call keeps steps before it and none
    after (the later chunks still ran and their steps were kept, after an error saying the records had stopped),
    each kept one equal to the oracle."""
    from nxl_hooks.hooks import generate
    from nxl_hooks.method.protocol import Given, Method

    class AtEight(Method):
        name = "test_at_eight"
        description = "LogAt; raises for a context of 8 positions alone (tests/oracle/test_compiled.py)"
        pointwise = True

        def score(self, given: Given) -> torch.Tensor:
            if given.logat.shape[2] == 8:
                raise RuntimeError("context 8 refused")
            return given.logat.clone()

    monkeypatch.setattr(generate, "REFILL_POSITIONS", 2)
    model = tiny.generating_llama(seed=3)
    ids, mask = _prompt()  # 6 positions: step 2's context is 8
    with nxl.attach(model, methods=[AtEight()]) as probe:
        _static(model, ids, mask, tiny.cpu_compile(backend="eager"))
    (call,) = probe.calls
    kept = [step.step for step in call.steps]
    assert call.error == "attribution method 'test_at_eight' raised RuntimeError: context 8 refused"
    assert not call.complete
    assert kept == list(range(len(kept))) and len(kept) <= 2, kept
    check_steps(model, call)


def test_a_compiled_forward_that_continues_a_kv_cache_is_not_recorded_as_a_whole_sequence():
    """A plain forward compiled after attaching that continues a KV cache of the user's gets the checks of an eager
    one at its start: not recorded, saying why (its record would hold its one new token's context as the whole)."""
    model = tiny.generating_llama(seed=4)
    ids = _prompt(rows=1)[0]
    with nxl.attach(model, layers="all") as probe:
        model.forward = torch.compile(model.forward, fullgraph=True, backend="eager")
        out = model(input_ids=ids, use_cache=True)
        first = probe.result()
        model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values, use_cache=True)
        with pytest.raises(ValueError, match="continued a KV cache holding 6 positions"):
            probe.result()
    del model.forward  # the oracle runs eagerly
    _no_graph_breaks()
    torch.testing.assert_close(first.normxlogit, _plain_oracle(model, ids), rtol=1e-4, atol=1e-5)


def test_a_compiled_forward_is_the_result_of_the_thread_that_ran_it():
    """A model compiled after attaching keeps each thread's last forward for that thread's result: another thread's
    eager forward does not discard it, nor does another thread's compiled forward take its place."""
    model = tiny.generating_llama(seed=4)
    mine, theirs = _prompt(rows=1, length=9)[0], _prompt(rows=1, length=3)[0]
    other = torch.randint(1, VOCAB, mine.shape, generator=torch.Generator().manual_seed(8))
    got = {}
    with nxl.attach(model, layers="all") as probe:
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        compiled(input_ids=mine)

        def elsewhere():
            model(input_ids=theirs)
            got["eager"] = probe.result()
            compiled(input_ids=other)  # (the same shape: the same compiled code)
            got["compiled"] = probe.result()

        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
        result = probe.result()
    _no_graph_breaks()
    for record, ids in ((result, mine), (got["eager"], theirs), (got["compiled"], other)):
        torch.testing.assert_close(record.normxlogit, _plain_oracle(model, ids), rtol=1e-4, atol=1e-5)


def test_a_non_strict_export_of_an_attached_model_leaves_the_last_forwards_record():
    """torch.export (non-strict, torch's default) runs the hooks as Python on fake tensors: they keep nothing, and
    the result stays the last forward that ran."""
    model = tiny.generating_llama(seed=4)
    ids = _prompt(rows=1)[0]
    with nxl.attach(model, layers="all") as probe:
        model(input_ids=ids)
        torch.export.export(model, (), {"input_ids": ids, "use_cache": False}, strict=False)
        result = probe.result()
    assert type(result.normxlogit) is torch.Tensor
    torch.testing.assert_close(result.normxlogit, _plain_oracle(model, ids), rtol=1e-4, atol=1e-5)


def test_a_strict_export_of_an_attached_model_is_the_models_own_and_leaves_the_last_forwards_record():
    """torch.export(strict=True) traces the hooks with dynamo, which cannot trace the dispatch-mode query telling a
    non-strict export's fake tensors (it raised ``Unsupported`` into the export): the export succeeds, its program
    computes the model's own logits, and the result stays the last forward that ran."""
    model = tiny.generating_llama(seed=4)
    ids = _prompt(rows=1)[0]
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
        with nxl.attach(model, layers="all") as probe:
            model(input_ids=ids)
            program = torch.export.export(model, (), {"input_ids": ids, "use_cache": False}, strict=True)
            result = probe.result()
    torch.testing.assert_close(program.module()(input_ids=ids, use_cache=False).logits, plain, rtol=0, atol=0)
    torch.testing.assert_close(result.normxlogit, _plain_oracle(model, ids), rtol=1e-4, atol=1e-5)


def test_a_compiled_forward_is_assembled_at_detach_and_read_after_the_model_s_hooks_are_collected():
    """A model compiled after attaching: its last forward is assembled when the probe detaches, so its result is
    there after the ``with`` block, also once a collection has taken the recorder the hooks held."""
    import gc

    model = tiny.generating_llama(seed=4)
    ids = _prompt(rows=1)[0]
    with nxl.attach(model, layers="all") as probe:
        torch.compile(model, fullgraph=True, backend="eager")(input_ids=ids)
    gc.collect()
    torch.testing.assert_close(probe.result().normxlogit, _plain_oracle(model, ids), rtol=1e-4, atol=1e-5)


def test_generates_compiled_call_runs_attached_under_fail_on_recompile():
    """transformers' compiled call of ``generate`` runs the task model's hooks from torch's eager ``Module.__call__``:
    dynamo compiled each as a frame of its own, guarded on the probe's state, and recompiled it at a later call,
    raising into ``generate`` under ``set_stance("fail_on_recompile")``. Those hooks run eagerly there now: the call
    runs the compiled code it had before attaching, and is recorded."""
    model = tiny.generating_llama(seed=3)
    ids, mask = _prompt()
    config = tiny.cpu_compile(backend="eager")
    plain = _static(model, ids, mask, config)
    with torch.compiler.set_stance("fail_on_recompile"):
        with nxl.attach(model, layers="all") as probe:
            for _ in range(2):
                assert torch.equal(_static(model, ids, mask, config), plain)
    assert probe.unrecorded is None and len(probe.calls) == 2
    for call in probe.calls:
        _check(model, call, 5)


@pytest.mark.parametrize("stance", ["fail_on_recompile", "eager_on_recompile"])
def test_a_forward_compiled_in_place_keeps_its_code_under_a_stance_that_forbids_recompiling(stance):
    """Attaching drops a forward's compiled code so that it recompiles with the hooks; under a stance that forbids
    recompiling, that made the next call raise (``fail_on_recompile``) or run eagerly from then on, also after
    detach (``eager_on_recompile``). The code stays now: the forward runs it, and its result says it was not
    recorded."""
    model = tiny.generating_llama(seed=4)
    ids = _prompt(rows=1)[0]
    model.forward = torch.compile(model.forward, backend="eager")
    before = model(input_ids=ids).logits
    graphs = counters["stats"]["unique_graphs"]
    with torch.compiler.set_stance(stance):
        with nxl.attach(model, layers="all") as probe:
            torch.testing.assert_close(model(input_ids=ids).logits, before)
            with pytest.raises(RuntimeError, match="never reached the probe's hooks"):
                probe.result()
        torch.testing.assert_close(model(input_ids=ids).logits, before)
    assert counters["stats"]["unique_graphs"] == graphs  # its compiled code ran throughout, never compiled again


def test_result_after_generate_is_not_a_forward_traced_before_it():
    """A forward of a compiled function of the user's (the task model's hooks traced) is kept for the thread's
    result; a generate call after it is the last call, so result() says where that call's records are, not the
    traced forward's record; the next compiled forward is the result again."""
    model = tiny.generating_llama(seed=4)
    ids = _prompt(rows=1)[0]
    with torch.no_grad(), nxl.attach(model, layers="all") as probe:
        run = torch.compile(lambda tokens: model(input_ids=tokens), fullgraph=True, backend="eager")
        run(ids)
        model.generate(input_ids=ids, max_new_tokens=2, do_sample=False)
        with pytest.raises(RuntimeError, match="recorded generate call.*probe.steps"):
            probe.result()
        run(ids)
        torch.testing.assert_close(probe.result().normxlogit, _plain_oracle(model, ids), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("how", ["forward", "model"])
def test_a_compiled_forward_given_logits_to_keep_indices_reads_each_row_at_its_position(how):
    """``logits_to_keep`` as indices naming every position, in reverse: the compiled forward's logit row j is
    position ``keep[j]``'s (the last position's is row 0), as in an eager forward, whether the task model's hooks ran
    eagerly around a forward compiled in place or were traced with it (a compiled model object)."""
    model = tiny.generating_llama(seed=4)
    ids = _prompt(rows=1)[0]
    keep = torch.arange(ids.shape[1] - 1, -1, -1)
    with nxl.attach(model, layers="all") as probe:
        if how == "forward":
            model.forward = torch.compile(model.forward, fullgraph=True, backend="eager")
            compiled = model
        else:
            compiled = torch.compile(model, fullgraph=True, backend="eager")
        compiled(input_ids=ids, logits_to_keep=keep)
        result = probe.result()
    vars(model).pop("forward", None)
    _no_graph_breaks()
    with torch.no_grad():
        own = model(input_ids=ids).logits[:, -1]
    assert torch.equal(result.target, own.argmax(-1))
    torch.testing.assert_close(result.normxlogit, _plain_oracle(model, ids), rtol=1e-4, atol=1e-5)


def test_a_compiled_forward_of_a_scaled_16_bit_embedding_has_the_norms_of_its_raw_rows():
    """A Gemma embedding multiplies its rows by √d inside the module (√48: not a power of two, which would round
    nothing): the norms are of its raw rows, read from its weight by the ids it was given as in an eager forward, not
    its bf16 output divided back (up to 1e-3 off)."""
    from transformers import GemmaConfig, GemmaForCausalLM

    torch.manual_seed(0)
    model = GemmaForCausalLM(GemmaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=32))
    model = model.eval().to(torch.bfloat16)
    ids = _prompt(rows=1, length=12)[0]
    with nxl.attach(model, layers="all", embedding="word") as probe:
        model.forward = torch.compile(model.forward, fullgraph=True, backend="eager")
        model(input_ids=ids)
        result = probe.result()
    del model.forward
    _no_graph_breaks()
    raw = model.model.embed_tokens.weight.detach()[ids].float()
    torch.testing.assert_close(result.embed_norm, torch.linalg.vector_norm(raw, dim=-1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_hook_of_the_users_changing_a_blocks_output_in_a_compiled_forward_is_said_not_recorded(backend):
    """A forward hook of the user's registered after attaching runs after the probe's, inside the compiled graph as
    in an eager forward: one that replaces a block's output makes the forward unrecorded, said; one that only reads
    it, or gives a copy of it (the same values in other memory), leaves it recorded, equal to the oracle."""
    model = tiny.generating_llama(seed=4)
    ids = _prompt(rows=1)[0]
    block = model.model.layers[0]
    recorded = []
    with nxl.attach(model, layers="all") as probe:
        model.forward = torch.compile(model.forward, fullgraph=True, backend=backend)
        for hook in (lambda module, args, output: None, lambda module, args, output: output.clone()):
            kept = block.register_forward_hook(hook)
            model(input_ids=ids)
            recorded.append(probe.result())
            kept.remove()
            torch._dynamo.reset()  # (dynamo does not guard on hooks: the next compile must see the new one)
        changing = block.register_forward_hook(lambda module, args, output: output * 2)
        model(input_ids=ids)
        with pytest.raises(RuntimeError, match="a hook changed block 1's output .* register such a hook before"):
            probe.result()
        changing.remove()
    del model.forward
    _no_graph_breaks()
    for record in recorded:
        torch.testing.assert_close(record.normxlogit, _plain_oracle(model, ids), rtol=1e-4, atol=1e-5)
