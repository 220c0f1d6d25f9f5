"""Attach and detach leave the model as it was; bad input gets an error that says what to do."""

import logging
import re

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

import nxl_hooks as nxl
from tiny import word_tokenizer

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", "dog", "ran"]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture()
def ids():
    return torch.tensor([[5, 6, 7, 8, 5, 9]])  # the cat sat on the mat


def _hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_detach_leaves_no_hook_and_identical_outputs(model, ids):
    before = model(input_ids=ids).logits
    with nxl.attach(model) as probe:
        during = model(input_ids=ids).logits
        assert _hook_count(model) > 0 and probe.attached
    assert _hook_count(model) == 0 and not probe.attached
    after = model(input_ids=ids).logits
    assert torch.equal(before, during) and torch.equal(before, after)


def test_failing_forward_still_detaches(model):
    with pytest.raises(IndexError, match="index out of range"):
        with nxl.attach(model):
            model(input_ids=torch.tensor([[5, 99]]))  # id beyond the vocabulary: the model's own forward raises
    assert _hook_count(model) == 0
    with nxl.attach(model) as probe:  # and the model can be attached again
        model(input_ids=torch.tensor([[5, 6]]))
    assert probe.result().normxlogit.shape == (3, 1, 2)


@pytest.mark.parametrize("call", ["forward", "generate"])
@pytest.mark.parametrize("where", ["model", "block"])
def test_a_detach_during_the_forward_never_reaches_it(model, ids, where, call):
    """A hook of the user's that runs before the probe's on the same module (registered before attaching) detaches
    the probe, as a detach in another thread may at that point: PyTorch, holding its list of hooks, then calls the
    probe's removed kwargs hook without kwargs (TypeError raised into model(...)). The call runs unrecorded."""
    holder = []

    def detach(*args):
        if holder:
            holder.pop().detach()

    if where == "model":  # the task model's pre-hook, then the forward hook of a block
        mine = model.register_forward_pre_hook(detach)
    else:
        mine = model.model.layers[0].register_forward_hook(detach)

    def run():
        if call == "forward":
            return model(input_ids=ids).logits
        return model.generate(input_ids=ids, max_new_tokens=2, do_sample=False, pad_token_id=0)

    try:
        with torch.no_grad():
            plain = run()
            probe = nxl.attach(model)
            holder.append(probe)
            attached = run()
    finally:
        mine.remove()
    assert not holder and not probe.attached and torch.equal(plain, attached)
    assert _hook_count(model) == 0 and "generate" not in vars(model)


def test_attaching_twice_is_an_error(model):
    with nxl.attach(model):
        with pytest.raises(RuntimeError, match="already attached"):
            nxl.attach(model)
    assert _hook_count(model) == 0


def test_result_before_any_forward(model):
    with nxl.attach(model) as probe:
        with pytest.raises(RuntimeError, match="no forward"):
            probe.result()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"layers": [3]}, "layer 3 is out of range.*0..2"),
        ({"layers": [-4]}, "out of range"),
        ({"layers": "middle"}, "use 'all', 'last'"),
        ({"target": len(WORDS)}, f"target {len(WORDS)} is out of range.*{len(WORDS)} outputs"),
        ({"target": "sat"}, "tokenizer=tok"),
        ({"target": "zebra", "tokenizer": word_tokenizer(WORDS)}, "not a single token in the vocabulary"),
        ({"tokenizer": word_tokenizer(WORDS + ["extra1", "extra2"])}, "does not match the model"),
        ({"embedding": "words"}, "layer_input"),
    ],
)
def test_bad_arguments_say_what_to_do(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        nxl.attach(model, **kwargs)
    assert _hook_count(model) == 0


def test_empty_input_is_reported_by_result_and_never_raised_into_the_forward(model):
    empty = torch.zeros((1, 0), dtype=torch.long)
    try:
        plain = model(input_ids=empty).logits
    except Exception as error:  # whatever the model itself does with an empty input, attached or not
        plain = type(error)
    with nxl.attach(model) as probe:
        try:
            attached = model(input_ids=empty).logits
        except Exception as error:
            attached = type(error)
        with pytest.raises(ValueError, match="empty input"):
            probe.result()
    assert attached is plain if isinstance(plain, type) else torch.equal(attached, plain)
    assert _hook_count(model) == 0


def test_string_target_resolves_through_tokenizer(model, ids):
    tok = word_tokenizer(WORDS)
    other = (WORDS.index("sat") + 1) % len(WORDS)  # a word and an id of another output (one output twice is refused)
    with torch.no_grad(), nxl.attach(model, target=["sat", other], tokenizer=tok) as probe:
        logits = model(input_ids=ids).logits[0, -1]
    res = probe.result()
    assert res.target.tolist() == [[WORDS.index("sat"), other]]
    assert res.normxlogit.shape == (3, 1, ids.shape[1], 2)
    torch.testing.assert_close(res.logat[-1, 0, -1], logits[[WORDS.index("sat"), other]], rtol=1e-4, atol=1e-6)
    assert res.tokens == [[WORDS[i] for i in ids[0].tolist()]]


def test_save_and_load_round_trip(model, ids, tmp_path):
    with torch.no_grad(), nxl.attach(model, layers=[0, -1], tokenizer=word_tokenizer(WORDS)) as probe:
        model(input_ids=ids)
    res = probe.result()
    path = res.save(tmp_path / "a.safetensors")
    back = nxl.Attribution.load(path)
    for name in ("normxlogit", "logat", "embed_norm", "target", "mask", "position", "example"):
        assert torch.equal(getattr(res, name), getattr(back, name)), name
    assert back.layers == [0, 2] and back.tokens == res.tokens and back.meta == res.meta
    assert back.top(2)[0][1] in WORDS


def test_load_refuses_foreign_file(tmp_path):
    path = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(1)}, str(path))
    with pytest.raises(ValueError, match="not an nxl_hooks attribution file"):
        nxl.Attribution.load(path)


def test_word_embedding_needs_input_ids(model, ids):
    embeds = model.get_input_embeddings()(ids)
    with nxl.attach(model, embedding="word") as probe:
        model(inputs_embeds=embeds)  # the forward itself runs as usual
        with pytest.raises(ValueError, match="embedding='word' needs input_ids"):
            probe.result()
    assert _hook_count(model) == 0


def test_word_embedding_of_a_model_that_builds_its_own_embeddings_says_so():
    """Fuyu embeds the input_ids it is given itself, then hands its language model inputs_embeds: the refusal said
    input_ids were missing (inputs_embeds given), though the user gave input_ids; it names the real cause."""
    from transformers import FuyuConfig, FuyuForCausalLM

    text = {"model_type": "persimmon", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 2}
    model = FuyuForCausalLM(FuyuConfig(vocab_size=32, hidden_size=16, patch_size=4, text_config=text)).eval()
    ids = torch.tensor([[1, 5, 6, 7]])
    said = (r"^embedding='word' reads the word-embedding rows of the input_ids the backbone is given, but "
            r"FuyuForCausalLM builds the embeddings its backbone reads itself \(inputs_embeds\), before the backbone "
            r"runs; use embedding='layer_input' \(the default")
    with torch.no_grad(), nxl.attach(model, embedding="word") as probe:
        model(input_ids=ids)
        with pytest.raises(ValueError, match=said):
            probe.result()
        model.generate(input_ids=ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
    assert re.match(said, probe.calls[-1].error), probe.calls[-1].error
    assert _hook_count(model) == 0


def test_masked_lm_without_tokenizer_fails_at_attach():
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                        intermediate_size=64)
    with pytest.raises(ValueError, match="needs attach\\(..., tokenizer=tok\\) with a mask token"):
        nxl.attach(BertForMaskedLM(config).eval())


def test_stream_opened_after_detach_ends_at_once(model):
    with nxl.attach(model) as probe:
        hub = probe._hub
    # the probe is gone: a subscriber the hub still hands out must not wait for a call that never comes
    assert list(hub.subscribe()) == []
    with pytest.raises(RuntimeError, match="detached"):
        probe.subscribe()


def test_a_with_block_on_a_detached_probe_raises_rather_than_run_unrecorded(model, ids):
    """A probe entered again after its first `with` block ended ran the second block's calls unrecorded, saying
    nothing, and probe.steps still gave the first call's records as the last one's."""
    probe = nxl.attach(model)
    with probe:
        model.generate(input_ids=ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    with pytest.raises(RuntimeError, match="this probe is detached .* attach again"):
        with probe:
            pass
    assert len(probe.calls) == 1 and _hook_count(model) == 0


def test_step_records_resolve_negative_layers(model, ids):
    with torch.no_grad(), nxl.attach(model, layers=[0, 1]) as probe:
        model.generate(input_ids=ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    res = probe.steps[-1].to_attribution()
    with pytest.raises(ValueError, match="not captured"):
        res.layer(-1)  # layer 2 = L was not selected: never silently another layer
    assert torch.equal(res.layer(-2), res.normxlogit[1])


def test_a_layer_named_twice_is_recorded_once(model, ids):
    """A layer named twice, by one number or two spellings (-1 and L), is recorded once, as 0.3.0 did: a list
    computed for models of any depth (``[0, L // 2, L]``) names one twice on a shallow one, and is not refused."""
    from nxl_hooks.method.select import parse_layers

    for layers in ([2, 0, -1], [0, 0, 2], parse_layers("0,0,-1")):
        with torch.no_grad(), nxl.attach(model, layers=layers) as probe:
            model(input_ids=ids)
            res = probe.result()
        assert probe.layers == [0, 2] and probe.n_blocks == 2 and res.normxlogit.shape[0] == 2
        with torch.no_grad():  # layer 0 (block 1's input: the embeddings) through the model's own head, by hand
            head = model.lm_head(model.model.norm(model.model.embed_tokens(ids)[0, -1]))
        torch.testing.assert_close(res.logat[0, 0, -1], head[res.target[0]].squeeze(), atol=1e-5, rtol=1e-4)


def test_target_tensors(model, ids):
    with torch.no_grad(), nxl.attach(model, target=torch.tensor(7)) as probe:
        logits = model(input_ids=ids).logits[0, -1]
    res = probe.result()
    assert res.target.tolist() == [7]
    torch.testing.assert_close(res.logat[-1, 0, -1], logits[7], rtol=1e-4, atol=1e-6)
    with nxl.attach(model, target=torch.tensor([3, 4])) as probe:
        model(input_ids=ids)
        with pytest.raises(ValueError, match="target tensor has 2 rows but this forward explains 1 rows"):
            probe.result()
    with pytest.raises(ValueError, match="got shape"):
        nxl.attach(model, target=torch.zeros(1, 1, 1, dtype=torch.long))
    assert _hook_count(model) == 0


class _Planted(RuntimeError):
    """An internal failure planted in the probe's own code."""


def _host_run(model, path: str):
    """What the host program gets from one use of ``model`` on ``path``: outputs to compare bit for bit, and how
    many recorded calls it makes (forwards, generate calls, requests)."""
    from transformers import GenerationConfig, pipeline

    import tiny

    ids = torch.tensor([[5, 6, 7, 8], [9, 5, 10, 11]])
    if path == "forward":
        with torch.no_grad():
            return [model(input_ids=ids).logits, model(input_ids=ids[:1, :3]).logits], 2
    if path == "generate":
        return [model.generate(input_ids=ids, max_new_tokens=3, do_sample=False),
                model.generate(input_ids=ids[:1], max_new_tokens=2, do_sample=False)], 2
    if path == "pipeline":
        generator = pipeline("text-generation", model=model, tokenizer=word_tokenizer(WORDS))
        return [generator("the cat sat", max_new_tokens=3, do_sample=False)[0]["generated_text"]], 1
    config = GenerationConfig(do_sample=False, max_new_tokens=3, eos_token_id=-1, pad_token_id=0)
    out = model.generate_batch([[5, 6, 7], [8, 9, 10, 11, 5, 6], [7, 7]], generation_config=config,
                               continuous_batching_config=tiny.cb_config())
    return [{key: value.generated_tokens for key, value in out.items()}], 3


@pytest.mark.parametrize("site", ["plan", "head"])
@pytest.mark.parametrize("path", ["forward", "generate", "pipeline", "batching"])
def test_an_internal_failure_never_reaches_the_host(model, path, site, monkeypatch, caplog):
    from nxl_hooks.hooks.plan import Scoring
    from nxl_hooks.method.head import Head, Readout

    model.generation_config.pad_token_id = 0
    plain, calls = _host_run(model, path)

    def planted(*args, **kwargs):
        raise _Planted("planted failure")

    if site == "plan":  # every path turns LogAt into NormXLogit here (Plan.scores, and the record pipeline's batches)
        monkeypatch.setattr(Scoring, "scores", planted)
    else:  # the head: its gathered readout for a forward, its features for generation steps
        monkeypatch.setattr(*(Readout, "explain") if path == "forward" else (Head, "features"), planted)
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"), nxl.attach(model) as probe:
        attached, _ = _host_run(model, path)
        if path == "forward":
            with pytest.raises(_Planted, match="planted failure"):
                probe.result()  # the reason, for this thread's last forward
    for before, after in zip(plain, attached, strict=True):
        assert torch.equal(before, after) if isinstance(before, torch.Tensor) else before == after
    lines = [r.getMessage() for r in caplog.records if r.name == "nxl_hooks"]
    assert len(lines) == calls and all("planted failure" in line for line in lines)  # one line per failed call
    if path != "forward":
        assert len(probe.calls) == calls
        assert all(not c.complete and c.error == "_Planted: planted failure" for c in probe.calls)  # its type kept
    assert _hook_count(model) == 0


@pytest.mark.parametrize("scored", ["here", "publisher"])
def test_a_model_dropped_while_attached_is_freed_and_its_sink_closed(tmp_path, scored, monkeypatch):
    """Also with the steps scored in the publisher thread (as on a GPU): a batch it has scored holds nothing of the
    model any more."""
    import gc
    import weakref

    from transformers import GenerationConfig

    import tiny
    from nxl_hooks.hooks import generate

    if scored == "publisher":
        monkeypatch.setattr(generate, "SCORED_ELSEWHERE", generate.SCORED_ELSEWHERE | {"cpu"})
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    sink = nxl.Sink(tmp_path / "dropped.nxl")
    probe = nxl.attach(model, sink=sink, keep_calls=4)
    model.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False)
    batch = model.generate_batch([[5, 6], [7, 8, 9]], generation_config=GenerationConfig(
        do_sample=False, max_new_tokens=2, eos_token_id=-1), continuous_batching_config=tiny.cb_config())
    model(input_ids=torch.tensor([[5, 6, 7]]))  # (result() is a plain forward's)
    freed = weakref.ref(model)
    del model
    gc.collect()
    assert freed() is None, "the probe kept the model alive"
    assert not probe.attached  # it detached when the model went
    with pytest.raises(RuntimeError, match="is closed"):
        sink.write_end(probe.calls[0])
    calls = nxl.read_stream(tmp_path / "dropped.nxl")
    assert [(c.complete, len(c.steps)) for c in calls] == [(True, 2)] * 3  # the records stay, in memory and on disk
    assert sorted(c.request_id for c in calls[1:]) == sorted(batch)
    assert probe.result().normxlogit.shape == (3, 1, 3) and probe.describe()["model_class"] == "LlamaForCausalLM"
    with pytest.raises(RuntimeError, match="has been freed"):
        probe.model


def test_nxl_attach_wait_scans_a_big_heap_at_most_a_twentieth_of_the_time(monkeypatch):
    """nxl attach --wait looks for a model by scanning the target's heap, which holds its GIL: a scan of 0.1 s
    every 0.5 s took a sixth of the host's time while it waited; the wait between scans grows with the scan."""
    from types import SimpleNamespace

    from nxl_hooks.apps.serve import remote

    clock, scans = [0.0], []

    def scan():  # a heap whose scan takes 0.1 s, with no model in it yet
        scans.append(clock[0])
        clock[0] += 0.1
        return []

    monkeypatch.setattr(remote, "_scan", scan)
    monkeypatch.setattr(remote, "time", SimpleNamespace(  # the module's clock alone, not the process's
        monotonic=lambda: clock[0], sleep=lambda seconds: clock.__setitem__(0, clock[0] + seconds)))
    assert remote.live_models(wait=60.0) == []
    assert clock[0] >= 60.0 and 0.1 * len(scans) <= 0.05 * clock[0] + 0.1  # the scans' share of the wait


def test_what_made_the_records_is_read_once_per_attach_not_per_forward(ids):
    """The model, dtype, quantization and versions each record's meta names are read when the probe attaches: a
    quantizer's ``to_dict`` (its own code, a deep copy in transformers') ran again for every forward's record. Each
    result still says what the config says, in a dict of its own (one result's edit is not the next one's)."""
    class Counted:
        calls = 0

        def to_dict(self):
            Counted.calls += 1
            return {"quant_method": "counted", "bits": 4}

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)).eval()
    model.config.quantization_config = Counted()
    with torch.no_grad(), nxl.attach(model, layers="last") as probe:
        attached = Counted.calls
        results = []
        for _ in range(3):
            model(input_ids=ids)
            results.append(probe.result())
    assert attached == 1 and Counted.calls == 1
    results[0].meta["quantization"]["bits"] = 8
    assert [res.meta["quantization"] for res in results[1:]] == [{"quant_method": "counted", "bits": 4}] * 2


def test_a_calls_meta_edited_by_its_reader_leaves_the_next_calls_and_the_stream_as_they_were(model, tmp_path):
    """Each call's meta is its own, nested dicts too: a reader's edit of one call's versions changed the next call's
    and the call frames the sink got after it (they shared the hub's dict)."""
    with torch.no_grad(), nxl.attach(model, layers="last", sink=tmp_path / "run.nxl") as probe:
        model.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=1, do_sample=False)
        probe.calls[0].meta["versions"]["torch"] = "edited"
        model.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=1, do_sample=False)
        assert probe.calls[1].meta["versions"]["torch"] == torch.__version__
    assert [call.meta["versions"]["torch"] for call in nxl.read_stream(tmp_path / "run.nxl")] == [torch.__version__] * 2


def test_probe_describe_is_the_callers_to_edit(model):
    """``probe.describe()`` gave each caller the probe's own nested dicts: an edit of its versions changed what every
    later caller read (``nxl ctl``'s records, a stream written with it)."""
    with nxl.attach(model, layers="last") as probe:
        probe.describe()["versions"]["torch"] = "edited"
        assert probe.describe()["versions"]["torch"] == torch.__version__
