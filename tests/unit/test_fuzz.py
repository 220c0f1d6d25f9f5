"""Bounded property-based fuzzing (hypothesis) of the three loaders that read files from elsewhere: Attribution.load,
read_stream and the registry loader. Any input either loads to something that works (top(), layer(), to_html(),
the terminal table; every step of a stream; a spec that resolves against a model or says why not) or raises the
documented ValueError subclass (RecordError, StreamError, RegistryError), never another exception.

Deterministic and small in CI (``derandomize``, a few dozen examples each, about 20 s in all); for a longer hunt:
``NXL_FUZZ_EXAMPLES=2000 python -m pytest tests/unit/test_fuzz.py`` (then random, a new search every run).
"""

from __future__ import annotations

import io
import json
import math
import os
import warnings
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console
from safetensors.torch import save as save_blob

import nxl_hooks as nxl
import tiny
from nxl_hooks.apps.terminal import render_table
from nxl_hooks.arch import fit, registry
from nxl_hooks.records import reader, writer
from nxl_hooks.records.attribution import RecordError

_MANY = int(os.environ.get("NXL_FUZZ_EXAMPLES", "0"))


def fuzz(examples: int):
    """Hypothesis settings: ``examples`` in CI, deterministic; NXL_FUZZ_EXAMPLES=N for a random search of N."""
    return settings(max_examples=_MANY or examples, derandomize=not _MANY, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


def _works(res: nxl.Attribution) -> None:
    """Everything a loaded attribution is used for."""
    rows = res.normxlogit.shape[1]
    labels = res.normxlogit.shape[3] if res.normxlogit.dim() == 4 else 1
    for row in range(rows):
        for label in range(labels):
            res.top(3, layer=res.layers[-1], row=row, label=label)
            res.top(2, layer=res.layers[0], row=row, label=label, all_positions=True)
            render_table(res, Console(file=io.StringIO(), width=160), row=row, label=label)
    res.layer(res.layers[0])
    if res.meta.get("n_blocks") is not None:
        res.layer(-1) if res.meta["n_blocks"] in res.layers else None
    res.to_html()
    res._repr_html_()


# -- mutations of valid files ----------------------------------------------------------------------------

_MUTATION = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(1, 255)),
    st.tuples(st.just("flip"), st.integers(-600, -1), st.integers(1, 255)),  # in the tensor data at the end
    st.tuples(st.just("flip"), st.integers(-600, -1), st.sampled_from([0x80, 0x7F, 0xFF])),  # sign, NaN, inf
    st.tuples(st.just("cut"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 10**6), st.binary(min_size=1, max_size=12)),
    st.tuples(st.just("delete"), st.integers(0, 10**6), st.integers(1, 40)),
    st.tuples(st.just("overwrite"), st.integers(0, 10**6), st.binary(min_size=1, max_size=12)),
)


def _mutate(data: bytes, mutations: list) -> bytes:
    out = bytearray(data)
    for kind, where, what in mutations:
        at = (where if where >= 0 else len(out) + where) % (len(out) + 1)
        if kind == "flip" and at < len(out):
            out[at] ^= what
        elif kind == "cut":
            del out[at:]
        elif kind == "insert":
            out[at:at] = what
        elif kind == "delete":
            del out[at:at + what]
        elif kind == "overwrite":
            out[at:at + len(what)] = what
    return bytes(out)


@pytest.fixture(scope="module")
def attribution_bytes(tmp_path_factory) -> bytes:
    model, tok = tiny.build_model("llama"), tiny.tokenizer()
    res = nxl.explain(model, tok, ["the film was good", "bad plot"], layers=[0, 2], target=["good", "bad"])
    return res.save(tmp_path_factory.mktemp("a") / "a.safetensors").read_bytes()


@fuzz(120)
@given(mutations=st.lists(_MUTATION, min_size=1, max_size=3))
def test_attribution_load_of_mutated_files(attribution_bytes, tmp_path, mutations):
    path = tmp_path / "a.safetensors"
    path.write_bytes(_mutate(attribution_bytes, mutations))
    try:
        res = nxl.Attribution.load(path)
    except RecordError:
        return
    _works(res)


# -- attribution files built from parts that may or may not fit ----------------------------------------

_JSON = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=True) | st.text(max_size=4),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                   max_size=3), max_leaves=6)
_DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
                           torch.uint8, torch.bool])


@st.composite
def _attribution_parts(draw):
    layers, rows, seq = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 5))
    k = draw(st.sampled_from([None, 1, 2]))
    scores = (layers, rows, seq) if k is None else (layers, rows, seq, k)
    fitting = {
        "normxlogit": (scores, torch.float32), "logat": (scores, torch.float32), "embed_norm": ((rows, seq), torch.float32),
        "target": ((rows,) if k is None else (rows, k), torch.int64), "mask": ((rows, seq), torch.bool),
        "position": ((rows,), torch.int64), "example": ((rows,), torch.int64), "special": ((rows, seq), torch.bool),
    }
    tensors = {}
    for name, (shape, dtype) in fitting.items():
        choice = draw(st.sampled_from(["fit"] * 30 + ["dtype", "shape", "missing"]))
        if choice == "missing":
            continue
        if choice == "dtype":
            dtype = draw(_DTYPES)
        if choice == "shape":
            shape = tuple(draw(st.lists(st.integers(0, 4), max_size=4)))
        if choice == "fit" and name in ("target", "position", "example"):  # in range, to reach the later checks
            values = draw(st.lists(st.integers(0, seq - 1 if name == "position" else 9), min_size=1, max_size=4))
        else:
            values = draw(st.lists(st.floats(allow_nan=True, allow_infinity=True) | st.integers(-3, 8),
                                   min_size=1, max_size=4))
        data = torch.tensor([float(v) for v in values], dtype=torch.float64).repeat(math.prod(shape) or 1)
        tensors[name] = data[:math.prod(shape)].reshape(shape).to(dtype)
    n_blocks = draw(st.sampled_from([None, 2, 3, layers - 1, "2", -1]))

    def mostly(fitting, other):
        return draw(st.sampled_from(["fit"] * 8 + ["other"])) == "fit" and fitting or draw(other)

    header = {
        "format": mostly("nxl_hooks.attribution", st.sampled_from(["other", None, 3])),
        "version": mostly(1, st.sampled_from([0, 2, "1", None])),
        "layers": mostly(sorted(draw(st.sets(st.integers(0, 3), min_size=layers, max_size=layers))),
                         st.one_of(st.lists(st.integers(-3, 4), max_size=4), _JSON)),
        "tokens": mostly([draw(st.lists(st.text(max_size=3), min_size=seq, max_size=seq)) for _ in range(rows)],
                         st.one_of(st.none(), st.lists(st.lists(st.text(max_size=3), max_size=6), max_size=4), _JSON)),
        "meta": mostly({"n_blocks": n_blocks, "head_kind": "causal_lm", "model_class": "M",
                        "prediction": draw(st.sampled_from([None, [[0.5]] * rows]))},
                       st.one_of(st.dictionaries(st.sampled_from(["n_blocks", "head_kind", "model_class", "prediction",
                                                                  "embedding", "x"]), _JSON, max_size=4), _JSON)),
    }
    return tensors, header


@fuzz(150)
@given(parts=_attribution_parts())
def test_attribution_load_of_crafted_files(tmp_path, parts):
    tensors, header = parts
    path = tmp_path / "a.safetensors"
    path.write_bytes(save_blob({k: v.contiguous() for k, v in tensors.items()}, metadata={"nxl_hooks": json.dumps(header)})
                     if tensors else save_blob({"x": torch.zeros(1)}, metadata={"nxl_hooks": json.dumps(header)}))
    try:
        res = nxl.Attribution.load(path)
    except RecordError:
        return
    _works(res)


# -- stream files ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stream_bytes(tmp_path_factory) -> bytes:
    model = tiny.build_model("llama")
    path = tmp_path_factory.mktemp("s") / "run.nxl"
    with nxl.attach(model, sink=path, target=[5, 7]):
        model.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False, pad_token_id=0)
    return path.read_bytes()


def _read(path) -> None:
    """read_stream, then everything its records are used for; only StreamError may come out."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", reader.StreamDamageWarning)
        try:
            calls = nxl.read_stream(path)
        except reader.StreamError:
            return
    assert calls.damage is None or calls.damage.offset >= len(writer._FILE_MAGIC) or calls == [] and calls.damage.torn
    for call in calls:
        for step in call.steps:
            _works(step.to_attribution())


@fuzz(120)
@given(mutations=st.lists(_MUTATION, min_size=1, max_size=3))
def test_read_stream_of_mutated_files(stream_bytes, tmp_path, mutations):
    path = tmp_path / "run.nxl"
    path.write_bytes(_mutate(stream_bytes, mutations))
    _read(path)


_KINDS = st.sampled_from(["call", "step", "end", "step", "other"])


@st.composite
def _frame(draw):
    header = {"kind": draw(_KINDS), "call": draw(st.sampled_from([0, 0, 1, "0", None]))}
    for key, values in (("step", st.sampled_from([0, 1, -1, 0.5])), ("position", st.integers(-1, 6)),
                        ("layers", st.one_of(st.just([0, 1, 2]), st.lists(st.integers(-1, 4), max_size=3), _JSON)),
                        ("n_blocks", st.sampled_from([2, None, "2", -1])), ("complete", st.sampled_from([True, 1, None])),
                        ("error", st.sampled_from([None, "x", 3]))):
        if draw(st.booleans()):
            header[key] = draw(values)
    tensors = {}
    for name in ("prompt_mask", "prompt_ids", "sequences", "token", "target", "normxlogit", "logat", "embed_norm",
                 "mask", "active"):
        if draw(st.booleans()):
            shape = tuple(draw(st.lists(st.integers(0, 4), min_size=1, max_size=3)))
            tensors[name] = torch.ones(shape).to(draw(_DTYPES))
    return save_blob(tensors, metadata={"nxl_hooks": json.dumps(header)})


@fuzz(150)
@given(frames=st.lists(_frame(), min_size=1, max_size=3))
def test_read_stream_of_crafted_frames(stream_bytes, tmp_path, frames):
    """Crafted frames (valid checksums) after the genuine call frame and first step."""
    offsets = [offset for _, offset, _, _ in reader._frames(stream_bytes)]
    crafted = b"".join(writer._FRAME.pack(writer._FRAME_MAGIC, len(p), zlib.crc32(p)) + p for p in frames)
    path = tmp_path / "run.nxl"
    path.write_bytes(stream_bytes[:offsets[2]] + crafted)
    _read(path)


# -- the registry loader -----------------------------------------------------------------------------------


def _toml(value) -> str:
    """A TOML value (JSON strings are TOML basic strings)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if value != value else ("inf" if value == math.inf else "-inf" if value == -math.inf else repr(value))
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # TOML has no surrogate-pair escapes
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + "}"


_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=5)  # TOML strings hold no lone surrogates
_STEPS = st.sampled_from(["model.norm", "lm_head", "model.layers", "model.layers.0", "model.layers.9", "model",
                          "lm_head.weight", "model.embed_tokens", "score", "tanh", "gelu", "act:hidden_act",
                          "act:hiden_act", "softcap:final_logit_softcapping", "scale:rms_norm_eps", "divide:vocab_size",
                          "scale:model_type", "scale:", "model..norm", "9.x"]) | _TEXT
_TOML_VALUES = st.recursive(st.booleans() | st.integers(-3, 3) | st.floats() | _TEXT,
                            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=2),
                            max_leaves=5)


_GOOD_STEPS = st.sampled_from([["model.norm", "lm_head"], ["model.norm", "lm_head", "softcap:final_logit_softcapping"],
                                ["lm_head"], ["model.norm", "act:hidden_act", "lm_head"], ["model.layers.0", "lm_head"],
                                ["model", "lm_head"], ["model.norm", "lm_head", "scale:rms_norm_eps"]])


@st.composite
def _entry(draw):
    """Mostly fitting entries (each key right 9 times in 10), so that what loads also goes on to resolve."""
    def mostly(fitting, other):
        return draw(fitting) if draw(st.integers(0, 9)) else draw(other)

    table = {
        "model_types": mostly(st.just(["llama"]), st.one_of(st.lists(st.sampled_from(["llama", "", "x"]), max_size=2),
                                                            st.text(max_size=5), _TOML_VALUES)),
        "blocks": mostly(st.sampled_from(["model.layers", "model.layers"]),
                         st.one_of(st.sampled_from(["model.norm", "model", "lm_head", "nope.x"]), _TOML_VALUES)),
        "heads": mostly(st.fixed_dictionaries({"causal_lm": st.one_of(_GOOD_STEPS, st.lists(_STEPS, max_size=4))}),
                        st.one_of(st.dictionaries(st.sampled_from(["causal_lm", "masked_lm", "lm"]),
                                                  st.one_of(st.lists(_STEPS, max_size=4), _TOML_VALUES), max_size=2),
                                  _TOML_VALUES)),
    }
    for key, values in (("pooling", st.sampled_from(["first", "last_non_pad"] * 5 + ["mean"]) | _TOML_VALUES),
                        ("backbone", st.sampled_from(["model", "model.layers", "x"])), ("extra", _TOML_VALUES)):
        if not draw(st.integers(0, 4 if key != "extra" else 14)):
            table[key] = draw(values)
    for key in ("model_types", "blocks", "heads"):
        if not draw(st.integers(0, 19)):
            del table[key]
    return table


@pytest.fixture(scope="module")
def llama():
    return tiny.build_model("llama")


@fuzz(150)
@given(entries=st.dictionaries(st.sampled_from(["llama", "x", "a b"]), _entry(), min_size=1, max_size=2),
       top=st.booleans())
def test_registry_loader(llama, tmp_path, entries, top):
    lines = [f"{json.dumps(name)} = {_toml(table)}" for name, table in entries.items()] if top else [
        f"[{json.dumps(name)}]\n" + "".join(f"{json.dumps(k)} = {_toml(v)}\n" for k, v in table.items())
        for name, table in entries.items()]
    path = tmp_path / "fuzz.toml"
    path.write_text("\n".join(lines), encoding="utf-8", errors="surrogatepass")
    _load(llama, path)


@fuzz(100)
@given(text=st.text(max_size=80))
def test_registry_loader_on_any_text(llama, tmp_path, text):
    path = tmp_path / "fuzz.toml"
    path.write_bytes(text.encode("utf-8", errors="surrogatepass"))
    _load(llama, path)


def _load(model, path) -> None:
    """load_file, then what resolving a spec for a model checks; only RegistryError may come out."""
    try:
        specs = registry.load_file(path)
    except registry.RegistryError:
        return
    for spec in specs:
        assert all(isinstance(t, str) and t for t in spec.model_types) and isinstance(spec.blocks, str)
        assert all(isinstance(step, str) for steps in spec.heads.values() for step in steps)
        if "causal_lm" in spec.heads:
            try:
                fit.check_fits(model, spec, "causal_lm")
            except registry.RegistryError:
                pass
