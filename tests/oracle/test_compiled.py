"""Compiled code recorded (issue 25): transformers' own compiled static-cache generate (inductor, on the CPU with
``_compile_all_devices``), a user's ``torch.compile(..., fullgraph=True)`` after attaching, a forward compiled in
place before attaching, and a compiled model object; every step against the no-cache oracle, dynamo's counters
showing no graph break, a recorded call's compiled code the model's own, operation for operation, and the model's
compiled code as it was after detach."""

import copy

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig

import nxl_hooks as nxl
from nxl_hooks.hooks import forward
import tiny
from oracle import check_call, full_mask, llama, normxlogit, prefix_logits

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


def test_generate_compiled_by_transformers_is_recorded_step_by_step(monkeypatch):
    """Its steps are recorded when it returns, from the model run again over the positions after the prompt only,
    against what the call's cache holds of the prompt (its eager forward's keys and values)."""
    from nxl_hooks.hooks import generate

    refill, runs = generate.Generations.refill, []

    def counted(self, ids, mask, positions, keep, cache, start):
        out = refill(self, ids, mask, positions, keep, cache, start)
        runs.append((ids.shape[1], start, out[0].shape))
        return out

    monkeypatch.setattr(generate.Generations, "refill", counted)
    model = tiny.generating_llama(seed=3)
    ids, mask = _prompt()
    config = CompileConfig()  # inductor, as generate compiles on a GPU
    config._compile_all_devices = True
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
    config = CompileConfig(backend="eager")
    config._compile_all_devices = True
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


def test_every_step_of_a_compiled_call_is_scored_with_the_models_own_distribution(monkeypatch):
    """A compiled call's steps are recorded from the model run again over its tokens, with the whole distribution at
    each: contrastive (whose foil is the model's best other output) equals the oracle at every step, not only the
    last; here run again two positions at a time, each chunk against the cache the one before grew."""
    from nxl_hooks.hooks import generate

    monkeypatch.setattr(generate, "REFILL_POSITIONS", 2)
    model = tiny.generating_llama(seed=3)
    ids, mask = _prompt()
    config = CompileConfig()
    config._compile_all_devices = True
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
    import threading

    from nxl_hooks.hooks import generate

    monkeypatch.setattr(generate, "SCORED_ELSEWHERE", generate.SCORED_ELSEWHERE | {"cpu"})
    model = tiny.generating_llama(seed=3)
    first, mask = _prompt()
    second = torch.where(mask.bool(), torch.randint(1, VOCAB, first.shape, generator=torch.Generator().manual_seed(6)),
                         PAD)
    config = CompileConfig()
    config._compile_all_devices = True
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
    config = CompileConfig(backend=kept)
    config._compile_all_devices = True
    plain = _static(model, ids, mask, config)
    torch._dynamo.reset()  # the twin's compiled call is traced anew (dynamo would reuse the plain one's code)
    with nxl.attach(twin, layers="all", embedding=embedding) as probe:
        assert torch.equal(_static(twin, ids, mask, config), plain)
    before, after = kept.graphs  # the plain model's compiled call, then its attached twin's
    assert kept.reductions(before) >= 2 * model.config.num_hidden_layers  # the model's own norms are counted
    assert kept.operations(after) == kept.operations(before)
    assert probe.unrecorded is None
    _check(twin, probe.calls[0], 5)
