"""How the commands load models: GGUF files (as MODEL, or a folder plus --gguf-file, also as the audit's candidate),
GGUF with bitsandbytes, --dtype / --device-map / --max-memory, --chat, and one-line errors for combinations that
cannot work. A tiny GGUF file is written here from a random Llama (tests/bpe_tiny.py); numbers are checked against
the oracle on the original model."""

import json

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
                       "quantize": None, "gguf_file": None}
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
    args = build_parser().parse_args(["evaluate", "m", "d", "--out", "o", "--load-in-4bit",
                                      "--device-map", '{"": "cpu"}', "--max-memory", "0=2GiB,cpu=3GiB"])
    assert loading_options(args)["quantize"] == "4bit" and args.device_map == {"": "cpu"}
    assert args.max_memory == {0: "2GiB", "cpu": "3GiB"}


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
    (["--max-memory", "cpu=1GiB"], "--max-memory needs --device-map"),
    (["--max-memory", "lots"], "use DEVICE=SIZE pairs"),
    (["--gguf-file", "model.bin"], "name the .gguf file inside MODEL"),
    (["--gguf-file", "missing.gguf"], "has no file 'missing.gguf'"),
    (["--chat"], "has no chat template"),
], ids=["8-and-4", "max-memory-alone", "max-memory-syntax", "gguf-name", "gguf-missing", "chat-template"])
def test_bad_loading_combinations_exit_2_with_one_line(tmp_path, capsys, argv, message):
    folder = tiny.save_model(tmp_path / "bert", "bert")  # the word-level tokenizer has no chat template
    capsys.readouterr()
    assert main(["attribute", str(folder), "the film", *argv]) == 2
    err = capsys.readouterr().err  # (loading progress bars may come first: --chat is checked once loaded)
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("nxl attribute: error: ") and message in errors[0]
    assert err.rstrip().endswith(errors[0]) and "Traceback" not in err


def test_gguf_file_twice_and_audit_quantize_twice_are_one_line_errors(world, tmp_path, capsys):
    _, _, folder, gguf = world
    assert main(["attribute", str(gguf), PROMPT, "--gguf-file", gguf.name]) == 2
    assert "is a .gguf file and --gguf-file names" in capsys.readouterr().err
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": PROMPT}) + "\n")
    assert main(["audit", "--reference", str(folder), "--quantize", "8bit", "--load-in-8bit", str(data),
                 "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--quantize builds the candidate from an unquantized reference" in err and len(err.splitlines()) == 1
