"""How the commands load models: GGUF files (as MODEL, or a folder plus --gguf-file, also as the audit's candidate),
GGUF with bitsandbytes, --dtype / --device-map / --max-memory, --chat, and one-line errors for combinations that
cannot work. A tiny GGUF file is written here from a random Llama (tests/bpe_tiny.py); numbers are checked against
the oracle on the original model."""

import json
import logging
import os
import re
import stat
import subprocess
import sys

import pytest
import torch

import bpe_tiny
import nxl_hooks as nxl
import oracle
import tiny
from nxl_hooks.apps.cli import build_parser, main
from nxl_hooks.apps.loading import load_model
from nxl_hooks.apps.options import loading_options

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(original model, tokenizer, its folder, its GGUF file)."""
    root = tmp_path_factory.mktemp("gguf")
    tok = bpe_tiny.bpe_tokenizer()
    model = bpe_tiny.bpe_llama(tok)
    folder = bpe_tiny.save_bpe(root / "hf", model, tok)
    return model, tok, folder, bpe_tiny.write_gguf(root / "tiny.gguf", model, tok)


#: the matrices of each block of the tiny Llama, by their GGUF names: what a quantized GGUF file stores in blocks
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@pytest.fixture(scope="module")
def q8_0(world, tmp_path_factory):
    """(the world's model as a GGUF file whose matrices are Q8_0 blocks and whose header says MOSTLY_Q8_0, though
    its name says Q4_1, the number of matrices)."""
    import gguf

    model, tok, _, _ = world
    matrices = tuple(f"blk.{i}.{name}.weight" for i in range(model.config.num_hidden_layers) for name in MATRICES)
    path = tmp_path_factory.mktemp("q8_0") / "tiny.Q4_1.gguf"
    bpe_tiny.write_gguf(path, model, tok, q8_0=matrices, header={"file_type": gguf.LlamaFileType.MOSTLY_Q8_0})
    return path, len(matrices)


def oracle_normxlogit(model, tok, text: str, target: int) -> torch.Tensor:
    enc = tok(text, return_tensors="pt")
    with torch.no_grad():
        out = model(**enc, output_hidden_states=True)
    logits = oracle.llama(model).layer_logits(out.hidden_states)
    return oracle.normxlogit(logits, out.hidden_states[0], torch.tensor([target]))[1]


def test_gguf_loads_as_a_plain_model_with_its_tokenizer(world, tmp_path):
    model, tok, _, gguf = world
    loaded, loaded_tok = load_model(str(gguf))
    assert type(loaded).__name__ == "LlamaForCausalLM" and loaded.dtype == torch.float32
    # transformers dequantized the weights: the model must not claim to be quantized (save_pretrained refuses it)
    assert not loaded.is_quantized and loaded.hf_quantizer is None
    loaded.save_pretrained(tmp_path / "copy")
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    assert loaded_tok(PROMPT, return_tensors="pt")["input_ids"].tolist() == ids.tolist()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert load_model(str(gguf), dtype="bfloat16")[0].dtype == torch.bfloat16


def test_a_gguf_models_records_say_its_files_quantization_as_its_header_does_not_its_name(world, q8_0, tmp_path):
    """transformers dequantizes a GGUF file's weights as it loads, so its records said quantization None, and only
    the file's name (which may lie) told what their numbers came from. Here a file named Q4_1 holds Q8_0 blocks:
    each record (live, saved, in a stream file) says what its header says, as gguf's reader reads it, and the dtype
    the weights were dequantized to. The model saved again holds plain weights, and says none, as one read from a
    folder does; one record's meta changed by its reader leaves the next record's as it was."""
    model, tok, folder, _ = world
    path, quantized = q8_0
    header = oracle.gguf_quantization(path)
    assert header == {"quant_method": "gguf", "file_type": "MOSTLY_Q8_0",
                      "tensor_types": {"Q8_0": quantized, "F32": 2 + 9 * model.config.num_hidden_layers - quantized}}
    loaded, _ = load_model(str(path))
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        gap, scale = (loaded(ids).logits - model(ids).logits).abs().max(), model(ids).logits.abs().max()
    assert 0 < gap < 0.05 * scale  # the Q8_0 blocks were dequantized: close to the float model, not equal to it
    expected = {**header, "dequantized_to": "float32"}
    with torch.no_grad(), nxl.attach(loaded, layers="last", sink=tmp_path / "run.nxl") as probe:
        loaded(ids)
        probe.result().meta["quantization"]["tensor_types"]["Q8_0"] = 0  # the reader's to change
        loaded(ids)
        second = probe.result()
        loaded.generate(ids, max_new_tokens=2, do_sample=False)
    assert second.meta["quantization"] == expected
    second.save(tmp_path / "a.safetensors")
    assert nxl.Attribution.load(tmp_path / "a.safetensors").meta["quantization"] == expected
    calls = nxl.read_stream(tmp_path / "run.nxl")
    assert calls and [call.meta["quantization"] for call in calls] == [expected] * len(calls)
    assert nxl.explain(load_model(str(path), dtype="bfloat16")[0], tok, PROMPT).meta["quantization"] == {
        **header, "dequantized_to": "bfloat16"}
    loaded.save_pretrained(tmp_path / "copy")
    tok.save_pretrained(tmp_path / "copy")
    assert "gguf" not in (tmp_path / "copy" / "config.json").read_text()
    for plain in (tmp_path / "copy", folder):
        assert nxl.explain(load_model(str(plain))[0], tok, PROMPT).meta["quantization"] is None


def test_a_hub_gguf_files_quantization_is_read_from_the_cache_it_was_fetched_into(q8_0, tmp_path, monkeypatch):
    """A GGUF file of a hub repository (here in the hub cache, offline) is read by transformers from the cache: its
    header is read there too, and its model's records say what it says. (The default cache, not cache_dir=:
    transformers 5.25's tokenizer reads a GGUF file without being told cache_dir.)"""
    from huggingface_hub import constants

    from nxl_hooks.method.placement import quantization

    path, _ = q8_0
    commit = "1" * 40
    repo = tmp_path / "cache" / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "tiny.gguf").write_bytes(path.read_bytes())
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    loaded, _ = load_model("org/tiny", gguf_file="tiny.gguf", local_files_only=True)
    assert quantization(loaded) == {**oracle.gguf_quantization(path), "dequantized_to": "float32"}


def test_a_gguf_load_says_nothing_of_tensor_parallel_sharding(world):
    """A GGUF file loaded in one process logged transformers' tensor-parallel check, "The following layers were not
    sharded: model.norm.weight, ...": quieting the load report raised the level of the logger that transformers reads
    to decide whether to check its plan. The report stays quiet, and the model is the original one."""
    model, _, _, gguf = world
    said: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = said.append
    sharding = logging.getLogger("transformers.distributed.tensor_parallel")
    level = sharding.level
    sharding.setLevel(logging.WARNING)  # (whatever verbosity an earlier test left transformers in)
    sharding.addHandler(handler)
    try:
        loaded, _ = load_model(str(gguf))
    finally:
        sharding.removeHandler(handler)
        sharding.setLevel(level)
    assert [record.getMessage() for record in said] == []
    ids = torch.tensor([[5, 9, 14, 20]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_nxl_run_gguf_file_reaches_an_auto_class_load_of_a_folder_holding_the_gguf_alone(world, tmp_path):
    """``nxl run --gguf-file`` is a default of the program's own loads, AutoModelFor* ones too: an auto class reads
    the config first, which a folder holding only the GGUF file has in the file alone (it failed there, "no
    config.json", and the program's load raised); the model it loads is recorded, every step against the oracle
    (the original model: the GGUF holds its weights exactly)."""
    model, _, _, gguf = world
    folder = tmp_path / "only"
    folder.mkdir()
    (folder / "tiny.gguf").write_bytes(gguf.read_bytes())
    code = ("import sys, torch\nfrom transformers import AutoModelForCausalLM\n"
            "m = AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
            "print('OUT', m.generate(input_ids=torch.tensor([[5, 9, 14, 20]]), max_new_tokens=3, do_sample=False,"
            " pad_token_id=0)[0].tolist())\n")
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "nxl_hooks", "run", "--gguf-file", "tiny.gguf", "--sink", str(run),
                           "--layers", "all", "--", sys.executable, "-c", code, str(folder)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert "not applied" not in done.stderr, done.stderr
    (call,) = nxl.read_stream(run)
    assert call.sequences[0].tolist() == json.loads(done.stdout.split("OUT ")[1])
    oracle.check_call(model, call, 3)


@pytest.mark.parametrize("how", ["file", "folder"])
def test_cli_attributes_a_gguf_model(world, tmp_path, capsys, how):
    model, tok, _, gguf = world
    source = [str(gguf)] if how == "file" else [str(gguf.parent), "--gguf-file", gguf.name]
    out = tmp_path / "a.safetensors"
    assert main(["attribute", *source, PROMPT, "--target", "Paris", "--out", str(out)]) == 0
    assert "'Paris' -> '␣Paris'" in capsys.readouterr().out
    res = nxl.Attribution.load(out)
    paris = tok.convert_tokens_to_ids("ĠParis")
    assert int(res.target[0]) == paris and res.readable[0] == ["The", "␣capital", "␣of", "␣France", "␣is"]
    torch.testing.assert_close(res.normxlogit[:, 0], oracle_normxlogit(model, tok, PROMPT, paris)[:, 0],
                               rtol=1e-4, atol=1e-5)
    # named by the GGUF file it was read from, not the folder holding it (which may hold other weights), with what
    # its header says of it (all float32, no file type written), whose weights were dequantized as it loaded
    assert res.meta["model"] == str(gguf)
    assert res.meta["quantization"] == {**oracle.gguf_quantization(gguf), "dequantized_to": "float32"}
    assert res.meta["quantization"]["tensor_types"] == {"F32": 2 + 9 * model.config.num_hidden_layers}


@pytest.mark.parametrize("how", ["map", "auto", "auto-folder"])
def test_cli_refuses_to_offload_a_gguf_model_to_disk_in_one_line(world, tmp_path, capsys, how):
    """transformers cannot: a map naming disk raised RuntimeError, which ended nxl attribute in a traceback; auto
    with too little --max-memory asked for an `offload_folder` (no flag's), and with one loaded a model whose forward
    failed (KeyError 'lm_head.weight')."""
    model, _, _, gguf = world
    places = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "disk", "lm_head": "disk",
              **{f"model.layers.{i}": "cpu" for i in range(model.config.num_hidden_layers)}}
    placement = (["--device-map", json.dumps(places)] if how == "map" else
                 ["--device-map", "auto", "--max-memory", "cpu=30KB"] +
                 (["--offload-folder", str(tmp_path / "offload")] if how == "auto-folder" else []))
    assert main(["attribute", str(gguf), PROMPT, *placement]) == 2
    err = capsys.readouterr().err  # (progress bars may come first: auto places the weights once read)
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and "cannot offload a GGUF model to disk" in errors[0] and "Traceback" not in err
    assert err.rstrip().endswith(errors[0])


def test_offload_folder_takes_the_weights_transformers_writes_anew(tmp_path, capsys):
    """A MoE model offloaded to disk: transformers writes its experts anew and asked for an `offload_folder`, which
    no flag set (exit 2 with its from_pretrained advice); --offload-folder gives it one, and the numbers are the
    oracle's on the model in memory. Without it, one line naming the flag."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(**tiny._SIZES, num_key_value_heads=2, num_local_experts=4,
                                             num_experts_per_tok=2)).eval()
    folder = tiny.save_model(tmp_path / "mixtral", "mixtral", model=model)
    argv = ["attribute", str(folder), "the film was", "--device-map", "auto", "--max-memory", "cpu=30KB"]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("pass --offload-folder DIR (offload_folder=) "
                                                                    "for them")
    out, offload = tmp_path / "a.safetensors", tmp_path / "offload"
    assert main([*argv, "--offload-folder", str(offload), "--out", str(out)]) == 0
    capsys.readouterr()
    assert any(offload.iterdir())  # the experts, written anew
    res = nxl.Attribution.load(out)
    expected = oracle_normxlogit(model, tiny.tokenizer(), "the film was", int(res.target[0]))
    torch.testing.assert_close(res.normxlogit[:, 0], expected[:, 0], rtol=1e-4, atol=1e-5)
    assert main([*argv, "--offload-folder", str(folder / "offload")]) == 2  # the model's folder is an input
    assert "would write into" in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("head", ["sequence_classification", "masked_lm"])
def test_a_gguf_file_with_another_head_is_told_what_it_holds(world, capsys, head):
    """A sound file with --head of another kind was said to be damaged ("download or convert it again"); the line
    names the keyword too (head=), for load_model."""
    gguf = world[3]
    assert main(["attribute", str(gguf), PROMPT, "--head", head]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(f"a GGUF file holds a causal language model, not a {head} head: use "
                                             "--head causal_lm (head=), or drop --head (head=)") \
        and "damaged" not in err[0]
    with pytest.raises(ValueError, match=re.escape("use --head causal_lm (head=), or drop --head (head=)")):
        load_model(str(gguf), head=head)  # Python: the keyword is named too


@pytest.mark.parametrize("mode, linear", [("8bit", "Linear8bitLt"), ("4bit", "Linear4bit")])
def test_gguf_with_bitsandbytes_is_quantized_in_memory(world, mode, linear):
    model, tok, _, gguf = world
    quantized, _ = load_model(str(gguf), quantize=mode)
    assert type(quantized.model.layers[0].mlp.up_proj).__name__ == linear and quantized.is_quantized
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        gap = (quantized(ids).logits - model(ids).logits).abs().max()
        scale = model(ids).logits.abs().max()
    assert 0 < gap < 0.2 * scale  # quantized: close to the original, not equal to it
    res = nxl.explain(quantized, tok, PROMPT)
    with torch.no_grad():
        own = quantized(ids).logits[0, -1]
    torch.testing.assert_close(res.logat[-1, 0, -1], own[res.target[0]], rtol=1e-3, atol=1e-4)
    # both quantizations made these numbers: bitsandbytes', and the GGUF file's its weights were dequantized from
    said = res.meta["quantization"]
    assert said["quant_method"] == "bitsandbytes" and said[f"load_in_{mode}"] is True
    assert said["dequantized_from"] == {**oracle.gguf_quantization(gguf), "dequantized_to": "float32"}


def test_audit_takes_a_gguf_candidate_and_quantizes_a_gguf_reference(world, tmp_path, capsys):
    _, _, folder, gguf = world
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in (PROMPT, "The keys to the cabinet")))
    assert main(["audit", "--reference", str(folder), "--candidate", str(gguf), str(data), "--out",
                 str(tmp_path / "same")]) == 0
    summary = json.loads((tmp_path / "same" / "summary.json").read_text())
    assert summary["agreement"] == 1.0 and summary["last_layer"]["drift"] == 0.0  # the same weights
    assert main(["audit", "--reference", str(gguf), "--quantize", "8bit", str(data), "--out",
                 str(tmp_path / "q")]) == 0
    records = [json.loads(line) for line in (tmp_path / "q" / "records.jsonl").read_text().splitlines()]
    assert records[0]["readable"] == ["The", "␣capital", "␣of", "␣France", "␣is"]
    assert all(0 < r["drift"][-1] for r in records)
    capsys.readouterr()


def test_loading_options_reach_from_pretrained(world, tmp_path, capsys):
    model, tok, folder, _ = world
    args = build_parser().parse_args(["attribute", str(folder), "x", "--dtype", "bfloat16", "--head", "causal_lm"])
    options = loading_options(args)
    assert options == {"head": "causal_lm", "dtype": "bfloat16", "device_map": None, "max_memory": None,
                       "offload_folder": None, "quantize": None, "gguf_file": None}
    assert load_model(str(folder), **options)[0].dtype == torch.bfloat16
    # 100 KB of CPU memory: accelerate offloads every weight to disk, and the numbers stay the oracle's
    out = tmp_path / "a.safetensors"
    assert main(["attribute", str(folder), PROMPT, "--device-map", "auto", "--max-memory", "cpu=100KB",
                 "--target", "Paris", "--out", str(out)]) == 0
    capsys.readouterr()
    offloaded, _ = load_model(str(folder), device_map="auto", max_memory={"cpu": "100KB"})
    assert offloaded.hf_device_map == {"": "disk"}
    paris = tok.convert_tokens_to_ids("ĠParis")
    torch.testing.assert_close(nxl.Attribution.load(out).normxlogit[:, 0],
                               oracle_normxlogit(model, tok, PROMPT, paris)[:, 0], rtol=1e-4, atol=1e-5)
    with pytest.MonkeyPatch.context() as patch:  # max_memory's device 0: one this machine is said to have
        patch.setattr(torch.accelerator, "device_count", lambda: 1)
        args = build_parser().parse_args(["evaluate", "m", "d", "--out", "o", "--load-in-4bit",
                                          "--device-map", '{"": "cpu"}', "--max-memory", "0=2GiB,cpu=3GiB"])
        assert loading_options(args)["quantize"] == "4bit" and args.device_map == {"": "cpu"}
    assert args.max_memory == {0: "2GiB", "cpu": "3GiB"}


@pytest.mark.parametrize("embedding", ["layer_input", "word"])
def test_a_float64_model_is_recorded_with_the_float64_oracles_numbers(world, embedding):
    """A float64 model (load_model takes "or a torch dtype") is recorded: its embedding norms are taken in float64,
    not refused by a norm asked for in float32 (which narrows it)."""
    model, tok, folder, _ = world
    double, _ = load_model(str(folder), dtype=torch.float64)
    assert double.dtype == torch.float64
    res = nxl.explain(double, tok, PROMPT, embedding=embedding)
    enc = tok(PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = double(**enc, output_hidden_states=True)
    target = int(out.logits[0, -1].argmax())
    hand, last = oracle.llama(double), len(out.hidden_states) - 1  # in float64: layer_logits would round to float32
    normed = torch.stack([h if i == last else hand.norm(h) for i, h in enumerate(out.hidden_states)])
    ref = hand.head(normed)[:, 0, :, target] * out.hidden_states[0][0].norm(dim=-1)
    assert ref.dtype == torch.float64
    assert res.target[0].item() == target and res.normxlogit.dtype == torch.float32
    torch.testing.assert_close(res.normxlogit[:, 0].double(), ref, rtol=1e-6, atol=1e-7)


def test_a_float64_models_prediction_is_its_own_argmax_where_float32_would_tie_two_logits(world):
    """Two float64 logits 1e-12 apart at the prediction position: the predicted target is the model's argmax, the
    larger one (its logits were rounded to float32 first, where both are one number: the first of them was taken)."""
    _, tok, folder, _ = world
    double, _ = load_model(str(folder), dtype=torch.float64)
    enc = tok(PROMPT, return_tensors="pt")
    own = tiny.tie_below_float32(double, **enc)
    top = int(own.argmax())
    with torch.no_grad(), nxl.attach(double, layers="last") as probe:
        double(**enc)
    assert own[top - 1] < own[top] and own[top - 1].float() == own[top].float()
    assert probe.result().target.tolist() == [int(own.argmax())] == [top]


def test_the_mapping_the_disk_refusal_advises_loads(world, tmp_path, capsys):
    """--device-map disk is refused with a mapping to give instead: it advised {"lm_head": "disk", "": "cpu"}, which
    failed to load ("weight is on the meta device")."""
    model, tok, folder, _ = world
    assert main(["attribute", str(folder), PROMPT, "--device-map", "disk"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    advice = re.search(r"such as a Llama-like decoder's (\{.*\})", line).group(1)  # (this world is a Llama)
    out = tmp_path / "a.safetensors"
    assert main(["attribute", str(folder), PROMPT, "--device-map", advice, "--target", "Paris", "--out", str(out)]) == 0
    capsys.readouterr()
    assert "disk" in json.loads(advice).values()
    paris = tok.convert_tokens_to_ids("ĠParis")
    torch.testing.assert_close(nxl.Attribution.load(out).normxlogit[:, 0],
                               oracle_normxlogit(model, tok, PROMPT, paris)[:, 0], rtol=1e-4, atol=1e-5)


def test_max_memory_in_bytes_offloads_as_a_unit_does(world, tmp_path, capsys):
    """Digits alone are bytes (as accelerate's own message asks): --max-memory kept them as text, which accelerate
    refused ("Use an integer for bytes")."""
    model, tok, folder, _ = world
    out = tmp_path / "a.safetensors"
    assert main(["attribute", str(folder), PROMPT, "--device-map", "auto", "--max-memory", "cpu=100000",
                 "--target", "Paris", "--out", str(out)]) == 0
    capsys.readouterr()
    paris = tok.convert_tokens_to_ids("ĠParis")
    torch.testing.assert_close(nxl.Attribution.load(out).normxlogit[:, 0],
                               oracle_normxlogit(model, tok, PROMPT, paris)[:, 0], rtol=1e-4, atol=1e-5)


def test_chat_wraps_the_text_in_the_template(world, tmp_path, capsys):
    model, tok, folder, _ = world
    out = tmp_path / "chat.safetensors"
    assert main(["attribute", str(folder), "What is the capital of France?", "--chat", "--out", str(out)]) == 0
    capsys.readouterr()
    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    res = nxl.Attribution.load(out)
    assert res.input_ids[0].tolist() == tok(text)["input_ids"] and res.readable[0][-1] == "↵"
    target = int(res.target[0])
    torch.testing.assert_close(res.normxlogit[:, 0], oracle_normxlogit(model, tok, text, target)[:, 0],
                               rtol=1e-4, atol=1e-5)


def test_generate_writes_the_generation_page(world, tmp_path, capsys):
    _, _, folder, _ = world
    page = tmp_path / "gen.html"
    assert main(["attribute", str(folder), PROMPT, "--generate", "3", "--html", str(page), "--out",
                 str(tmp_path / "run.nxl")]) == 0
    capsys.readouterr()
    (call,) = nxl.read_stream(tmp_path / "run.nxl")
    cells = tiny.elements(page.read_text(), "td", "nxl-cell")
    assert len(cells) == 3 * (len(call.readable[0]) + 3)  # generated tokens x context columns


@pytest.mark.parametrize("argv, message", [
    (["--load-in-8bit", "--load-in-4bit"], "--load-in-8bit and --load-in-4bit exclude each other"),
    (["--max-memory", "cpu=1GiB"], "--max-memory (max_memory=) needs --device-map (device_map=), e.g. auto"),
    (["--max-memory", "lots"], "use DEVICE=SIZE pairs"),
    (["--offload-folder", "off"], "--offload-folder (offload_folder=) needs --device-map (device_map=)"),
    # transformers ignores both there: the model loaded whole, as if they were not given
    (["--device-map", "cpu", "--max-memory", "cpu=100KB"], "--max-memory (max_memory=) with --device-map cpu "
     "(device_map=): a device or a mapping places every module itself, so the limits would be ignored"),
    (["--device-map", '{"": "cpu"}', "--offload-folder", "off"], '--offload-folder (offload_folder=) with --device-map '
     '{"": "cpu"} (device_map=): it places nothing on disk'),
    (["--device-map", "auto", "--max-memory", "cpu=10XB"], "'10XB' is no size: give bytes (like 1000000000) or a "
     "number and a unit"),
    (["--gguf-file", "model.bin"], "name the .gguf file inside MODEL"),
    (["--gguf-file", "missing.gguf"], "has no file 'missing.gguf'"),
    (["--chat"], "has no chat template"),
], ids=["8-and-4", "max-memory-alone", "max-memory-syntax", "offload-folder-alone", "max-memory-with-a-device",
        "offload-folder-without-disk", "max-memory-size", "gguf-name", "gguf-missing", "chat-template"])
def test_bad_loading_combinations_exit_2_with_one_line(tmp_path, capsys, argv, message):
    folder = tiny.save_model(tmp_path / "bert", "bert")  # the word-level tokenizer has no chat template
    capsys.readouterr()
    assert main(["attribute", str(folder), "the film", *argv]) == 2
    err = capsys.readouterr().err  # (loading progress bars may come first: --chat is checked once loaded)
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("nxl attribute: error: ") and message in errors[0]
    assert err.rstrip().endswith(errors[0]) and "Traceback" not in err


def test_a_head_the_architecture_has_not_is_told_as_such_not_blamed_on_the_config(world, capsys):
    """--head masked_lm for a Llama folder (transformers has no Llama masked LM) was said to be a config.json that
    "transformers cannot build", to be replaced by "the config.json saved with these weights", with transformers'
    list of a hundred config classes."""
    folder = world[2]
    capsys.readouterr()
    assert main(["attribute", str(folder), PROMPT, "--head", "masked_lm"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.endswith("transformers has no masked_lm head for llama models (AutoModelForMaskedLM does not take a "
                         "LlamaConfig); use --head causal_lm or sequence_classification (head=)")


def test_a_hub_models_config_and_tokenizer_come_from_where_its_weights_do(world, tmp_path, monkeypatch):
    """load_model's keyword arguments that say where a hub model is (revision, cache_dir, local_files_only, token...)
    reached only the weights' from_pretrained: the config and the tokenizer were read from the default cache or the
    hub's main revision (another model's config, or none: "the hub gave no model by that id"). Here a hub cache
    holds org/tiny at main (2 blocks) and at v2 (3 blocks), offline."""
    _, tok, folder, _ = world
    cache = tmp_path / "cache"
    repo = cache / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    for ref, commit, blocks in (("main", "1" * 40, 2), ("v2", "2" * 40, 3)):
        (repo / "refs" / ref).write_text(commit)
        snapshot = repo / "snapshots" / commit
        bpe_tiny.save_bpe(snapshot, bpe_tiny.bpe_llama(tok, layers=blocks), tok)
    # transformers' adapter lookup (where peft is installed) is handed only the token and revision by from_pretrained:
    # it looked for org/tiny's adapter_config.json in the default cache, then on the hub, local_files_only or not
    # (five retries, 23 s, where the hub cannot be reached); it is told where the model is now
    from transformers.models.auto import auto_factory

    lookup, asked = auto_factory.find_adapter_config_file, []
    monkeypatch.setattr(auto_factory, "find_adapter_config_file", lambda *args, **kwargs: asked.append(kwargs) or
                        lookup(*args, **kwargs))
    model, loaded_tok = load_model("org/tiny", revision="v2", cache_dir=str(cache), local_files_only=True)
    assert model.config.num_hidden_layers == len(model.model.layers) == 3
    assert loaded_tok.get_vocab() == tok.get_vocab()
    assert [(kwargs.get("cache_dir"), kwargs.get("local_files_only")) for kwargs in asked] == [(str(cache), True)]


def test_gguf_file_twice_and_audit_quantize_twice_are_one_line_errors(world, tmp_path, capsys):
    _, _, folder, gguf = world
    assert main(["attribute", str(gguf), PROMPT, "--gguf-file", gguf.name]) == 2
    assert "is a .gguf file and --gguf-file (gguf_file=) names" in capsys.readouterr().err
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": PROMPT}) + "\n")
    assert main(["audit", "--reference", str(folder), "--quantize", "8bit", "--load-in-8bit", str(data),
                 "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--quantize builds the candidate from an unquantized reference" in err and len(err.splitlines()) == 1



def test_a_model_saved_quantized_loads_in_its_own_quantization_only_nor_is_blamed_on_flags_not_given(world, tmp_path,
                                                                                                       capsys):
    """A folder saved quantized (bitsandbytes 8-bit) keeps its own quantization: transformers ignores another one
    asked for (with a warning only), so --load-in-4bit (or quantization_config=) loaded it 8-bit; that is refused,
    naming both. The same one asked again loads as asked (it was refused too), and scores as the oracle says on the
    model loaded. audit --quantize of a reference saved quantized would compare it with itself (agreement 1.0, drift
    0): refused. Offloading it was refused as asked for by --load-in-8bit/--load-in-4bit, which were not given."""
    from transformers import BitsAndBytesConfig

    _, tok, folder, _ = world
    saved = tmp_path / "saved-8bit"
    load_model(str(folder), quantize="8bit")[0].save_pretrained(saved)
    tok.save_pretrained(saved)
    loaded, _ = load_model(str(saved), quantize="8bit")
    assert type(loaded.model.layers[0].self_attn.q_proj).__name__ == "Linear8bitLt"
    paris = tok.convert_tokens_to_ids("ĠParis")
    res = nxl.explain(loaded, tok, PROMPT, target=paris)
    torch.testing.assert_close(res.normxlogit[:, 0], oracle_normxlogit(loaded, tok, PROMPT, paris)[:, 0],
                               rtol=1e-4, atol=1e-5)
    both = ("saved-8bit is saved quantized (bitsandbytes 8-bit: its config.json's quantization_config), and "
            "transformers loads it so, not bitsandbytes 4-bit nf4 as asked")
    with pytest.raises(ValueError, match=re.escape(both)):
        load_model(str(saved), quantization_config=BitsAndBytesConfig(load_in_4bit=True,
                                                                      bnb_4bit_quant_type="nf4"))
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": PROMPT}) + "\n")
    capsys.readouterr()
    assert main(["attribute", str(saved), PROMPT, "--load-in-4bit"]) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert both in line
    assert main(["audit", "--reference", str(saved), "--quantize", "8bit", str(data),
                 "--out", str(tmp_path / "o")]) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert "saved-8bit is saved quantized, so --quantize would build the candidate as the reference itself" in line
    assert not (tmp_path / "o" / "summary.json").exists()
    assert main(["attribute", str(saved), PROMPT, "--device-map", "auto", "--max-memory", "cpu=100KB",
                 "--offload-folder", str(tmp_path / "off")]) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert "its weights are saved quantized (bitsandbytes 8-bit)" in line and "--load-in" not in line

# -- crafted GGUF files and hostile chat templates (issue 24, items 4, 14, 16) -------------------------------------

_FIX = "the file is damaged or was written wrong: download or convert it again"
CRAFTED = {  # id: (write_gguf changes, what the one line says)
    "a million blocks": ({"header": {"block_count": 1_000_000}},
                         r"llama.block_count = 1000000 but its tensors hold blocks 0..2 \(3 blocks\)"),
    "no heads": ({"header": {"head_count": 0}}, r"llama.attention.head_count = 0; expected a positive number"),
    "2**31 wide": ({"header": {"embedding_length": 2 ** 31}},
                   r"its token embedding is \d+ x 64, but the header gives \d+ tokens of width 2147483648"),
    "transposed embedding": ({"transpose": ("token_embd.weight",)},
                             r"its token embedding is 64 x (\d+), but the header gives \1 tokens of width 64"),
    "no tokens": ({"header": {"tokens": None}}, r"has no vocabulary \(tokenizer.ggml.tokens is missing or empty\)"),
    "wide feed-forward": ({"header": {"feed_forward_length": 4096}},
                          r"its header describes a model of [\d,]+ parameters, but the file holds [\d,]+ values"),
    "a missing tensor": ({"drop": ("blk.0.ffn_up.weight",)},
                         r"lacks tensors the model needs \(model.layers.0.mlp.up_proj.weight\): they would be random"),
}


def _errors(err: str) -> list[str]:
    """The error lines of stderr, which must end it and hold no traceback (transformers' loading progress bars may
    come first)."""
    errors = [line for line in err.splitlines() if "error" in line]
    assert errors and err.rstrip().endswith(errors[-1]) and "Traceback" not in err, err
    return errors


#: The child that converts every crafted file (one interpreter start, not one per case): each case's ``nxl convert``
#: with the process's stderr (fd 2: transformers' progress bars and logging too) sent to that case's file.
_CONVERT_EACH = """
import json, os, sys
from nxl_hooks.apps.cli import main

codes = {}
for case in json.loads(sys.argv[1]):
    err = os.open(os.path.join(case, "stderr.txt"), os.O_WRONLY | os.O_CREAT)
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(err, 2)
    try:
        codes[case] = main(["convert", os.path.join(case, "crafted.gguf"), os.path.join(case, "out")])
    except SystemExit as stop:
        codes[case] = stop.code
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(err)
        os.close(saved)
print(json.dumps(codes))
"""


@pytest.fixture(scope="module")
def crafted_conversions(world, tmp_path_factory) -> dict:
    """Each crafted file through ``nxl convert`` in one child process, so that a conversion that runs on is cut off
    (and fails here) after 300 s: {(case, out): (exit code, stderr, the case's folder)}."""
    model, tok, _, _ = world
    cases = {}
    for case, out in CRAFTED_CASES:
        folder = tmp_path_factory.mktemp("crafted")
        bpe_tiny.write_gguf(folder / "crafted.gguf", model, tok, **CRAFTED[case][0])
        if out == "empty":
            (folder / "out").mkdir()
        cases[(case, out)] = folder
    done = subprocess.run([sys.executable, "-c", _CONVERT_EACH, json.dumps([str(f) for f in cases.values()])],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    codes = json.loads(done.stdout.strip().splitlines()[-1])
    return {key: (codes[str(folder)], (folder / "stderr.txt").read_text(), folder) for key, folder in cases.items()}


CRAFTED_CASES = [(case, "new") for case in CRAFTED] + [("a missing tensor", "empty")]


@pytest.mark.parametrize("case, out", [  # the header's own checks are nxl_hooks' whatever transformers' version;
    # naming a missing tensor takes transformers' GGUF names
    pytest.param(case, out, marks=() if case == "a missing tensor" else pytest.mark.version_free)
    for case, out in CRAFTED_CASES])
def test_a_crafted_gguf_file_is_refused_in_one_line_and_nothing_is_written(crafted_conversions, case, out):
    """Each refused from its header (a million blocks ran for minutes, the rest were tracebacks, a missing tensor
    converted with exit 0 into a random weight), before any folder is made; an empty OUT given is left as it was."""
    code, err, folder = crafted_conversions[(case, out)]
    errors = _errors(err)
    assert code == 2 and len(errors) == 1 and errors[0].startswith("nxl convert: error: "), err
    assert re.search(CRAFTED[case][1], errors[0]) and errors[0].endswith(_FIX), errors[0]
    assert sorted(p.name for p in folder.iterdir()) == (["crafted.gguf", "out", "stderr.txt"] if out == "empty"
                                                        else ["crafted.gguf", "stderr.txt"])
    assert out == "new" or list((folder / "out").iterdir()) == []


def test_a_crafted_gguf_file_is_refused_by_attribute_too(world, tmp_path, capsys):
    model, tok, _, _ = world
    crafted = bpe_tiny.write_gguf(tmp_path / "crafted.gguf", model, tok, drop=("blk.1.attn_v.weight",))
    capsys.readouterr()
    assert main(["attribute", str(crafted), PROMPT]) == 2
    (line,) = _errors(capsys.readouterr().err)
    assert line.startswith("nxl attribute: error: ") and "model.layers.1.self_attn.v_proj.weight" in line


def test_a_missing_tensor_that_the_header_check_cannot_name_is_refused_after_loading(world, tmp_path, capsys,
                                                                                      monkeypatch):
    """Where transformers cannot map a GGUF file's names before loading (an architecture its processor renames
    tensors for, here simulated) and an unrelated tensor makes up the count, the missing weight is still refused,
    from transformers' own loading report, instead of converted as random numbers."""
    from nxl_hooks.apps import loading

    model, tok, _, _ = world
    up = model.model.layers[0].mlp.up_proj.weight.detach().numpy()
    crafted = bpe_tiny.write_gguf(tmp_path / "crafted.gguf", model, tok, drop=("blk.0.ffn_up.weight",),
                                  extra={"unrelated.weight": up.copy()})
    monkeypatch.setattr(loading, "_gguf_names", lambda *_: {})
    capsys.readouterr()
    assert main(["convert", str(crafted), str(tmp_path / "out")]) == 2
    (line,) = _errors(capsys.readouterr().err)
    assert line.startswith("nxl convert: error: ") and line.endswith(
        "crafted.gguf lacks tensors the model needs (model.layers.0.mlp.up_proj.weight): they would be random "
        f"numbers; {_FIX}"), line
    assert not (tmp_path / "out").exists()


def test_convert_writes_the_weights_with_the_mode_of_its_other_files(world, tmp_path):
    """0644 under the usual umask 022 (safetensors wrote 0600), and the umask is respected (077: 0600 for all)."""
    _, _, _, gguf = world
    old = os.umask(0o022)
    try:
        assert main(["convert", str(gguf), str(tmp_path / "a")]) == 0
        os.umask(0o077)
        assert main(["convert", str(gguf), str(tmp_path / "b")]) == 0
    finally:
        os.umask(old)
    for folder, mode in (("a", 0o644), ("b", 0o600)):
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / folder).iterdir()}
        assert "model.safetensors" in modes and set(modes.values()) == {mode}, modes


HOSTILE = {
    "huge string": "{{ 'a' * 10**20 }}",
    "sandbox escape": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "globals": "{{ cycler.__init__.__globals__.os.system('id') }}",
    "huge range": "{% for i in range(10**10) %}x{% endfor %}",
    "endless recursion": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_chat_template_is_one_line_before_the_weights_load(world, tmp_path, capsys, case):
    """jinja2's sandbox refuses these (SecurityError, OverflowError) or Python does (RecursionError): each was a
    traceback out of nxl attribute --chat; now one line, exit 2, said before the weights are read."""
    model, tok, _, _ = world
    folder = bpe_tiny.save_bpe(tmp_path / "m", model, tok)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "chat_template.jinja").write_text(HOSTILE[case])
    (folder / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                              if k != "chat_template"}))
    (folder / "model.safetensors").write_bytes(b"not weights")  # read them and the error would be about them
    capsys.readouterr()
    assert main(["attribute", str(folder), PROMPT, "--chat"]) == 2
    err = capsys.readouterr().err
    (line,) = _errors(err)
    assert line.startswith("nxl attribute: error: the tokenizer's chat template failed (") and line.endswith(
        "fix chat_template (in tokenizer_config.json or chat_template.jinja), or drop --chat (chat=True)"), line
    assert "Traceback" not in err


@pytest.mark.parametrize("command", ["attribute", "evaluate"])
def test_chat_without_a_template_is_refused_before_the_weights_load(tmp_path, capsys, command):
    """Item 14: the refusal came after the whole load (1 min 42 s for Gemma 3). The weights file here is garbage:
    had it been read, the one line would be about it, not about the template."""
    folder = tiny.save_model(tmp_path / "bert", "bert")  # the word-level tokenizer has no chat template
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    data = tiny.write_jsonl(tmp_path / "d.jsonl", 2)
    argv = {"attribute": ["attribute", str(folder), "the film"],
            "evaluate": ["evaluate", str(folder), str(data), "--out", str(tmp_path / "o")]}[command]
    capsys.readouterr()
    assert main([*argv, "--chat"]) == 2
    (line,) = _errors(capsys.readouterr().err)
    assert line == (f"nxl {command}: error: this tokenizer has no chat template (tokenizer.chat_template is empty): "
                    "drop --chat (chat=True), or write the prompt in the model's own format")


def test_a_config_of_one_size_per_layer_is_read(tmp_path):
    """Gemma 3n's intermediate_size is a list, one size per layer (transformers types it int | list[int]): the
    config check took it for a bad size and refused the folder."""
    import transformers

    from nxl_hooks.apps.loading import _read_config

    transformers.Gemma3nTextConfig(vocab_size=64, hidden_size=32, intermediate_size=[64, 64], num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8).save_pretrained(tmp_path)
    assert _read_config(str(tmp_path)).intermediate_size == [64, 64]
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": [64, 0]}))
    with pytest.raises(ValueError, match=r"intermediate_size is \[64, 0\]; a size must be a whole number above 0"):
        _read_config(str(tmp_path))


def test_load_model_refuses_remote_code_and_pickle_asked_for_from_python(world):
    """The keywords go to from_pretrained, which load_model asks for safetensors and no remote code: given again by
    a caller they were a TypeError after the tokenizer had loaded; refused at once in one line, a False passes."""
    _, _, folder, _ = world
    for kwargs in ({"trust_remote_code": True}, {"use_safetensors": False}):
        with pytest.raises(ValueError, match="load_model reads safetensors weights only and runs no code"):
            load_model(str(folder), **kwargs)
    model, _ = load_model(str(folder), trust_remote_code=False, use_safetensors=True)
    assert not model.training


def test_a_tokenizer_without_an_added_vocabulary_is_not_checked_for_one():
    """mistral_common's tokenizer backend (what transformers gives for a Mistral repo with tekken.json) has no
    get_added_vocab: the vocabulary check raised AttributeError (a traceback) instead of letting it load."""
    from types import SimpleNamespace

    from nxl_hooks.apps.loading import _check_vocabulary

    _check_vocabulary("m", SimpleNamespace(all_special_tokens=["<s>"], get_vocab=lambda: {"<s>": 0}))


def test_a_local_folder_loads_from_its_subfolder(world, tmp_path):
    """load_model(folder, subfolder="x"): transformers reads folder/x/config.json (and the tokenizer and weights
    there), but the local checks looked beside folder and refused it as having no config.json. Here the model and
    tokenizer lie in tmp/repo/x only, and the scores are the oracle's on the model that was saved. A tokenizer at the
    root only (the weights in the subfolder) was looked for in the subfolder alone: refused as missing."""
    model, tok, _, _ = world
    bpe_tiny.save_bpe(tmp_path / "repo" / "x", model, tok)
    loaded, loaded_tok = load_model(str(tmp_path / "repo"), subfolder="x")
    assert loaded_tok.get_vocab() == tok.get_vocab()
    paris = tok.convert_tokens_to_ids("ĠParis")
    res = nxl.explain(loaded, loaded_tok, PROMPT, target=paris)
    torch.testing.assert_close(res.normxlogit[:, 0], oracle_normxlogit(model, tok, PROMPT, paris)[:, 0],
                               rtol=1e-4, atol=1e-5)
    with pytest.raises(FileNotFoundError, match=r"repo/y has no config.json"):  # the folder looked in is named
        load_model(str(tmp_path / "repo"), subfolder="y")
    # the weights in a subfolder, the tokenizer at the root only (as many repositories keep them): read from there
    model.save_pretrained(tmp_path / "split" / "x")
    tok.save_pretrained(tmp_path / "split")
    loaded, loaded_tok = load_model(str(tmp_path / "split"), subfolder="x")
    assert loaded_tok.get_vocab() == tok.get_vocab()
    torch.testing.assert_close(nxl.explain(loaded, loaded_tok, PROMPT, target=paris).normxlogit[:, 0],
                               oracle_normxlogit(model, tok, PROMPT, paris)[:, 0], rtol=1e-4, atol=1e-5)


def test_a_bidirectional_xlm_checkpoint_is_a_masked_lm_to_the_command_line_as_to_attach():
    """XLMWithLMHeadModel ends like a causal LM's class but is a masked LM unless config.causal: the head kind the
    command line picks from config.architectures is the one attach reads the built model with (it said causal_lm)."""
    import transformers

    from nxl_hooks.apps.loading import head_from_architectures
    from nxl_hooks.arch.spec import HeadKind, head_kind

    for causal, kind in ((False, HeadKind.MASKED_LM), (True, HeadKind.CAUSAL_LM)):
        config = transformers.XLMConfig(vocab_size=16, emb_dim=8, n_layers=1, n_heads=2, causal=causal,
                                        architectures=["XLMWithLMHeadModel"])
        assert head_from_architectures(config.architectures, config) == kind.value
        assert head_kind(transformers.XLMWithLMHeadModel(config)) is kind
