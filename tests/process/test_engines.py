"""Serving engines defined outside the package: registered in code (``register_engine``) or through an entry point
of the group ``nxl_hooks.engines``, they are used by ``attach`` and by ``nxl run`` without any edit to nxl_hooks; a
broken engine never breaks attach."""

import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import nxl_hooks as nxl
import tiny
from nxl_hooks.hooks import engines
import oracle
from oracle import check_call
from serving import save_chat_model

#: A third-party engine in one module: a toy server whose ``serve`` recomputes the whole sequence per token, and the
#: engine that records each of its requests as one call (through the public Recording protocol: ``gens.new_run``,
#: ``gens.running``, ``run.finish``). ``GIVEN`` keeps what each engine was given, for the test to see.
TOY_ENGINE = textwrap.dedent('''
    import torch

    GIVEN = []


    class ToyServer:
        def serve(self, model, prompt, new):
            ids = prompt
            with torch.no_grad():
                for _ in range(new):
                    logits = model(input_ids=ids, use_cache=False).logits
                    ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
            return ids


    class ToyEngine:
        name = "toy"
        unfollowed = None

        def claims(self, model):
            return getattr(model.config, "model_type", None) == "llama"

        def install(self, gens):
            GIVEN.append(gens.plan.model)
            original = self._original = ToyServer.__dict__["serve"]
            count = iter(range(10 ** 9))

            def serve(server, model, prompt, new):
                if model is not gens.plan.model:
                    return original(server, model, prompt, new)
                run = gens.new_run(request_id=f"toy-{next(count)}", prompt_len=prompt.shape[1], eos=None)
                with gens.running(run):
                    out = original(server, model, prompt, new)
                run.finish(out)
                return out

            ToyServer.serve = serve

        def uninstall(self):
            ToyServer.serve = self._original

        def stray(self, arguments):
            return None
''')


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy engine's module, written to a folder and imported from there (as a third party's would be)."""
    (tmp_path / "toy_engine.py").write_text(TOY_ENGINE)
    spec = importlib.util.spec_from_file_location("toy_engine", tmp_path / "toy_engine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(engines, "_FACTORIES", dict(engines._FACTORIES))  # the registry as it was, after the test
    return module


@pytest.fixture(scope="module")
def model():
    return tiny.build_model("llama")


def test_an_engine_registered_in_code_is_used_by_attach_and_its_records_equal_the_oracle(toy, model):
    engines.register_engine("toy", toy.ToyEngine)
    prompt = torch.tensor([[5, 9, 12, 7]])
    plain = toy.ToyServer().serve(model, prompt, 3)
    with nxl.attach(model, layers="all") as probe:
        out = toy.ToyServer().serve(model, prompt, 3)
    assert toy.GIVEN == [model]  # claimed and installed once, for this model
    assert toy.ToyServer.serve.__name__ == "serve" and "install" not in toy.ToyServer.serve.__qualname__  # uninstalled
    assert torch.equal(out, plain)
    (call,) = probe.calls
    assert call.request_id == "toy-0" and call.error is None
    check_call(model, call, 3)  # every step equals the uncached oracle
    assert probe.unrecorded is None



def test_an_engine_handing_out_host_tokens_gets_the_records_of_tensor_tokens_an_eos_included(toy, model):
    """``run.emit`` takes the token as the host holds it (an int: what continuous batching and vLLM hand out), made a
    tensor only with the steps it is scored with; the records equal those of the same tokens emitted as tensors, an
    EOS id included (the row pads from the step after it: its later positions leave the context)."""
    given = []

    class Capturing:  # an engine that only keeps what it is given: the test drives the requests itself
        name, unfollowed = "capture", None

        def claims(self, claimed):
            return claimed is model

        def install(self, gens):
            given.append(gens)

        def uninstall(self):
            pass

        def stray(self, arguments):
            return None

    engines.register_engine("capture", Capturing)
    prompt = torch.tensor([[5, 9, 12, 7]])
    with torch.no_grad():
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5,
                             do_sample=False, pad_token_id=0)
    tokens = out[0, prompt.shape[1]:].tolist()
    eos = tokens[1]  # its second token ends the row

    def request(gens, host: bool) -> None:  # a request run one token at a time, each handed out as the host has it
        # wait=None: both requests score their steps together, whatever the clock (a step slower than BATCH_SECONDS
        # on a loaded machine split one into batches of other shapes, whose matmuls differ in the last bit)
        run = gens.new_run(request_id=f"host={host}", prompt_len=prompt.shape[1], eos=[eos], wait=None)
        ids, cache = prompt, None
        with gens.running(run), torch.no_grad():
            for token in tokens:
                forward = model(input_ids=ids, past_key_values=cache, use_cache=True)
                cache, ids = forward.past_key_values, torch.tensor([[token]])
                run.emit(token if host else torch.tensor([token]))
        run.finish(out)

    with nxl.attach(model, layers="all") as probe:
        (gens,) = given
        request(gens, host=True)
        request(gens, host=False)
    as_ints, as_tensors = probe.calls
    assert as_ints.error is None and as_tensors.error is None and len(as_ints.steps) == len(tokens)
    check_call(model, as_ints, len(tokens))  # every step equals the uncached oracle
    assert [bool(step.active) for step in as_ints.steps] == [True, True, False, False, False]
    for ours, theirs in zip(as_ints.steps, as_tensors.steps):
        assert ours.token.dtype == theirs.token.dtype and torch.equal(ours.token, theirs.token)
        assert torch.equal(ours.active, theirs.active) and torch.equal(ours.mask, theirs.mask)
        torch.testing.assert_close(ours.normxlogit, theirs.normxlogit, rtol=0, atol=0)
        torch.testing.assert_close(ours.probability, theirs.probability, rtol=0, atol=0)
    assert not as_ints.steps[-1].mask[0, prompt.shape[1] + 2:].any()  # the positions after the EOS padded


def test_an_engine_that_does_not_claim_the_model_is_not_installed(toy):
    engines.register_engine("toy", toy.ToyEngine)
    from transformers import GPT2Config, GPT2LMHeadModel

    other = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50)).eval()
    with nxl.attach(other) as probe:
        toy.ToyServer().serve(other, torch.tensor([[5, 6, 7]]), 2)
    assert probe.calls == []
    assert toy.GIVEN == []


def test_a_broken_engine_is_left_out_with_one_line_and_attach_works(toy, model, caplog):
    def broken():
        raise ImportError("toy needs a package that is not installed")

    engines.register_engine("broken", broken)
    with pytest.raises(ValueError, match="non-empty name"):
        engines.register_engine("", toy.ToyEngine)
    with pytest.raises(TypeError, match="callable"):
        engines.register_engine("toy", "not a factory")
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"), nxl.attach(model, layers="last") as probe:
        model(input_ids=torch.tensor([[5, 6, 7]]))
    assert probe.result().normxlogit.shape == (1, 1, 3)
    (record,) = [r for r in caplog.records if r.name == "nxl_hooks"]
    assert "'broken'" in record.getMessage() and "not installed" in record.getMessage()


def test_an_engine_that_exits_without_a_message_is_said_by_its_type_once(toy, model, caplog):
    """A bare ``sys.exit()`` in an engine's factory: the log line names SystemExit once (it read 'SystemExit:
    SystemExit', the type given again as the message), and the model is recorded all the same."""
    engines.register_engine("exits", sys.exit)
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"), nxl.attach(model, layers="last") as probe:
        model(input_ids=torch.tensor([[5, 6, 7]]))
    assert probe.result().normxlogit.shape == (1, 1, 3)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "nxl_hooks"]
    assert "engine 'exits' not recorded (SystemExit);" in line and line.count("SystemExit") == 1


class _StrayRaises:
    """An engine that claims every model and whose ``stray`` check (asked at each plain forward) raises."""

    name, unfollowed, asked = "stray-raises", None, 0

    def claims(self, model):
        return True

    def install(self, gens):
        pass

    def uninstall(self):
        pass

    def stray(self, arguments):
        _StrayRaises.asked += 1
        raise RuntimeError("stray check broke")


def test_an_engine_whose_stray_check_raises_is_said_once_and_plain_forwards_are_recorded(toy, model, caplog):
    """Its error read as the forward's own: every plain forward went unrecorded ('this forward not recorded
    (RuntimeError: stray check broke)'), naming no engine."""
    engines.register_engine("stray-raises", _StrayRaises)
    ids = torch.tensor([[5, 6, 7, 9]])
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"), nxl.attach(model, layers="all") as probe:
        for _ in range(2):
            with torch.no_grad():
                out = model(input_ids=ids, output_hidden_states=True)
            res = probe.result()
    logat, expected = oracle.normxlogit(oracle.llama(model).layer_logits(out.hidden_states), out.hidden_states[0],
                                        res.target)
    torch.testing.assert_close(res.logat, logat, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(res.normxlogit, expected, rtol=1e-4, atol=1e-4)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "nxl_hooks"]
    assert "engine 'stray-raises' failed" in line and "stray check broke" in line and _StrayRaises.asked == 1


class _Nameless:
    """An engine without the protocol's ``name`` whose install and uninstall raise: its error was said by name."""

    unfollowed = None

    def claims(self, model):
        return True

    def install(self, gens):
        raise RuntimeError("install broke")

    def uninstall(self):
        raise RuntimeError("uninstall broke")

    def stray(self, arguments):
        return None


def test_an_engine_lacking_part_of_the_protocol_is_left_out_with_one_line(toy, model, caplog):
    """Reporting its failed install read ``engine.name``: an AttributeError raised into attach, the hooks left on."""
    engines.register_engine("nameless", _Nameless)
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"):
        with nxl.attach(model, layers="last") as probe:
            model(input_ids=torch.tensor([[5, 6, 7]]))
    assert probe.result().normxlogit.shape == (1, 1, 3) and nxl.detach_all(model) == 0
    (line,) = [r.getMessage() for r in caplog.records if r.name == "nxl_hooks"]
    assert "engine 'nameless'" in line and "'_Nameless', which lacks name (an Engine has name, unfollowed" in line


def test_nxl_run_finds_an_engine_through_its_entry_point(tmp_path):
    """The engine's package is only on PYTHONPATH, declared by a *.dist-info/entry_points.txt: nothing in nxl_hooks
    names it."""
    site = tmp_path / "site"
    (site / "toy_engine-0.1.dist-info").mkdir(parents=True)
    (site / "toy_engine.py").write_text(TOY_ENGINE)
    (site / "toy_engine-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-engine\n"
                                                                "Version: 0.1\n")
    (site / "toy_engine-0.1.dist-info" / "entry_points.txt").write_text(
        "[nxl_hooks.engines]\ntoy = toy_engine:ToyEngine\n")
    path = save_chat_model(tmp_path / "tiny")
    (tmp_path / "app.py").write_text(textwrap.dedent("""
        import json, sys, torch
        from transformers import AutoModelForCausalLM
        import toy_engine
        model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
        out = toy_engine.ToyServer().serve(model, torch.tensor([[1, 64, 67, 68]]), 3)
        print("FACTS " + json.dumps({"out": out[0].tolist(), "installed": len(toy_engine.GIVEN)}))
    """))
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "nxl_hooks", "run", "--sink", str(run), "--layers", "all", "--",
                           sys.executable, str(tmp_path / "app.py"), str(path)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout.split("FACTS ", 1)[1])
    assert facts["installed"] == 1
    (folder,) = [p for p in run.iterdir() if p.is_dir()]
    (call,) = nxl.read_stream(folder)
    assert call.request_id == "toy-0" and call.sequences[0].tolist() == facts["out"]
    from transformers import LlamaForCausalLM

    check_call(LlamaForCausalLM.from_pretrained(path).eval(), call, 3)
