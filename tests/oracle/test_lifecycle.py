"""Hooks come off in every way a probe can end (detach, garbage collection, nxl.detach_all), and attach works on
torch.compile'd models (issue 12). Compiled with the "eager" backend: whether hooks run is decided by dynamo,
before any backend, and inductor would only add minutes of C++ compilation."""

import gc
import weakref

import pytest
import torch

import nxl_hooks as nxl
import oracle
import tiny
from nxl_hooks.hooks.probe import count_hooks

IDS = torch.tensor([[5, 6, 7, 8, 9]])


_hooks = tiny.nxl_hooks_on


def _expected(model: torch.nn.Module) -> torch.Tensor:
    """NormXLogit (L+1, 1, seq) at the model's own prediction, from the oracle."""
    with torch.no_grad():
        out = model(input_ids=IDS, output_hidden_states=True)
        logits = oracle.llama(model).layer_logits(out.hidden_states)
        return oracle.normxlogit(logits, out.hidden_states[0], out.logits[0, -1].argmax()[None])[1]


# -- the end of a probe ------------------------------------------------------------------------------------


def test_a_probe_dropped_without_detaching_takes_its_hooks_with_it():
    model = tiny.build_model("llama")
    probe = nxl.attach(model)
    model.generate(input_ids=IDS, max_new_tokens=1, do_sample=False, pad_token_id=0)
    assert _hooks(model) > 0 and "generate" in vars(model)
    ref = weakref.ref(probe)
    del probe
    gc.collect()
    assert ref() is None and _hooks(model) == 0 and "generate" not in vars(model)
    with nxl.attach(model) as again:  # and the model is free to attach again
        model(input_ids=IDS)
    torch.testing.assert_close(again.result().normxlogit, _expected(model), rtol=1e-4, atol=1e-5)


def test_a_dropped_model_is_freed_with_its_probe():
    model = tiny.build_model("llama")
    nxl.attach(model)  # never detached, never kept
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_a_model_dropped_right_after_generate_is_freed_by_one_collection_and_its_records_are_whole():
    # The unload idiom, `del model; gc.collect()`, at once after generate returns, with no flush: the record pipeline,
    # still making that call's last records then, holds what it reads (the head), not the model.
    model = tiny.build_model("llama")
    probe = nxl.attach(model)
    model(input_ids=IDS)
    expected, forward = _expected(model), probe.result()
    sequences = model.generate(input_ids=IDS, max_new_tokens=3, do_sample=False, pad_token_id=0)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None and not probe.attached
    (call,) = probe.calls
    assert call.complete and [step.token.item() for step in call.steps] == sequences[0, IDS.shape[1]:].tolist()
    torch.testing.assert_close(forward.normxlogit, expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(RuntimeError, match="recorded generate call"):  # (the last call was: its records are steps)
        probe.result()
    # the first step explains the model's own prediction after the prompt: the forward's record
    torch.testing.assert_close(call.steps[0].normxlogit, expected, rtol=1e-4, atol=1e-5)


def test_detach_all_removes_every_hook_of_a_probe_still_referenced():
    model = tiny.build_model("llama")
    probe = nxl.attach(model, sink=None)
    assert nxl.detach_all(model) == 1
    assert _hooks(model) == 0 and "generate" not in vars(model) and not probe.attached
    assert nxl.detach_all(model) == 0
    probe.detach()  # detaching again is harmless
    with pytest.raises(RuntimeError, match="detached"):
        probe.subscribe()


def test_a_generate_wrapper_set_over_the_probes_stays_after_detach():
    """A wrapper the user (or a tracing library) sets as model.generate while attached stays in place at detach,
    and the probe's under it only passes calls on (detach once took it out with the probe's); a later probe records
    through it; a generate of the user's own is no hook of nxl_hooks (count_hooks counted it)."""
    model = tiny.build_model("llama")
    generate = dict(input_ids=IDS, max_new_tokens=2, do_sample=False, pad_token_id=0)
    plain = model.generate(**generate)
    calls = []
    with nxl.attach(model) as probe:
        inner = model.generate

        def logged(*args, **kwargs):
            calls.append(1)
            return inner(*args, **kwargs)

        model.generate = logged
        assert torch.equal(model.generate(**generate), plain)
    assert vars(model)["generate"] is logged and _hooks(model) == 0 and len(probe.calls) == 1
    assert torch.equal(model.generate(**generate), plain) and len(calls) == 2 and len(probe.calls) == 1
    with nxl.attach(model) as again:
        assert _hooks(model) > 0
        model.generate(**generate)
    assert vars(model)["generate"] is logged and _hooks(model) == 0 and len(calls) == 3
    (call,) = again.calls
    oracle.check_call(model, call, 2)
    fresh = tiny.build_model("llama")
    fresh.generate = lambda *args, **kwargs: None  # never attached
    assert count_hooks(fresh) == 0


def test_a_generate_wrapper_made_with_functools_wraps_is_the_users_not_the_probes():
    """``functools.wraps(model.generate)`` copies every attribute of the probe's wrapper onto the user's (it once
    copied the probe's mark, so count_hooks, and ``nxl detach``/``nxl ctl status``, counted the user's generate as
    a hook of nxl_hooks after detach): at detach it stays, counted as none, and records nothing."""
    import functools

    model = tiny.build_model("llama")
    generate = dict(input_ids=IDS, max_new_tokens=2, do_sample=False, pad_token_id=0)
    plain = model.generate(**generate)
    with nxl.attach(model) as probe:
        with_wrapper = count_hooks(model)
        inner = model.generate

        @functools.wraps(inner)
        def mine(*args, **kwargs):
            return inner(*args, **kwargs)

        model.generate = mine
        assert count_hooks(model) == with_wrapper - 1  # the model's generate is the user's now, the probe's under it
        assert torch.equal(model.generate(**generate), plain)
    assert vars(model)["generate"] is mine and count_hooks(model) == 0 and _hooks(model) == 0
    assert torch.equal(model.generate(**generate), plain) and len(probe.calls) == 1
    oracle.check_call(model, probe.calls[0], 2)


def test_a_copy_made_while_attached_is_the_plain_model(tmp_path):
    """copy.deepcopy(model) and torch.save(model) while attached raised into the user's code (the probe's hooks and
    generate wrapper hold its locks): the copy is the plain model now, unrecorded, its outputs the model's own."""
    import copy

    model = tiny.build_model("llama")
    with torch.no_grad():
        plain = model(input_ids=IDS).logits
    generate = dict(input_ids=IDS, max_new_tokens=2, do_sample=False, pad_token_id=0)
    generated = model.generate(**generate)
    with nxl.attach(model) as probe:
        twin = copy.deepcopy(model)
        torch.save(model, tmp_path / "model.pt")
        loaded = torch.load(tmp_path / "model.pt", weights_only=False)
        for each in (twin, loaded):
            assert _hooks(each) == 0
            with torch.no_grad():
                torch.testing.assert_close(each(input_ids=IDS).logits, plain, rtol=0, atol=0)
            assert torch.equal(each.generate(**generate), generated)
        assert probe.calls == []  # nothing of the copies reached the probe
        with pytest.raises(RuntimeError, match="no forward has run under this probe"):
            probe.result()
        model(input_ids=IDS)
    torch.testing.assert_close(probe.result().normxlogit, _expected(model), rtol=1e-4, atol=1e-5)
    with nxl.attach(twin) as again:  # a copy is attached to as any model
        twin(input_ids=IDS)
    torch.testing.assert_close(again.result().normxlogit, _expected(twin), rtol=1e-4, atol=1e-5)


def test_a_detach_ctrl_c_cut_short_is_finished_by_the_next_one(monkeypatch):
    """A Ctrl-C landing while detach ran (simulated: at its second hook's removal) marked the probe detached with
    hooks still on: neither probe.detach() nor detach_all took them off, and attaching again stacked new ones."""
    model = tiny.build_model("llama")
    probe = nxl.attach(model)
    model.generate(input_ids=IDS, max_new_tokens=1, do_sample=False, pad_token_id=0)
    remove, removed = torch.utils.hooks.RemovableHandle.remove, []

    def ctrl_c_at_the_second(handle):
        removed.append(handle)
        if len(removed) == 2:
            raise KeyboardInterrupt
        remove(handle)

    monkeypatch.setattr(torch.utils.hooks.RemovableHandle, "remove", ctrl_c_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        probe.detach()
    monkeypatch.undo()
    assert probe.attached and 0 < _hooks(model)
    with pytest.raises(RuntimeError, match="already attached"):
        nxl.attach(model)
    probe.detach()
    assert not probe.attached and _hooks(model) == 0 and "generate" not in vars(model)
    with nxl.attach(model) as again:
        model(input_ids=IDS)
    assert _hooks(model) == 0
    torch.testing.assert_close(again.result().normxlogit, _expected(model), rtol=1e-4, atol=1e-5)


def _model_state(model: torch.nn.Module) -> dict:
    """What attaching may change on ``model``: each module's hooks, attributes and forward, and generate."""
    return {name: (dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(vars(m)), m.forward)
            for name, m in model.named_modules()} | {"generate": model.generate}


@pytest.mark.parametrize("where", ["generate's wrapper", "compiled code", "the probe"])
def test_an_attach_ctrl_c_cut_short_leaves_the_model_as_it_was(monkeypatch, where):
    """A Ctrl-C landing while attach ran, once the hooks were on (simulated: at the generate wrapper's second
    attribute, at the compiled-code step, at the probe's making) left the hooks and the generate wrapper on the model
    with no probe to take them off: detach_all found none, and attaching again stacked a second set."""
    from nxl_hooks.hooks import generate, probe as probe_module

    model = torch.compile(tiny.build_model("llama"), backend="eager")
    before = _model_state(model._orig_mod) | {"forward": model.forward}
    calls = []

    def ctrl_c(real):
        def interrupted(*args, **kwargs):
            calls.append(real)
            if len(calls) == 2 or where != "generate's wrapper":
                raise KeyboardInterrupt
            return real(*args, **kwargs)
        return interrupted

    if where == "generate's wrapper":
        monkeypatch.setattr(generate.Generations, "_set", ctrl_c(generate.Generations._set))
    elif where == "compiled code":
        monkeypatch.setattr(probe_module, "reset_compiled", ctrl_c(probe_module.reset_compiled))
    else:
        monkeypatch.setattr(probe_module.Probe, "__init__", ctrl_c(probe_module.Probe.__init__))
    with pytest.raises(KeyboardInterrupt):
        nxl.attach(model)
    monkeypatch.undo()
    assert _hooks(model._orig_mod) == 0 and nxl.detach_all(model) == 0
    assert _model_state(model._orig_mod) | {"forward": model.forward} == before
    with nxl.attach(model) as again:
        model(input_ids=IDS)
    assert _hooks(model._orig_mod) == 0
    torch.testing.assert_close(again.result().normxlogit, _expected(model._orig_mod), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("where", ["model.layers.1", "model.layers.0", "input embedding", "backbone"])
def test_a_hooked_module_replaced_while_attached_is_said_replaced(where):
    """A module the probe hooks, replaced while attached, no longer runs its hooks: the forward and generate call
    then said a wrong reason (the config runs fewer blocks, inputs_embeds given, torch.compile), which sent the user
    to change what was right. They say the module was replaced; attached again, the records are the oracle's."""
    import copy

    model = tiny.build_model("llama")
    with nxl.attach(model, embedding="word" if where == "input embedding" else "layer_input") as probe:
        if where == "input embedding":
            model.set_input_embeddings(copy.deepcopy(model.get_input_embeddings()))
        elif where == "backbone":
            model.model = copy.deepcopy(model.model)
        else:  # a block
            index = int(where[-1])
            model.model.layers[index] = copy.deepcopy(model.model.layers[index])
        model(input_ids=IDS)
        with pytest.raises(RuntimeError, match=f"the model's {where} is another module than when the probe attached"):
            probe.result()
        model.generate(input_ids=IDS, max_new_tokens=2, do_sample=False, pad_token_id=0)
        assert f"the model's {where} is another module" in probe.calls[-1].error and probe.unrecorded_calls == 1
    with nxl.attach(model) as again:
        model(input_ids=IDS)
    torch.testing.assert_close(again.result().normxlogit, _expected(model), rtol=1e-4, atol=1e-5)


def test_detach_all_through_a_peft_wrapper_and_a_compile_wrapper():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny.build_model("llama"), LoraConfig(r=2, target_modules=["q_proj"]))
    compiled = torch.compile(model, backend="eager")
    probe = nxl.attach(model)
    assert _hooks(model) > 0
    assert nxl.detach_all(compiled) == 1 and _hooks(model) == 0 and not probe.attached


def test_peek_in_a_hook_of_the_users_gives_the_forward_it_runs_after():
    """docs/python.md: peek() "for a hook of yours that runs after each forward". The probe's hook that records a
    forward ran after the user's hooks already on the model (one registered before attaching, or kept across
    probes): peek() there gave the forward before, or None."""
    model = tiny.build_model("llama")
    inputs = [IDS, IDS[:, :3]]
    expected = []
    for ids in inputs:
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True)
        logits = oracle.llama(model).layer_logits(out.hidden_states)
        expected.append(oracle.normxlogit(logits, out.hidden_states[0], out.logits[0, -1].argmax()[None])[1])
    peeked, current = [], {}
    handle = model.register_forward_hook(lambda module, args, output: peeked.append(current["probe"].peek()))
    try:
        for _ in ("the first probe", "a second one"):
            with torch.no_grad(), nxl.attach(model) as probe:
                current["probe"] = probe
                peeked.clear()
                for ids in inputs:
                    model(input_ids=ids)
            assert [type(last).__name__ for last in peeked] == ["Attribution", "Attribution"]
            for last, ids, normxlogit in zip(peeked, inputs, expected):
                assert last.input_ids.tolist() == ids.tolist()
                torch.testing.assert_close(last.normxlogit, normxlogit, rtol=1e-4, atol=1e-5)
    finally:
        handle.remove()


def test_hooks_of_the_users_on_the_head_see_the_models_own_calls_only():
    """The probe computes every layer's HoT with the model's final norm (and checks its RMS fold on it at attach): a
    forward hook of the user's on model.model.norm, collecting the final normed states, got the probe's calls too,
    with (positions, layers, d) tensors of every layer."""
    model = tiny.build_model("llama")
    norm_inputs, head_inputs = [], []
    hooks = [model.model.norm.register_forward_hook(lambda module, args, output: norm_inputs.append(args[0])),
             model.lm_head.register_forward_hook(lambda module, args, output: head_inputs.append(args[0]))]

    def run() -> None:
        with torch.no_grad():
            model(input_ids=IDS)
            model.generate(input_ids=IDS, max_new_tokens=3, do_sample=False, pad_token_id=0)

    try:
        run()
        plain = list(norm_inputs), list(head_inputs)
        norm_inputs.clear()
        head_inputs.clear()
        with nxl.attach(model) as probe:  # (attaching checks the norm's fold on it)
            run()
            probe.flush()  # (generate's records are scored in a thread of their own)
        attached = norm_inputs, head_inputs
    finally:
        for handle in hooks:
            handle.remove()
    assert [len(seen) for seen in plain] == [4, 4]  # the forward, then generate's three steps
    for seen, expected in zip(attached, plain):
        assert [tuple(t.shape) for t in seen] == [tuple(t.shape) for t in expected]
        for got, want in zip(seen, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert probe.calls[0].error is None and len(probe.calls[0].steps) == 3  # (recorded all the same)


# -- torch.compile -----------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # compiled code of one test must not decide what another one sees
    yield
    torch._dynamo.reset()


def test_attach_to_a_compiled_wrapper_records_and_gives_the_compiled_code_back():
    model = tiny.build_model("llama")
    compiled = torch.compile(model, backend="eager")
    plain = compiled(input_ids=IDS).logits  # compiled (and run) before attaching
    with nxl.attach(compiled, tokenizer=tiny.tokenizer()) as probe:
        during = compiled(input_ids=IDS).logits
    torch.testing.assert_close(probe.result().normxlogit, _expected(model), rtol=1e-4, atol=1e-5)
    assert torch.equal(plain, during)
    assert _hooks(model) == 0 and "forward" in vars(compiled) and vars(compiled)["forward"] is not model.__call__
    assert not any(name.startswith("_nxl_hooks") for name in vars(compiled))
    torch.testing.assert_close(compiled(input_ids=IDS).logits, plain)


def test_a_model_compiled_in_place_and_run_before_attaching_is_recorded():
    model = tiny.build_model("llama")
    model.compile(backend="eager")
    compiled_call = model._compiled_call_impl
    model(input_ids=IDS)  # dynamo compiled the forward without hooks: that code would never call them
    with nxl.attach(model) as probe:
        model(input_ids=IDS)
        assert model._compiled_call_impl is None  # eager while attached
    torch.testing.assert_close(probe.result().normxlogit, _expected(model), rtol=1e-4, atol=1e-5)
    assert model._compiled_call_impl is compiled_call


def test_compiled_code_that_skips_the_hooks_is_named_in_result():
    """A compiled wrapper made elsewhere (the probe cannot see it) and run before attach: the task model's own hooks
    run (outside dynamo), its blocks' do not. result() says so and what to do."""
    model = tiny.build_model("llama")
    compiled = torch.compile(model, backend="eager")
    compiled(input_ids=IDS)
    with nxl.attach(model) as probe:
        compiled(input_ids=IDS)
        with pytest.raises(RuntimeError, match="blocks never reached the probe's hooks.*torch.compile.*"
                                               "nxl.attach\\(compiled\\).*force_eager"):
            probe.result()
        with torch.compiler.set_stance("force_eager"):  # what the message suggests
            compiled(input_ids=IDS)
        torch.testing.assert_close(probe.result().normxlogit, _expected(model), rtol=1e-4, atol=1e-5)


def test_generate_on_a_compiled_wrapper_is_recorded():
    model = tiny.build_model("llama")
    compiled = torch.compile(model, backend="eager")
    with nxl.attach(compiled) as probe:
        out = compiled.generate(input_ids=IDS, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert [int(s.token) for s in probe.steps] == out[0, 5:].tolist()
    hand = oracle.llama(model)
    for step in probe.steps:
        logits, embeddings = oracle.prefix_logits(model, hand, out[:, : step.position],
                                                  torch.ones(1, step.position, dtype=torch.bool))
        torch.testing.assert_close(step.normxlogit, oracle.normxlogit(logits, embeddings, step.token)[1],
                                   rtol=1e-4, atol=1e-4)
