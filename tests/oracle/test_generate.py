"""Attribution during generate(): every step against an oracle that re-runs the whole prefix without a cache."""

import copy
import functools
import inspect
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import DynamicCache, GenerationConfig, LlamaForCausalLM
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import nxl_hooks as nxl
import tiny
from nxl_hooks.hooks import forward, generate
from nxl_hooks.hooks.generate import BATCH_STEPS
from nxl_hooks.method import head as nxl_head
from oracle import (HandHead, check_call, check_steps, full_mask, llama, normxlogit, prefix_logits, rms_norm,
                    state_space)

VOCAB, PAD = tiny.GEN_VOCAB, tiny.GEN_PAD


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny.generating_llama()


def test_greedy_every_step_matches_oracle_and_output_unchanged(model):
    ids = torch.randint(1, VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    plain = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    emitted = plain[0, 7:].tolist()  # no token repeats the one before: explaining the previous token would fail
    assert all(a != b for a, b in zip(emitted, emitted[1:]))
    with nxl.attach(model, layers="all") as probe:
        out = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    torch.testing.assert_close(out, plain, rtol=0, atol=0)
    assert not {"generate", "_get_stopping_criteria", "_get_logits_processor", "heal_tokens"} & set(vars(model))
    argmaxes = check_call(model, probe.calls[0], 6)
    assert all(torch.equal(a, s.token) for a, s in zip(argmaxes, probe.steps))
    assert probe.steps[0].normxlogit.shape == (4, 1, 7) and probe.steps[-1].normxlogit.shape == (4, 1, 12)
    assert all(step.mask.all() and step.active.all() for step in probe.steps)


def test_a_prompt_longer_than_a_head_chunk_has_its_features_taken_in_chunks_equal_to_the_oracle(model, monkeypatch):
    """The prefill's features go through the head a chunk of positions at a time (:data:`HEAD_CHUNK`: bounded
    temporaries over a long prompt); every step, each reading the whole prompt, equals the oracle."""
    monkeypatch.setattr(forward, "HEAD_CHUNK", 3)  # a 7-token prompt: three chunks, the last one short
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(8))
    with nxl.attach(model, layers="all") as probe:
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    check_call(model, probe.calls[0], 4)


@pytest.mark.parametrize("target", [{}, {"target": "predicted"}], ids=["default", "predicted"])
def test_sampling_explains_the_sampled_token_with_num_return_sequences(model, target):
    """target="predicted" in generate is the token it emitted, as the docs say: the sampled one, not the argmax."""
    ids = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(3)
    with nxl.attach(model, layers=[0, 2, -1], **target) as probe:
        out = model.generate(input_ids=ids, max_new_tokens=8, do_sample=True, temperature=3.0, top_k=0,
                             num_return_sequences=2)
    call = probe.calls[0]
    assert call.sequences.shape[0] == 2 and probe.steps[0].normxlogit.shape == (3, 2, 5)
    hand = llama(model)
    for step in call.steps:  # the selected layers are rows 0, 2, 3 of the oracle's L+1
        assert torch.equal(step.target, out[:, step.position]) and torch.equal(step.token, step.target)
        logits, embeddings = prefix_logits(model, hand, call.sequences[:, : step.position],
                                           torch.ones(2, step.position, dtype=torch.bool))
        _, expected = normxlogit(logits, embeddings, step.token)
        torch.testing.assert_close(step.normxlogit, expected[[0, 2, 3]], rtol=1e-4, atol=1e-4)
    argmaxes = torch.stack([prefix_logits(model, hand, call.sequences[:, : s.position],
                                          torch.ones(2, s.position, dtype=torch.bool))[0][-1, :, -1].argmax(-1)
                            for s in call.steps])
    tokens = torch.stack([s.token for s in call.steps])
    assert (argmaxes != tokens).any(), "sampling at temperature 3 should leave the argmax at least once"


class _StopsOn(StoppingCriteria):
    """The user's own criterion: a row is done once it emits ``token`` (as 0/1 integers: ``ints``)."""

    def __init__(self, token: int, ints: bool = False) -> None:
        self.token, self.ints = token, ints

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        done = input_ids[:, -1] == self.token
        return done.long() if self.ints else done


def _word_tokenizer():
    """One word per id of the generating model's: "[PAD]" at 0, "w1".."w99" (no word ends another's text), then
    "[UNK]" and "abcdef" (StopStringCriteria reads each word's text as it follows that one)."""
    return tiny.word_tokenizer(["[PAD]"] + [f"w{i}" for i in range(1, VOCAB)] + ["[UNK]", "abcdef"])


@pytest.mark.parametrize("cache, stop", [("dynamic", "eos"), ("static", "eos"), ("compiled", "eos"),
                                         ("dynamic", "eos of the model"), ("dynamic", "stop string"),
                                         ("compiled", "stop string"), ("static", "criterion"),
                                         ("dynamic", "criterion giving ints"), ("dynamic", "criterion without eos"),
                                         ("dynamic", "eos of the model turned off")])
def test_left_padded_batch_with_a_row_that_stops_early(model, cache, stop, monkeypatch):
    """Pads masked at every step: with a static cache generate hands the backbone a 4-D mask (batch, 1, q, keys)
    instead of the 2-D one, and its padding must be read from that (it once counted pads as real tokens).
    Compiled, the decoding steps are recorded all at once when the call ends, from the model run again over its
    tokens: which rows are still active at each step must say the same. A row stops at its EOS, which may be the
    model's own under a generation config of the call's that leaves it unset (generate then takes the model's); or
    at a stop string or the user's own criterion, after which generate pads it as after an EOS (they were recorded
    as active, their pads as context; a criterion giving 0/1 integers lost the call's records). Without any EOS
    id generate pads nothing: the row goes on, active (the model's own EOS turned off by the call's
    ``eos_token_id=None`` was still taken for one)."""
    options = {"cache_implementation": "static"} if cache != "dynamic" else {}
    if cache == "compiled":
        options["compile_config"] = tiny.cpu_compile(backend="eager")
        torch._dynamo.reset()
        counters.clear()
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 6, dtype=torch.long)
    ids[0, :2], mask[0, :2] = PAD, 0  # row 0: two left pads
    reference = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)[:, 6:]
    # The stop: a token row 0 emits at step s, that row 1 never emits, so row 0 stops early and row 1 goes on.
    s, token = next((s, int(t)) for s, t in enumerate(reference[0, 1:-1].tolist(), start=1)
                    if t not in reference[1].tolist() and t not in reference[0, :s].tolist())
    never = next(t for t in range(1, VOCAB) if t not in reference.tolist()[0] + reference.tolist()[1])
    options.update(max_new_tokens=8, do_sample=False, eos_token_id=token if stop == "eos" else never)
    if stop == "eos of the model":
        del options["max_new_tokens"], options["do_sample"], options["eos_token_id"]
        monkeypatch.setattr(model.generation_config, "eos_token_id", token)
        options["generation_config"] = GenerationConfig(max_new_tokens=8, do_sample=False)
    elif stop == "stop string":
        options.update(stop_strings=f"w{token}", tokenizer=_word_tokenizer())
    elif stop.startswith("criterion"):
        options["stopping_criteria"] = StoppingCriteriaList([_StopsOn(token, ints=stop.endswith("ints"))])
        if stop == "criterion without eos":
            del options["eos_token_id"]
    elif stop == "eos of the model turned off":
        monkeypatch.setattr(model.generation_config, "eos_token_id", token)
        options["eos_token_id"] = None
    with nxl.attach(model) as probe:
        out = model.generate(input_ids=ids, attention_mask=mask, **options)
    if cache == "compiled":  # its decoding steps ran compiled, and were recorded when the call ended
        assert counters["stats"]["unique_graphs"] >= 1 and probe.unrecorded is None
        torch._dynamo.reset()
    call = probe.calls[0]
    check_call(model, call, out.shape[1] - 6)
    padded = stop not in ("criterion without eos", "eos of the model turned off")
    if not padded:  # generate stopped nothing: the row's tokens are the ones it emitted unstopped
        torch.testing.assert_close(out[:, 6:], reference, rtol=0, atol=0)
    for step in call.steps:
        assert not step.mask[0, :2].any() and step.mask[1].all()  # left pads masked; row 1 always real
        assert bool(step.active[0]) == (step.step <= s or not padded)  # active up to and including its stop
        assert step.mask[0, 2:].all() == (step.position <= 6 + s + 1 or not padded)  # pads after it masked
        assert bool(step.active[1])
        if step.step > s and padded:
            assert int(step.token[0]) == PAD
    assert int(call.steps[s].token[0]) == token


class _Clock(LogitsProcessor):
    """When generate chose each token: it calls its processors once per token, after the forward that predicts it."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.time())
        return scores


def test_steps_scored_together_equal_the_oracle_and_keep_their_tokens_times(model):
    """While nothing reads the records live, steps wait and are scored BATCH_STEPS at a time: over two batches and
    the call's end, a left-padded batch's every step equals the oracle and the same step made live (on_step); each
    record's time is its token's, not its batch's."""
    new = BATCH_STEPS + 5
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(11))
    mask = torch.ones(2, 6, dtype=torch.long)
    ids[0, :3], mask[0, :3] = PAD, 0
    clock = _Clock()
    options = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    with nxl.attach(model, layers="all") as probe:
        model.generate(**options, logits_processor=LogitsProcessorList([clock]))
    call = probe.calls[0]
    check_call(model, call, new)
    made = clock.times  # token i was chosen at made[i]; its record is made once the next forward has it
    assert len(made) == new and all(made[i] <= s.time <= made[i + 1] for i, s in enumerate(call.steps[:-1]))
    live = []
    with nxl.attach(model, layers="all", on_step=live.append):
        model.generate(**options)
    assert len(live) == new
    for together, alone in zip(call.steps, live):
        assert torch.equal(together.token, alone.token) and torch.equal(together.mask, alone.mask)
        torch.testing.assert_close(together.normxlogit, alone.normxlogit)
        torch.testing.assert_close(together.logat, alone.logat)
        torch.testing.assert_close(together.probability, alone.probability)


class _Collect(BaseStreamer):
    def __init__(self) -> None:
        self.puts: list[torch.Tensor] = []

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.clone())

    def end(self) -> None:
        self.puts.append(None)


def test_streamer_and_two_calls_grouped(model):
    first = torch.randint(1, VOCAB, (1, 4), generator=torch.Generator().manual_seed(5))
    second = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(6))
    streamer = _Collect()
    with nxl.attach(model) as probe:
        model.generate(input_ids=first, max_new_tokens=3, do_sample=False, streamer=streamer)
        model.generate(input_ids=second, max_new_tokens=5, do_sample=False)
    assert [c.index for c in probe.calls] == [0, 1] and probe.steps is probe.calls[1].steps
    check_call(model, probe.calls[0], 3)
    check_call(model, probe.calls[1], 5)
    streamed = torch.cat([p.view(-1) for p in streamer.puts[1:-1]])  # puts: prompt, each token, end
    assert streamed.tolist() == [int(s.token) for s in probe.calls[0].steps]
    assert all(s.call == 1 for s in probe.steps)


def test_no_cache_generate_and_lower_precision_cache(model):
    ids = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(7))
    with nxl.attach(model) as probe:
        model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, use_cache=False)
    check_call(model, probe.calls[0], 4)
    with nxl.attach(model, cache_dtype=torch.bfloat16, cache_device="cpu") as low:
        model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    for exact, rough in zip(probe.steps, low.steps):
        torch.testing.assert_close(rough.normxlogit, exact.normxlogit, rtol=3e-2, atol=3e-2)


class _LookAhead(LogitsProcessor):
    """The user's processor that runs the model itself, as classifier-free guidance's does: on the sequence with the
    current argmax appended (one token longer, from position 0: what a call without a KV cache runs)."""

    def __init__(self, model) -> None:
        self.model = model

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.model(torch.cat([input_ids, scores.argmax(-1, keepdim=True)], 1))
        return scores


@pytest.mark.parametrize("how", ["guidance", "negative_prompt", "user_processor"])
def test_logits_processors_that_run_the_model_leave_the_record_to_the_calls_own_forwards(model, how):
    """Classifier-free guidance (``guidance_scale``, with a negative prompt one token longer than the prompt, too)
    and a processor of the user's run the model inside the call on other ids: the call is recorded all the same,
    every step explaining the token generate emitted from the call's own (conditional) forward, its probability the
    model's own there, all against the no-cache oracle; the output is the one it has unattached."""
    ids = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(8))
    options = dict(input_ids=ids, max_new_tokens=4, do_sample=False)
    if how == "user_processor":
        options.update(logits_processor=LogitsProcessorList([_LookAhead(model)]), repetition_penalty=5.0)
    else:
        options.update(guidance_scale=1.5)
    if how == "negative_prompt":
        options.update(negative_prompt_ids=torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(9)))
    plain = model.generate(**options)
    with nxl.attach(model, layers="all") as probe:
        out = model.generate(**options)
    (call,) = probe.calls
    assert torch.equal(out, plain) and call.error is None
    check_call(model, call, 4)
    for step in call.steps:
        with torch.no_grad():
            logits = model(input_ids=out[:, :step.position]).logits[:, -1]
        expected = logits.log_softmax(-1).gather(-1, step.token[:, None])[:, 0].exp()
        torch.testing.assert_close(step.probability, expected, rtol=1e-4, atol=1e-6)


class _Peeks(StoppingCriteria):
    """The user's criterion that runs the model on other ids, one token longer than the call's: a forward the
    record cannot tell from a step of a call without a KV cache."""

    def __init__(self, model) -> None:
        self.model = model

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        with torch.no_grad():
            self.model((input_ids + 1) % VOCAB)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_a_forward_from_position_0_on_other_ids_inside_the_call_is_said_and_never_recorded_as_a_step(model):
    """A stopping criterion of the user's runs the model on ids one token longer than the record, which are not
    the call's: never taken for a recomputing step (its token as the emitted one), the call says why it is not
    recorded from there."""
    ids = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(8))
    with nxl.attach(model, layers="all") as probe:
        out = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False,
                             stopping_criteria=StoppingCriteriaList([_Peeks(model)]))
    (call,) = probe.calls
    assert all(torch.equal(step.token, out[:, step.position]) for step in call.steps)
    assert "other token ids than the call's" in call.error and call.error in probe.unrecorded


class _ScoresItsEnd(StoppingCriteria):
    """The user's criterion that, once the call holds ``length`` tokens, runs the model on its last ``last`` ids
    alone (a score of its own): a forward from position 0, on other ids than the prompt's there."""

    def __init__(self, model, length: int, last: int) -> None:
        self.model, self.length, self.last = model, length, last

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        if input_ids.shape[1] == self.length:
            with torch.no_grad():
                self.model(input_ids[:, -self.last:])
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.parametrize("last", [2, 8])
def test_a_forward_on_ids_of_its_own_inside_the_call_keeps_the_steps_made_before_it(model, last):
    """A stopping criterion of the user's runs the model on the last 2 (or 8: past the 5-token prompt) ids alone
    after the call's fourth token: the record stopped there, as documented, but dropped the steps made before it too
    (its forward from position 0 was taken for the call running its tokens again), those not handed on yet. The
    call never changes its prompt, so a forward that runs other ids there undoes none of its tokens: the three steps
    its own forwards completed are kept, each equal to the oracle, and the error says what ran."""
    ids = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(8))
    plain = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    with nxl.attach(model, layers="all") as probe:
        out = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False,
                             stopping_criteria=StoppingCriteriaList([_ScoresItsEnd(model, 5 + 4, last)]))
    (call,) = probe.calls
    assert torch.equal(out, plain) and not call.complete
    assert [step.step for step in call.steps] == [0, 1, 2]
    check_steps(model, call)
    assert call.error.startswith(f"a forward of this call ran positions 0..{last - 1} on other token ids than the "
                                 "call's prompt")
    assert call.error in probe.unrecorded


class _GeneratesToo(BaseStreamer, LogitsProcessor):
    """The user's streamer, or logits processor, that at the call's second token runs a generate call of its own on
    other ids."""

    def __init__(self, model, ids: torch.Tensor) -> None:
        self.model, self.ids, self.seen, self.out = model, ids, 0, None

    def put(self, value):  # the prompt, then each token
        self._generates_at(3)

    def end(self):
        pass

    def __call__(self, input_ids, scores):  # as each token is chosen
        self._generates_at(2)
        return scores

    def _generates_at(self, seen: int) -> None:
        self.seen += 1
        if self.seen == seen:
            self.out = self.model.generate(input_ids=self.ids, max_new_tokens=3, do_sample=False)


@pytest.mark.parametrize("live", [False, True], ids=["scored-together", "on_step"])
@pytest.mark.parametrize("where", ["streamer", "logits_processor"])
def test_a_generate_call_made_inside_a_recorded_one_is_a_call_of_its_own_and_both_are_recorded(model, tmp_path,
                                                                                                where, live):
    """A generate call from inside another (the user's streamer or logits processor) is recorded as its own call:
    its forwards were the outer call's, which then ended unrecorded saying a cropped cache (or, from a logits
    processor, ran unrecorded), and the inner call was in no record."""
    ids = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(21))
    other = torch.randint(1, VOCAB, (1, 4), generator=torch.Generator().manual_seed(22))
    plain, plain_other = (model.generate(input_ids=i, max_new_tokens=n, do_sample=False) for i, n in
                          ((ids, 6), (other, 3)))
    user, path = _GeneratesToo(model, other), tmp_path / "run.nxl"
    given = {"streamer": user} if where == "streamer" else {"logits_processor": LogitsProcessorList([user])}
    with nxl.attach(model, layers="all", sink=path, on_step=(lambda step: None) if live else None) as probe:
        out = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, **given)
    assert torch.equal(out, plain) and torch.equal(user.out, plain_other)
    assert probe.unrecorded is None
    for calls in (probe.calls, nxl.read_stream(path)):  # in memory and read back
        outer, inner = sorted(calls, key=lambda call: -call.prompt_ids.shape[1])
        assert torch.equal(outer.sequences, plain) and torch.equal(inner.sequences, plain_other)
        check_call(model, outer, 6)
        check_call(model, inner, 3)


def test_token_healing_is_recorded_from_the_healed_prompt():
    """generate(token_healing=True) first runs generate on each prompt less its last token, which it replaces by
    the token it picks there: those forwards are no step of the call. They were taken for its first, so the call's
    own prefill, from position 0 again, was said not recorded ("several candidate tokens per forward")."""
    model = tiny.generating_llama()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # logits far apart: healing replaces 'w1' (the +1 its own token gets is small)
    tokenizer = _word_tokenizer()
    tokenizer.bos_token = "[UNK]"  # healing replaces a bos by the pad token: it needs one
    ids = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    ids[:, -1] = 1  # 'w1', which w10..w19 extend
    with nxl.attach(model, layers="all") as probe:
        out = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, token_healing=True, tokenizer=tokenizer)
    assert (out[:, 5] != 1).all() and torch.equal(out[:, :5], ids[:, :5])  # healed: the last prompt token replaced
    (call,) = probe.calls
    assert call.error is None and torch.equal(call.sequences, out)
    check_call(model, call, 4)  # every step against the oracle of generate's output, the healed prompt included


def _looks_ahead(model, input_ids, generation_config, *, how, **kwargs):
    """A ``custom_generate`` loop (contrastive search's shape) that runs its two best candidates on a copy of the
    cache, then emits the runner-up: the lookahead forward's token (the argmax, or both as rows of their own: ``how``
    "rows") is one the call never returns. "again": the runner-up runs next at that position; "last": the last one
    is returned unrun (as generate's is), the loop before it greedy."""
    keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = DynamicCache(config=model.config)
    out, sequence = model(input_ids=input_ids, use_cache=True, **{keyword: cache}), input_ids
    for left in reversed(range(generation_config.max_new_tokens)):
        top2 = out.logits[:, -1].topk(2).indices
        if how != "last" or not left:
            ahead = copy.deepcopy(cache)
            if how == "rows":
                ahead.batch_repeat_interleave(2)
            model(input_ids=top2.reshape(-1, 1) if how == "rows" else top2[:, :1], use_cache=True, **{keyword: ahead})
        chosen = top2[:, :1] if how == "last" and left else top2[:, 1:]
        sequence = torch.cat([sequence, chosen], 1)
        if left:
            out = model(input_ids=chosen, use_cache=True, **{keyword: cache})
    return sequence


@pytest.mark.parametrize("how, live, said", [
    ("again", False, "cropped cache"), ("again", True, "the records of steps 0..0, handed on already"),
    ("last", False, "the token step 2 of this call was recorded with is not the one generate returned"),
    ("last", True, "the records of steps 2..2, handed on already, are of those tokens"),
    ("rows", False, "ran 2 rows while its record holds 1")])
def test_a_lookahead_forward_whose_token_the_call_undid_never_records_it_unsaid(model, how, live, said):
    """A custom loop looks ahead with a candidate token, then emits another: the lookahead's start completed a step
    with the candidate, which was published as the call's, its token never returned, said nowhere when no forward
    followed. Now it is dropped where still held (the call's error says where its records stop), and named in that
    error where a live reader got it already."""
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    with nxl.attach(model, layers="all", on_step=(lambda step: None) if live else None) as probe:
        out = model.generate(input_ids=ids, max_new_tokens=3, custom_generate=functools.partial(_looks_ahead, how=how))
    (call,) = probe.calls
    wrong = [step.position for step in call.steps if not torch.equal(step.token, out[:, step.position])]
    assert wrong == ([6 if how == "again" else 8] if live else [])
    assert said in call.error and call.error in probe.unrecorded


def _runs_its_prompt_again(model, input_ids, generation_config, **kwargs):
    """A ``custom_generate`` loop that crops its cache back into the prompt and runs the prompt's end again."""
    keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = DynamicCache(config=model.config)
    model(input_ids=input_ids, use_cache=True, **{keyword: cache})
    cache.crop(-3)  # (its last 3 positions dropped)
    out = model(input_ids=input_ids[:, 3:], use_cache=True, **{keyword: cache})
    return torch.cat([input_ids, out.logits[:, -1:].argmax(-1)], 1)


@pytest.mark.parametrize("live", [False, True])
def test_a_forward_back_inside_the_prompt_names_no_steps_handed_on(model, live):
    """A forward that runs the prompt's end again, before any step was made, stops the record: its error named
    "the records of steps 0..-1, handed on already" (a range of none, as if some had been)."""
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    with nxl.attach(model, on_step=(lambda step: None) if live else None) as probe:
        model.generate(input_ids=ids, max_new_tokens=1, custom_generate=_runs_its_prompt_again)
    (call,) = probe.calls
    assert not call.steps and call.error.startswith("a forward of this call ran positions 3..5 (from its cache)")
    assert "handed on" not in call.error and call.error.endswith(
        "(several candidate tokens per forward, a cropped cache, or the model run inside the call on the call's own "
        "tokens, by a stopping criterion or a streamer: run it outside generate)")


def test_a_stopping_criterion_that_runs_the_model_on_the_calls_own_prompt_is_named_as_a_possible_reason(model):
    """A stopping criterion that runs the model on the call's prompt, without a cache, stopped the record saying the
    forward's positions came "from its no cache" and that it was several candidate tokens or a cropped cache: the
    reason says it had no cache and names the model run inside the call by a stopping criterion or a streamer."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    ids = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(8))

    class Reruns(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            model(input_ids=ids[:, :3], use_cache=False)  # the prompt's first tokens again, the call's own
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    plain = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, pad_token_id=PAD)
    with nxl.attach(model) as probe:
        out = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, pad_token_id=PAD,
                             stopping_criteria=StoppingCriteriaList([Reruns()]))
    assert torch.equal(out, plain)
    (call,) = probe.calls
    assert not call.complete and "(it had no cache)" in call.error and "from its no cache" not in call.error
    assert "by a stopping criterion or a streamer: run it outside generate" in call.error


def _stopping(stop: str, token: int) -> dict:
    """generate's settings that stop a beam at ``token``, as ``stop`` says: its EOS id (also its pad id), or the
    user's criterion."""
    if stop.startswith("criterion"):
        return {"stopping_criteria": StoppingCriteriaList([_StopsOn(token)])}
    return {"eos_token_id": token, **({"pad_token_id": token} if stop.endswith("pad id") else {})}


def _finished_early(model, options: dict, stops: list[int], stop: str) -> tuple[torch.Tensor, int]:
    """The plain output of a beam search ``options`` and its stop token: the first of ``stops`` that, stopping it as
    ``stop`` says (:func:`_stopping`), ends at least one returned sequence early while another runs to the end."""
    for token in stops:
        out = model.generate(**options, **_stopping(stop, token))
        generated = out[:, options["input_ids"].shape[1]:]
        ended = (generated[:, :-1] == token).any(-1)
        if ended.any() and not ended.all() and generated.shape[1] == options["max_new_tokens"]:
            return out, token
    raise AssertionError("no stop token ends one returned beam early and leaves another running")


@pytest.mark.parametrize("stop", ["eos", "eos, also the pad id", "criterion, filled with the pad id",
                                  "criterion, no eos"])
def test_beam_search_records_every_returned_sequence_equal_to_the_oracle(model, stop):
    """Beam search (it was refused: beams are reordered and pruned between steps) is recorded when the call returns,
    from the model run again over the sequences it returned: every step of every returned sequence (two per prompt,
    a left-padded batch) equals the no-cache oracle of that sequence, the output is the unrecorded one, and a
    sequence that finished early is active up to its last token (its EOS unmasked, also where the EOS is the pad
    id: it was read as filler) and not over what generate filled it with after, whether an EOS id ended it (filled
    with that id), or the user's criterion, filled with the pad id, or with -1 where the call has no EOS id
    (recorded as id 0 there)."""
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 6, dtype=torch.long)
    ids[0, :2], mask[0, :2] = PAD, 0
    options = dict(input_ids=ids, attention_mask=mask, max_new_tokens=7, num_beams=3, num_return_sequences=2,
                   do_sample=False)
    free = model.generate(**options)[:, 6:]
    stops = sorted(set(free[:, 1:-1].reshape(-1).tolist()))
    unused = [t for t in range(1, VOCAB) if t not in free.reshape(-1).tolist()]
    if stop == "criterion, filled with the pad id":  # (generate fills with an EOS id where the pad id is 0)
        options.update(eos_token_id=unused[0], pad_token_id=unused[1])
    plain, token = _finished_early(model, options, stops, stop)
    options.update(_stopping(stop, token))
    with nxl.attach(model, layers="all") as probe:
        out = model.generate(**options)
    assert torch.equal(out, plain)
    (call,) = probe.calls
    assert call.error is None and torch.equal(call.sequences, plain) and call.prompt_mask.shape == (4, 6)
    assert torch.equal(call.prompt_mask, mask.bool().repeat_interleave(2, dim=0))  # each prompt's two sequences
    generated = plain[:, 6:]
    filler = -1 if stop == "criterion, no eos" else unused[1] if stop.endswith("filled with the pad id") else token
    if stop == "criterion, no eos":
        assert (generated == -1).any()  # (transformers' own filler: the record reads it as id 0)
        call.sequences = call.sequences.clamp(min=0)
    check_call(model, call, 7)
    for row in range(4):
        ends = (generated[row, :-1] == token).nonzero()
        last = int(ends[0]) if len(ends) else 6  # its stop token's step, else it ran to the end
        assert (generated[row, last + 1:] == filler).all()
        assert [bool(step.active[row]) for step in call.steps] == [g <= last for g in range(7)]
        assert call.steps[-1].mask[row, 6:].tolist() == [g <= last for g in range(6)]  # (the last token never ran)


def test_beam_search_ended_by_ctrl_c_while_run_again_or_recorded_by_nobody_says_so(model, monkeypatch):
    """A beam search whose records nobody takes (keep_steps=False, nothing listening) ends complete, with no reason:
    it was said not recorded, its tokens "from forwards that never reached the probe's hooks" (torch.compile's).
    Ctrl-C while its sequences run again, after generate returned, reaches the caller, and the call says it is not
    recorded and why: it ended complete, no step, no error."""
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    options = dict(input_ids=ids, max_new_tokens=5, num_beams=3, do_sample=False)
    with nxl.attach(model, layers="all", keep_steps=False) as probe:
        model.generate(**options)
    (call,) = probe.calls
    assert call.complete and call.error is None and probe.unrecorded is None

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate.Generations, "refill", interrupted)
    with nxl.attach(model, layers="all") as probe:
        with pytest.raises(KeyboardInterrupt):
            model.generate(**options)
    (call,) = probe.calls
    assert not call.complete and call.steps == []
    assert call.error == probe.unrecorded.removeprefix("not recorded (recording its returned sequences): ")
    assert "KeyboardInterrupt" in call.error


def test_beam_search_needs_its_prompt_as_ids_and_plain_forwards_still_record(model):
    """A beam search from embeddings cannot be run again over its sequences: not recorded, saying so and what to
    pass; the call runs unchanged and a plain forward after it is recorded."""
    ids = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(8))
    embeds = model.get_input_embeddings()(ids).detach()
    plain = model.generate(inputs_embeds=embeds, max_new_tokens=3, num_beams=2)
    with nxl.attach(model) as probe:
        beams = model.generate(inputs_embeds=embeds, max_new_tokens=3, num_beams=2)  # runs, unrecorded
        assert torch.equal(beams, plain)
        assert "pass input_ids (without inputs_embeds)" in probe.calls[-1].error and not probe.calls[-1].complete
        assert probe.calls[-1].error.startswith("not recorded: beam search") and \
            probe.unrecorded == probe.calls[-1].error
        # the call's reason once, after the line's own "not recorded:" (it read "not recorded: not recorded: beam")
        with pytest.raises(RuntimeError, match=r"^the last generate\(\) call was not recorded: beam search .*"
                                               r"input_ids"):
            probe.steps
        model(input_ids=ids)
        res = probe.result()
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    logat, _ = normxlogit(llama(model).layer_logits(out.hidden_states), out.hidden_states[0], res.target)
    torch.testing.assert_close(res.logat, logat, rtol=1e-4, atol=1e-5)


def test_an_on_step_callback_that_runs_the_model_is_the_reason_the_record_stops(model):
    """An on_step callback that runs the model on the call's own prompt stopped the record saying a forward ran
    positions 0..3 "from its no cache" (several candidate tokens per forward, or a cropped cache) and that the steps
    before may have been replaced: neither is so. The reason names the callback; a generate call the callback makes
    is a call of its own, recorded."""
    ids = torch.randint(1, VOCAB, (1, 4), generator=torch.Generator().manual_seed(8))
    plain = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=PAD)

    def callback(step):
        if step.step == 1:
            model(input_ids=ids)

    with torch.no_grad(), nxl.attach(model, on_step=callback) as probe:
        out = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    assert torch.equal(out, plain)  # the model's own call unchanged
    (call,) = probe.calls
    assert call.error == ("the on_step callback ran the model inside this call: the call's records follow its own "
                          "forwards only, and one of the callback's came between two of them, so they stop here; run "
                          "the model after generate returns (keep what the callback needs until then)")
    assert [step.step for step in call.steps] == [0, 1] and not call.complete

    def generates(step):
        if step.step == 0 and len(probe.calls) == 1:
            model.generate(input_ids=ids, max_new_tokens=1, do_sample=False, pad_token_id=PAD)

    with torch.no_grad(), nxl.attach(model, on_step=generates) as probe:
        model.generate(input_ids=ids, max_new_tokens=2, do_sample=False, pad_token_id=PAD)
    assert [(call.error, len(call.steps)) for call in probe.calls] == [(None, 2), (None, 1)]


def test_a_call_generate_itself_refuses_says_generate_raised(model, tmp_path):
    """``num_return_sequences=3`` without sampling nor beams, resuming a filled cache: generate raises its own
    ValueError, and the record said only that the call is not recorded, as if it had run. It says generate raised
    (and why), then why it would not be recorded either; the sink's copy too."""
    ids = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(8))
    resumed, cache = tiny.resuming(model, ids)
    with pytest.raises(ValueError) as unattached:
        model.generate(input_ids=resumed, max_new_tokens=2, num_return_sequences=3, **cache)
    with nxl.attach(model, sink=tmp_path / "run.nxl") as probe:
        with pytest.raises(ValueError) as attached:
            model.generate(input_ids=resumed, max_new_tokens=2, num_return_sequences=3, **cache)
    assert str(attached.value) == str(unattached.value)  # generate's own refusal, untouched
    (call,) = probe.calls
    assert call.error == (f"not recorded: generate raised ValueError ({unattached.value}); it would not be recorded "
                          "either: generate was given a KV cache already holding positions 0..4, filled by forwards "
                          "that are not this call's, so the context of its steps was never recorded; generate from "
                          "the full prompt without that cache (leave out cache / past_key_values)")
    assert not call.complete and not call.steps and "\n" not in call.error
    (read,) = nxl.read_stream(tmp_path / "run.nxl")
    assert read.error == call.error and not read.complete


@pytest.mark.parametrize("setting", [{"num_beams": 2}, {"num_beams": 2, "num_return_sequences": 2},
                                     {"prompt_lookup_num_tokens": 3}])
def test_a_generation_config_passed_positionally_is_read_for_what_it_records(model, setting):
    """``generate(ids, GenerationConfig(...))``: the config, generate's second parameter, is read as a keyword one
    is (it was not: beam search was recorded as plain decoding, wrong tokens and scores, and prompt lookup lost
    three of its four steps, both saying complete). Each is recorded from its returned sequences, every step equal
    to the oracle."""
    ids = torch.randint(1, VOCAB, (1, 4), generator=torch.Generator().manual_seed(8)).repeat(1, 4)
    config = GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=PAD, **setting)
    plain = model.generate(ids, config)
    with nxl.attach(model, layers="all") as probe:
        out = model.generate(ids, config)
    (call,) = probe.calls
    assert torch.equal(out, plain)
    assert call.error is None and call.sequences.shape[0] == setting.get("num_return_sequences", 1)
    check_call(model, call, 4)


def test_multi_token_prediction_decoding_is_said_not_recorded_as_assisted_decoding(model):
    """``use_mtp=True`` drafts tokens with the model's multi-token-prediction layers: it ran unrecorded with a
    forward's positions as its reason (several candidate tokens per forward, or a cropped cache), not naming it. It
    is refused before generate runs (this model has no MTP layers: generate then raises, as unattached)."""
    ids = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(8))
    with nxl.attach(model, layers="all") as probe:
        with pytest.raises(ValueError):
            model.generate(ids, max_new_tokens=4, do_sample=False, use_mtp=True)
    (call,) = probe.calls  # (generate's own refusal first: the call never ran)
    assert call.error.startswith("not recorded: generate raised ValueError")
    assert "it would not be recorded either: multi-token prediction (use_mtp)" in call.error


def test_an_attached_assistant_model_says_once_that_its_drafts_are_not_recorded(model, caplog):
    """Attached to the draft model of another model's assisted decoding: its generate, called once per draft from the
    cache of the drafts before, warned once per draft that it was given a KV cache to leave out (the user gave
    none). Each draft says what it is, logged once; the generating model's output is unchanged."""
    big = tiny.generating_llama(seed=2)
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(8))
    plain = big.generate(ids, max_new_tokens=8, do_sample=False, assistant_model=model)
    with caplog.at_level("WARNING", logger="nxl_hooks"), nxl.attach(model, layers="all") as probe:
        out = big.generate(ids, max_new_tokens=8, do_sample=False, assistant_model=model)
    said = [record.getMessage() for record in caplog.records if record.name == "nxl_hooks"]
    assert torch.equal(out, plain) and len(probe.calls) > 1 == len(said) and "drafts candidate tokens" in said[0]
    assert all(not call.complete and "drafts candidate tokens for another model's assisted decoding" in call.error
               for call in probe.calls)


class _Cycle(LogitsProcessor):
    """The model goes on with ``cycle`` (1, 4), whatever its logits: prompt lookup's candidates, read off a prompt of
    the cycle repeated, are accepted."""

    def __init__(self, cycle: torch.Tensor) -> None:
        self.cycle = cycle

    def __call__(self, input_ids, scores):
        return torch.full_like(scores, -torch.inf).index_fill_(-1, self.cycle[0, input_ids.shape[1] % 4], 0)


@pytest.mark.parametrize("how", ["assistant model", "assistant model, sampled", "prompt lookup",
                                 "assistant model, eos"])
def test_assisted_decoding_is_recorded_when_the_call_returns(model, how):
    """Assisted decoding (it ran unrecorded: each forward verifies several candidate tokens and generate drops some,
    cropping its cache) is recorded when the call returns, from the model run again over the tokens it returned:
    with a second model drafting (greedy, or sampled: speculative sampling's tokens, explained as emitted), and with
    prompt lookup (its candidates accepted). The output is the unrecorded one, every step equals the oracle, and
    the call ends at its EOS with as many steps as tokens."""
    drafts = tiny.generating_llama(seed=2)  # the same vocabulary, other weights: some drafts are dropped
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(8))
    options = dict(max_new_tokens=8, do_sample=how.endswith("sampled"))
    if how == "prompt lookup":
        cycle = torch.randint(1, VOCAB, (1, 4), generator=torch.Generator().manual_seed(8))
        ids = cycle.repeat(1, 4)
        options.update(prompt_lookup_num_tokens=3, logits_processor=LogitsProcessorList([_Cycle(cycle)]))
    else:
        options["assistant_model"] = drafts
    if how.endswith("eos"):
        free = model.generate(ids, **options)[0, 6:].tolist()
        options["eos_token_id"] = next(t for s, t in enumerate(free[2:-1], start=2) if t not in free[:s])
    torch.manual_seed(0)
    plain = model.generate(ids, **options)
    torch.manual_seed(0)
    with nxl.attach(model, layers="all") as probe:
        out = model.generate(ids, **options)
    assert torch.equal(out, plain)
    (call,) = probe.calls
    assert call.error is None
    new = out.shape[1] - ids.shape[1]
    assert new < 8 if how.endswith("eos") else new == 8
    check_call(model, call, new)
    assert all(step.active.all() for step in call.steps)


def test_a_first_forward_past_the_prompt_is_said_not_recorded(model, monkeypatch):
    """A prompt forward that also runs candidate tokens (prompt lookup, where a call's settings did not say it) is
    not taken for the prompt: it was, and the steps it accepted were lost while the call said complete."""
    monkeypatch.setattr(generate, "replayed", lambda model, kwargs: None)
    cycle = torch.randint(1, VOCAB, (1, 4), generator=torch.Generator().manual_seed(8))

    options = dict(max_new_tokens=4, do_sample=False, prompt_lookup_num_tokens=3,
                   logits_processor=LogitsProcessorList([_Cycle(cycle)]))
    plain = model.generate(cycle.repeat(1, 4), **options)
    with nxl.attach(model, layers="all") as probe:
        out = model.generate(cycle.repeat(1, 4), **options)
    (call,) = probe.calls
    assert torch.equal(out, plain) and out.shape[1] == 20 and not call.complete
    assert "past its 16-token prompt" in call.error and "name it with assistant_model / prompt_lookup" in call.error


def test_generate_from_a_filled_cache_says_not_recorded_and_what_records_it(model):
    """generate resuming a KV cache filled by an earlier call says so as beam search does (docs/engines.md: the
    call's error and probe.unrecorded both ``not recorded: <why>; <what makes it recordable>``; it said a bare
    forward's positions, with another text in probe.unrecorded), its output the model's own; what it says to do,
    the full prompt without that cache, is recorded equal to the oracle."""
    ids = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(8))
    first = model.generate(input_ids=ids, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    # the cache under the keyword this transformers names it (5.24: cache; before: past_key_values)
    keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    resumed = {keyword: copy.deepcopy(first.past_key_values)}
    plain = model.generate(first.sequences, max_new_tokens=2, do_sample=False, **{keyword: first.past_key_values})
    with nxl.attach(model, layers="all") as probe:
        out = model.generate(first.sequences, max_new_tokens=2, do_sample=False, **resumed)
        (call,) = probe.calls
        assert torch.equal(out, plain) and not call.complete and call.steps == []
        assert call.error == probe.unrecorded == (
            "not recorded: generate was given a KV cache already holding positions 0..5, filled by forwards that are "
            "not this call's, so the context of its steps was never recorded; generate from the full prompt without "
            "that cache (leave out cache / past_key_values)")
        model.generate(first.sequences, max_new_tokens=2, do_sample=False)
    check_call(model, probe.calls[-1], 2)


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_a_state_space_models_beam_search_is_run_again_against_a_cache_of_its_own_layers(kind):
    """A state-space model's beam search runs again against a new cache of the layers its config says (recurrent
    states): an empty cache of attention layers ended it as a bare IndexError. Every step equals the uncached
    oracle; before transformers 5.25 the model's forward takes its states as cache_params, which the rerun does not
    fill: said so, not recorded."""
    model = tiny.generating_state_space(kind)
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    options = dict(max_new_tokens=4, num_beams=3, do_sample=False)
    plain = model.generate(ids, **options)
    with nxl.attach(model, layers="all") as probe:
        out = model.generate(ids, **options)
    assert torch.equal(out, plain)
    (call,) = probe.calls
    if "cache" not in inspect.signature(model.forward).parameters:  # (transformers before 5.25)
        assert call.error == "the model's forward takes no KV cache, which running the call's positions again needs"
        return
    assert call.error is None
    check_call(model, call, 4, state_space(model))


@pytest.mark.parametrize("kind", ["mamba", "mamba2", "falcon_mamba"])
def test_a_state_space_models_generate_is_recorded_equal_to_the_oracle(kind):
    """A state-space model's cache holds recurrent states only, which count no positions (transformers'
    get_seq_length raises on it) and generate passes no cache_position: its generate was not recorded. Each of the
    call's forwards continues the record its earlier ones made, so a left-padded batch is recorded, every step equal
    to the uncached oracle at every layer (the context: every token so far, all taken into the recurrent state), the
    last layer's at the last position to generate's own logits, its tokens to generate's output, that unchanged."""
    model = tiny.generating_state_space(kind)
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = PAD, 0
    options = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                   output_logits=True)
    plain = model.generate(ids, **options)
    with nxl.attach(model, layers="all") as probe:
        out = model.generate(ids, **options)
    assert torch.equal(out.sequences, plain.sequences)
    (call,) = probe.calls
    assert call.error is None and torch.equal(call.sequences, out.sequences)
    check_call(model, call, 4, state_space(model))
    for step, logits in zip(call.steps, out.logits):
        assert torch.equal(step.mask, full_mask(call)[:, :step.position])  # the left pads masked, nothing else
        torch.testing.assert_close(step.logat[-1, :, -1], logits.gather(-1, step.token[:, None])[:, 0])


@pytest.mark.parametrize("sample", [False, True])
def test_self_speculative_decoding_is_recorded_step_by_step(model, sample):
    """Assisted decoding by the model's own early layers (``assistant_early_exit``): its draft forwards, cut short,
    are not followed, and the call is recorded from the whole model run again over its tokens when it returns, as
    docs/generation.md says (it once said every assisted call ran unrecorded): every step equals the oracle, and
    ``complete`` is True."""
    ids = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(8))
    options = dict(input_ids=ids, max_new_tokens=6, do_sample=sample, assistant_early_exit=1)
    torch.manual_seed(0)
    plain = model.generate(**options)
    torch.manual_seed(0)
    with nxl.attach(model, layers="all") as probe:
        out = model.generate(**options)
    (call,) = probe.calls
    assert torch.equal(out, plain) and call.error is None
    check_call(model, call, 6)  # (complete among its checks)


@pytest.mark.parametrize("seed", [0, 2])
def test_self_speculative_decoding_with_eos_ids_keeps_its_rows_active_until_one_is_emitted(model, seed):
    """With EOS ids, the draft's own generate ends each draft at its stopping criteria and an assisted iteration
    accepts several tokens at one call of the call's criteria: the draft's were taken for the call's and each call
    for one token's, so every step after the first (or after an iteration's first) was recorded inactive, its
    generated positions masked out. Rows stay active until their EOS (seed 2 ends on one, seed 0 emits none)."""
    ids = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(seed))
    eos = list(range(1, VOCAB // 4))
    with nxl.attach(model, layers="all") as probe:
        out = model.generate(input_ids=ids, max_new_tokens=8, assistant_early_exit=1, do_sample=False,
                             eos_token_id=eos)
    (call,) = probe.calls
    emitted = out[0, 5:].tolist()
    assert len(emitted) > 2 and not set(emitted[:-1]) & set(eos)
    assert all(step.active.all() and step.mask.all() for step in call.steps)
    check_call(model, call, len(emitted))


@pytest.mark.parametrize("processing", [dict(do_sample=True, temperature=0.3), dict(repetition_penalty=2.0)])
def test_self_speculative_decoding_keeps_the_models_own_logits_where_generate_processes_them(model, processing):
    """With one new token the call's one forward is the prompt's, whose float32 logits generate's assisted decoding
    processes in place: the record read the processed row (LogAt at l = L over the temperature, the probability
    the processed softmax's); it keeps the model's own, as the oracle's."""
    ids = torch.randint(1, VOCAB, (1, 7), generator=torch.Generator().manual_seed(8))
    torch.manual_seed(1)
    with nxl.attach(model, layers="all") as probe:
        model.generate(input_ids=ids, max_new_tokens=1, assistant_early_exit=1, **processing)
    (call,) = probe.calls
    check_call(model, call, 1)
    expected = prefix_logits(model, llama(model), ids, torch.ones_like(ids, dtype=torch.bool))[0][-1, :, -1]
    torch.testing.assert_close(call.steps[0].probability, expected.softmax(-1).gather(-1, call.sequences[:, 7:])[:, 0])


def test_callback_and_iterator_in_another_thread(model):
    ids = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(9))
    seen: list[nxl.Step] = []
    with nxl.attach(model, on_step=seen.append) as probe:
        # consumer in another thread, generate here
        received: list[nxl.Step] = []
        iterator = probe.subscribe()
        consumer = threading.Thread(target=lambda: received.extend(iterator))
        consumer.start()
        model.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
        consumer.join(timeout=30)
        # generate in another thread, consume here
        worker = threading.Thread(target=model.generate, kwargs=dict(input_ids=ids, max_new_tokens=4, do_sample=False))
        stream = probe.subscribe()
        worker.start()
        consumed = list(stream)
        worker.join(timeout=30)
    assert not consumer.is_alive() and not worker.is_alive()
    assert received == probe.calls[0].steps and consumed == probe.calls[1].steps
    assert seen == probe.calls[0].steps + probe.calls[1].steps and len(seen) == 9


def test_a_subscription_made_mid_call_replays_what_it_made_unless_told_not_to(model):
    """A reader that joins a running call gets the steps it already made first, or with ``replay=False`` (what
    ``nxl run``'s live feed asks for when a reader connects) only the steps made from then on."""
    ids = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(12))
    held, go = threading.Event(), threading.Event()

    def hold(step: nxl.Step) -> None:  # the generating thread waits at its third step, mid-call
        if step.step == 2:
            held.set()
            go.wait(30)

    with nxl.attach(model, on_step=hold) as probe:
        worker = threading.Thread(target=model.generate, kwargs=dict(input_ids=ids, max_new_tokens=6, do_sample=False))
        worker.start()
        assert held.wait(30)
        probe._hub.flush()  # the three steps made so far are with the call
        replayed, fresh = probe.subscribe(), probe.subscribe(replay=False)
        go.set()
        worker.join(30)
        got = {name: [step.step for step in reader] for name, reader in (("replayed", replayed), ("fresh", fresh))}
    assert got == {"replayed": [0, 1, 2, 3, 4, 5], "fresh": [3, 4, 5]}


def test_sink_round_trip_and_torn_tail(model, tmp_path):
    ids = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(10))
    path = tmp_path / "run.nxl"
    with nxl.attach(model, sink=path, keep_steps=True) as probe:
        model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    (call,) = nxl.read_stream(path)
    assert call.complete and torch.equal(call.sequences, probe.calls[0].sequences)
    assert torch.equal(call.prompt_ids, ids)
    for read, kept in zip(call.steps, probe.steps, strict=True):
        assert (read.step, read.position, read.layers) == (kept.step, kept.position, kept.layers)
        for name in ("token", "normxlogit", "logat", "embed_norm", "mask", "active"):
            assert torch.equal(getattr(read, name), getattr(kept, name))
    data = path.read_bytes()
    path.write_bytes(data[:-40])  # the end frame torn
    (torn,) = nxl.read_stream(path)
    assert not torn.complete and len(torn.steps) == 4


def test_the_record_keeps_what_generate_returned_when_the_caller_writes_over_it(model, tmp_path):
    """A caller that reuses generate's output buffer (on the CPU, the record's sequences are no view of it)."""
    ids = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(10))
    path = tmp_path / "run.nxl"
    with nxl.attach(model, layers="all", sink=path) as probe:
        out = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
        returned = out.clone()
        out.fill_(7)
    (call,), (read,) = probe.calls, nxl.read_stream(path)
    assert torch.equal(call.sequences, returned) and torch.equal(read.sequences, returned)
    check_call(model, call, 3)


def test_a_generate_that_raised_says_so_on_its_record_with_the_steps_made_before(model, tmp_path):
    ids = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(10))
    forwards = []

    def fails_at_the_fourth_forward(module, args, output):
        forwards.append(1)
        if len(forwards) == 4:
            raise ValueError("the host's own failure")

    handle = model.model.layers[0].register_forward_hook(fails_at_the_fourth_forward)
    path = tmp_path / "run.nxl"
    try:
        with nxl.attach(model, layers="all", sink=path) as probe:
            with pytest.raises(ValueError, match="the host's own failure"):
                model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    finally:
        handle.remove()
    for call in (probe.calls[0], nxl.read_stream(path)[0]):  # in memory and read back
        assert not call.complete and call.sequences is None
        assert call.error == ("generate raised ValueError (the host's own failure): its records end at the last "
                              "step made before")  # why, in the host's own words
        assert [step.step for step in call.steps] == [0, 1, 2]  # the tokens of the three forwards that returned
    from nxl_hooks.hooks.guard import raised

    long = raised(RuntimeError("first line\n" + "x" * 400))  # one line, cut: a reason, not a traceback
    assert long.startswith("RuntimeError (first line xxx") and long.endswith("x…)")
    assert len(long) == len("RuntimeError (") + 200 + len(")")
    assert raised(KeyboardInterrupt()) == "KeyboardInterrupt"  # no message: its type alone


_CHILD = textwrap.dedent("""
    import sys, time, torch
    sys.path[:0] = [{tests!r}, {helpers!r}]
    import tiny
    import nxl_hooks as nxl
    torch.set_num_threads(1)
    model = tiny.generating_llama()
    ids = torch.randint(1, 100, (1, 6), generator=torch.Generator().manual_seed(11))
    with nxl.attach(model, sink={path!r}, on_step=lambda step: time.sleep(0.05)):
        model.generate(input_ids=ids, max_new_tokens=100000, min_new_tokens=100000, do_sample=False)
""")


@pytest.mark.version_free
def test_sink_readable_after_sigkill(model, tmp_path):
    path = tmp_path / "killed.nxl"
    code = _CHILD.format(tests=str(Path(__file__).parent), helpers=str(Path(__file__).parents[1]), path=str(path))
    child = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and child.poll() is None:
            calls = nxl.read_stream(path) if path.exists() and path.stat().st_size > 64 else []
            if calls and len(calls[0].steps) >= 5:
                break
            time.sleep(0.1)
        assert child.poll() is None, "the child should still be generating"
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
    finally:
        if child.poll() is None:
            child.kill()
    (call,) = nxl.read_stream(path)
    assert not call.complete and len(call.steps) >= 5
    assert [s.step for s in call.steps] == list(range(len(call.steps)))
    sequence = torch.cat([call.prompt_ids, torch.stack([s.token for s in call.steps], dim=1)], dim=1)
    hand = llama(model)
    for step in (call.steps[0], call.steps[-1]):
        logits, embeddings = prefix_logits(model, hand, sequence[:, : step.position],
                                           torch.ones(1, step.position, dtype=torch.bool))
        torch.testing.assert_close(step.normxlogit, normxlogit(logits, embeddings, step.token)[1], rtol=1e-4, atol=1e-4)


def test_a_thread_is_between_steps_in_the_hosts_code_and_not_inside_the_hooks(model):
    """What a signal handler asks before it scores the main thread's waiting steps (nxl run's SIGTERM): stopped in
    the host's code under the probe's generate wrapper (a streamer, the model's forward, a stopping criterion) the
    call's state is whole; stopped in the hooks' own code (here an on_step callback the hub calls as it scores) it
    may be half changed."""
    found: dict[str, list[bool]] = {"streamer": [], "forward": [], "criterion": [], "on_step": []}

    class Streamer(BaseStreamer):
        def put(self, value):
            found["streamer"].append(generate.between_steps(sys._getframe()))

        def end(self):
            pass

    class Criterion(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            found["criterion"].append(generate.between_steps(sys._getframe()))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def on_step(step):
        found["on_step"].append(generate.between_steps(sys._getframe()))

    handle = model.model.layers[0].register_forward_hook(
        lambda *_: found["forward"].append(generate.between_steps(sys._getframe())))
    try:
        with nxl.attach(model, layers=[0, -1], on_step=on_step):
            model.generate(input_ids=torch.tensor([[1, 5, 6]]), max_new_tokens=3, do_sample=False, streamer=Streamer(),
                           stopping_criteria=StoppingCriteriaList([Criterion()]))
    finally:
        handle.remove()
    assert {key: set(seen) for key, seen in found.items()} == {"streamer": {True}, "forward": {True},
                                                              "criterion": {True}, "on_step": {False}}
    assert len(found["on_step"]) == 3 and not generate.between_steps(None)

@pytest.mark.parametrize("where", ["streamer", "logits processor", "compiled forward"])
def test_records_ended_for_a_dying_process_hold_every_step_made_or_say_what_waited(model, tmp_path, where):
    """What nxl run's SIGTERM handler does before the process dies (``end_records``, called here where the signal
    would stop the main thread: in the host's streamer, or in its logits processor, which runs outside the call's
    record): the call's waiting steps are scored and written, and its error says where its records end. A call whose
    forwards ran compiled is recorded only when it returns: its error says that its steps since were waiting."""
    from nxl_hooks.hooks.probe import end_records

    printed: list[int] = []

    def end_at_20(frame) -> None:
        if len(printed) == 19 + (where != "logits processor"):
            end_records("SIGTERM", frame)

    class Streamer(BaseStreamer):
        def put(self, value):
            if value.numel() == 1:  # (the prompt comes first)
                printed.append(int(value.reshape(-1)[0]))
                if where != "logits processor":
                    end_at_20(sys._getframe())

        def end(self):
            pass

    class Processor(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if where == "logits processor":
                end_at_20(sys._getframe())  # the 20th token's: 19 chosen
            return scores

    path, forward = tmp_path / "run.nxl", model.forward
    ids = torch.tensor([[1, 5, 6]])
    with nxl.attach(model, layers=[0, -1], sink=path):
        if where == "compiled forward":
            model.forward = torch.compile(model.forward, backend="eager")
        try:
            model.generate(input_ids=ids, max_new_tokens=30, min_new_tokens=30, do_sample=False, streamer=Streamer(),
                           logits_processor=LogitsProcessorList([Processor()]))
        finally:
            model.forward = forward
    (call,) = nxl.read_stream(path)
    said = "the process got SIGTERM while this call ran: its records end at the last step "
    if where == "compiled forward":
        assert call.steps == [] and call.error.startswith(said + "recorded before") and "compiled" in call.error
        return
    assert call.error == said + "made before" and len(printed) >= 20
    assert [int(s.token[0]) for s in call.steps] == printed[:19]  # the 20th: chosen, its forward not begun
    sequence = torch.cat([ids, torch.tensor([printed[:19]])], dim=1)
    hand = llama(model)
    for step in (call.steps[0], call.steps[-1]):
        logits, embeddings = prefix_logits(model, hand, sequence[:, : step.position],
                                           torch.ones(1, step.position, dtype=torch.bool))
        torch.testing.assert_close(step.normxlogit, normxlogit(logits, embeddings, step.token)[1][[0, -1]],
                                   rtol=1e-4, atol=1e-4)

def test_print_generation_prints_each_token_as_it_is_emitted():
    from rich.console import Console


    model, tokenizer = tiny.build_model("llama"), tiny.tokenizer()
    console = Console(record=True, width=500)
    from nxl_hooks.apps.terminal import print_generation

    call = print_generation(model, tokenizer, "the film was", 4, layers=[0, -1], console=console)
    lines = console.export_text().strip().splitlines()
    # prompt, legend, one line per token, why it stopped
    assert 1 <= len(call.steps) <= 4 and len(lines) == 3 + len(call.steps) and lines[-1].startswith("stopped")
    for line, step in zip(lines[2:], call.steps):
        token = tokenizer.convert_ids_to_tokens(int(step.token[0]))
        assert line.split()[:2] == [str(step.step), token] and "L2:" in line  # the last selected layer


def test_pipeline_and_peft_generate_reach_the_probe(monkeypatch):
    from peft import LoraConfig, get_peft_model
    from transformers import pipeline

    import tiny

    model, tokenizer = tiny.build_model("llama"), tiny.tokenizer()
    model.generation_config.eos_token_id = None
    with nxl.attach(model, tokenizer=tokenizer) as probe:
        pipeline("text-generation", model=model, tokenizer=tokenizer)("the film was", max_new_tokens=3, do_sample=False)
    check_call(model, probe.calls[0], 3)
    # LoRA on lm_head too: a readout that is called, not gathered (in chunks of 5 positions here)
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj", "lm_head"],
                                                  init_lora_weights=False))
    monkeypatch.setattr(nxl_head, "CALLED_READOUT_CHUNK", 5)
    enc = tokenizer("the movie is", return_tensors="pt")
    with nxl.attach(peft_model) as probe:
        peft_model.generate(**enc, max_new_tokens=3, do_sample=False)
    base = peft_model.get_base_model()  # the oracle runs the LoRA-adjusted blocks and calls the LoRA lm_head
    check_call(base, probe.calls[0], 3, hand=HandHead(rms_norm(base.model.norm), base.lm_head, last_is_normed=True))


def test_fixed_targets_add_a_label_axis_at_every_step(model):
    ids = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(12))
    with nxl.attach(model, target=[5, 7]) as probe:
        model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
    call, hand = probe.calls[0], llama(model)
    for step in call.steps:
        assert step.normxlogit.shape == (4, 2, step.position, 2) and step.target.tolist() == [[5, 7], [5, 7]]
        logits, embeddings = prefix_logits(model, hand, call.sequences[:, : step.position],
                                           torch.ones(2, step.position, dtype=torch.bool))
        for k, label in enumerate((5, 7)):
            _, expected = normxlogit(logits, embeddings, torch.tensor([label, label]))
            torch.testing.assert_close(step.normxlogit[..., k], expected, rtol=1e-4, atol=1e-4)


def test_cli_attribute_generate_streams_and_saves(tmp_path, capsys, monkeypatch):
    from nxl_hooks.apps.cli import main

    import tiny

    monkeypatch.setenv("COLUMNS", "300")  # rich folds long lines at the terminal width
    path = tiny.save_model(tmp_path / "llama", "llama")
    out = tmp_path / "run.nxl"
    assert main(["attribute", str(path), "the film was", "--generate", "3", "--layers", "last", "--out", str(out)]) == 0
    (call,) = nxl.read_stream(out)
    printed = capsys.readouterr().out.strip().splitlines()
    assert call.complete and 1 <= len(call.steps) <= 3 and len(printed) == 4 + len(call.steps)
    assert printed[-2].startswith("stopped: ") and printed[-1].startswith(f"saved {out} (a stream of step records")
    assert all(line.split()[0] == str(s.step) and "L2:" in line for line, s in zip(printed[2:], call.steps))
    bert = tiny.save_model(tmp_path / "bert", "bert")
    assert main(["attribute", str(bert), "the film was", "--generate", "3"]) == 2  # not a causal LM: one-line error
    assert "causal LM" in capsys.readouterr().err


@pytest.mark.version_free
def test_keep_calls_bounds_what_a_long_running_probe_holds(model):
    import gc

    ids = torch.randint(1, VOCAB, (1, 4), generator=torch.Generator().manual_seed(13))
    seen: list[int] = []
    with nxl.attach(model, keep_steps=False, keep_calls=10, on_step=lambda step: seen.append(step.call)) as probe:
        hub = probe._hub
        abandoned = probe.subscribe(follow=True)  # a reader that went away without closing its stream
        del abandoned
        gc.collect()
        with probe.subscribe(follow=True) as closed:  # and one closed by its reader
            pass
        assert list(closed) == []
        for _ in range(40):  # four times keep_calls: each call past the tenth drops the oldest
            model.generate(input_ids=ids, max_new_tokens=2, do_sample=False)
        kept = probe.calls
        assert len(kept) == 10 and [c.index for c in kept] == list(range(30, 40))
        assert all(c.complete and c.steps == [] for c in kept)  # keep_steps=False: streamed, not kept
        assert len(hub._calls) == 10 and hub._running == [] and len(hub._subscribers) == 0
    assert len(seen) == 80 and seen[-1] == 39  # every step was still published


class _SubscribeAt(BaseStreamer):
    """Subscribes to the probe's stream when generate hands it the ``at``-th new token (0-based)."""

    def __init__(self, probe, at: int) -> None:
        self.probe, self.at, self.puts, self.stream = probe, at, -1, None

    def put(self, value: torch.Tensor) -> None:
        if self.puts == self.at:
            self.stream = self.probe.subscribe()
        self.puts += 1

    def end(self) -> None:
        pass


def test_steps_nobody_listens_to_are_skipped_and_later_ones_still_right(model):
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 6, dtype=torch.long)
    ids[0, :2], mask[0, :2] = PAD, 0
    reference = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)[:, 6:]
    s, eos = next((s, int(t)) for s, t in enumerate(reference[0, 1:-1].tolist(), start=1)
                  if t not in reference[1].tolist() and t not in reference[0, :s].tolist())
    options = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=eos)
    with nxl.attach(model) as probe:
        model.generate(**options)
    kept = probe.calls[0].steps
    assert len(kept) > s + 1
    # Nothing takes records until a subscriber joins after row 0's EOS: the records before it are never made, yet
    # the EOS bookkeeping of those steps (row 0 inactive, its pads masked) holds in every later record.
    with nxl.attach(model, keep_steps=False) as probe:
        streamer = _SubscribeAt(probe, s + 1)
        model.generate(**options, streamer=streamer)
        late = list(streamer.stream)
    assert probe.calls[0].complete and probe.calls[0].steps == []
    assert [step.step for step in late] == [step.step for step in kept[s + 1:]]
    for got, want in zip(late, kept[s + 1:]):
        assert not bool(got.active[0]) and not got.mask[0, 6 + s + 1:].any()
        for name in ("token", "mask", "active", "embed_norm"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        # scored one by one here, together there: one matmul's columns are not another's (on AVX-512, 1 ulp apart)
        for name in ("normxlogit", "logat"):
            torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-7)


def _compiled_static(model, ids, **options):
    """generate with a static cache, which transformers compiles itself (on the CPU too, with _compile_all_devices;
    the eager backend keeps compiling cheap: the hooks are skipped all the same)."""
    return model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, cache_implementation="static",
                          compile_config=tiny.cpu_compile(backend="eager"), **options)


def test_compiled_static_cache_generate_is_recorded_and_eager_too(monkeypatch):
    """Compiled here first, before any probe: attached, generate runs that compiled code, which calls no hook of the
    probe, and its steps are recorded when it ends (inductor and every check: tests/oracle/test_compiled.py);
    NXL_EAGER=1 runs eagerly."""
    model = tiny.generating_llama(seed=3)
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(21))
    plain = _compiled_static(model, ids)
    with nxl.attach(model) as probe:
        out = _compiled_static(model, ids)
    assert torch.equal(out, plain) and probe.unrecorded is None
    check_call(model, probe.calls[0], 4)
    monkeypatch.setenv("NXL_EAGER", "1")  # the fallback: generate runs eagerly, every step recorded
    with nxl.attach(model) as probe:
        out = _compiled_static(model, ids)
    assert torch.equal(out, plain) and probe.unrecorded is None
    check_call(model, probe.calls[0], 4)


def test_a_compiled_call_whose_replay_fails_keeps_the_steps_it_can_score(monkeypatch):
    """The steps of a compiled call are emitted before their positions are fed from the model run again, in one
    go: when that feed fails, the call says why, and the step whose context was fed (the first after the prompt) is
    still recorded, equal to the oracle, not lost with the others."""
    from nxl_hooks.hooks import generate

    def broken(self, capture, mask, start, first, end):
        raise RuntimeError("the positions run again could not be read")

    model = tiny.generating_llama(seed=3)
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(21))
    plain = _compiled_static(model, ids)
    monkeypatch.setattr(generate.Run, "_refilled", broken)
    with nxl.attach(model) as probe:
        assert torch.equal(_compiled_static(model, ids), plain)  # the call itself unchanged
    (call,) = probe.calls
    assert not call.complete and "the positions run again could not be read" in call.error
    assert [step.position for step in call.steps] == [6]
    hand = llama(model)
    logits, embeddings = prefix_logits(model, hand, plain[:, :6], torch.ones(1, 6, dtype=torch.bool))
    _, expected = normxlogit(logits, embeddings, call.steps[0].token)
    torch.testing.assert_close(call.steps[0].normxlogit, expected[call.layers], rtol=1e-4, atol=1e-4)


def test_a_prompt_given_as_ids_and_embeddings_is_recorded_step_by_step(model):
    """Both given, the prompt runs as the embeddings and generate's sequences begin with the ids: every step is the
    oracle's (the last one was once taken for a compiled step, and lost with a reason that was not so)."""
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(21))
    embeds = model.get_input_embeddings()(ids).detach()
    plain = model.generate(input_ids=ids, inputs_embeds=embeds, max_new_tokens=5, do_sample=False)
    with nxl.attach(model, layers="all") as probe:
        out = model.generate(input_ids=ids, inputs_embeds=embeds, max_new_tokens=5, do_sample=False)
    (call,) = probe.calls
    assert torch.equal(out, plain) and call.error is None and probe.unrecorded is None
    check_call(model, call, 5)


def test_a_prompt_given_as_embeddings_is_said_so_and_its_generated_tokens_keep_their_texts(tmp_path):
    """generate(inputs_embeds=...) returns the new tokens only, and nothing of the prompt is a token: the record read
    as cut short (its context had no texts at all, the generated tokens' neither, and nothing said why). It says the
    prompt came as embeddings (notes, repr, page; also read back from its stream), its positions read @N and the
    generated tokens read as the tokenizer's own decode of generate's output."""
    import bpe_tiny
    from nxl_hooks.records.html import generation_html

    tok = bpe_tiny.bpe_tokenizer()
    model = bpe_tiny.bpe_llama(tok)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    n, embeds = ids.shape[1], model.get_input_embeddings()(ids).detach()
    options = dict(inputs_embeds=embeds, max_new_tokens=4, do_sample=False, pad_token_id=2)
    plain = model.generate(**options)
    with nxl.attach(model, layers="all", tokenizer=tok, sink=str(tmp_path / "run.nxl")) as probe:
        out = model.generate(**options)
    assert torch.equal(out, plain) and out.shape == (1, 4)  # transformers' own: the new tokens only
    (call,) = probe.calls
    (read,) = nxl.read_stream(tmp_path / "run.nxl")
    decoded = [tok.decode([token]).replace(" ", "␣") for token in out[0].tolist()]
    for each in (call, read):
        assert each.complete and each.prompt_embedded and torch.equal(each.sequences, out)
        assert any("came as embeddings (inputs_embeds)" in note and "new tokens only" in note for note in each.notes)
        assert f"prompt 1 x {n} embeddings (no token ids or texts)" in repr(each)
        assert each.steps[-1].names(each, 0) == [f"@{j}" for j in range(n)] + decoded
        assert [text for _, text, _ in each.attribution(each.steps[-1]).top(10) if not text.startswith("@")] == [
            decoded[p - n] for p, _, _ in each.attribution(each.steps[-1]).top(10) if p >= n]
        assert each.texts == [tok.decode(out[0])]
        assert "came as embeddings (inputs_embeds)" in generation_html(each)


def test_compiled_steps_of_a_prompt_given_as_embeddings_are_said_not_recorded():
    """A compiled call whose prompt came as inputs_embeds cannot be run again over its tokens (generate returns only
    the new ones): it is never silent, its call says why and what to do, and its output is the plain one."""
    model = tiny.generating_llama(seed=3)
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(21))
    embeds = model.get_input_embeddings()(ids).detach()
    plain = _compiled_static(model, None, inputs_embeds=embeds)
    with nxl.attach(model, embedding="layer_input") as probe:
        out = _compiled_static(model, None, inputs_embeds=embeds)
    (call,) = probe.calls
    assert torch.equal(out, plain) and not call.complete and call.steps == []
    assert "inputs_embeds" in call.error and "pass input_ids" in call.error and probe.unrecorded is not None


@pytest.mark.parametrize("with_ids", [False, True])
def test_word_embeddings_with_a_prompt_given_as_embeddings_say_what_a_plain_forward_says(model, with_ids):
    """``embedding="word"`` needs the word-embedding module to run: a generate call whose prompt comes as
    inputs_embeds (with its ids beside them too) is not recorded, saying the plain forward's reason and what to do
    (it said an AttributeError's text), and its output is the plain one."""
    ids = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(1))
    options = dict(inputs_embeds=model.get_input_embeddings()(ids).detach(), max_new_tokens=3, do_sample=False,
                   **({"input_ids": ids} if with_ids else {}))
    plain = model.generate(**options)
    with nxl.attach(model, embedding="word") as probe:
        model(inputs_embeds=options["inputs_embeds"])
        with pytest.raises(ValueError) as forward_error:
            probe.result()
        out = model.generate(**options)
    (call,) = probe.calls
    assert torch.equal(out, plain) and call.steps == []
    assert call.error == f"not recorded: {forward_error.value}" and "embedding='layer_input'" in call.error
