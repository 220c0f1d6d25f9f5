"""Attribution methods as a protocol (issue 26 item 2): a method added from this file (protocol + registration)
reaches ``top()``, ``nxl attribute --method``, the Parquet export and ``nxl tail --method``; the built-in
contrastive method's numbers against the oracle (``output_hidden_states=True`` and the head by hand); methods
installed through the ``nxl_hooks.methods`` entry-point group, and a broken one.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

import nxl_hooks as nxl
import oracle
import tiny
from serving import live_reader
from nxl_hooks.apps.cli import main as cli_main
from nxl_hooks.arch import plugins
from nxl_hooks.method import registry
from nxl_hooks.method.methods.contrastive import Contrastive
from nxl_hooks.method.protocol import Given, Method

TEXT = "the film was very good"
NAME = "test_neglogat"


class NegLogAt(Method):
    """A method written outside the library: minus LogAt (it ranks tokens in the reverse of LogAt's order)."""

    name = NAME
    description = "minus LogAt (defined in tests/oracle/test_methods.py)"

    def score(self, given: Given) -> torch.Tensor:
        return -given.logat


nxl.register_method(NegLogAt, replace=True)  # replace: the module may be imported twice under pytest


def _lm_oracle(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-layer logits (L+1, 1, seq, vocab), embedding norms (1, seq)) of ``ids`` (1, seq), by hand."""
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
        return oracle.llama(model).layer_logits(out.hidden_states), out.hidden_states[0].float().norm(dim=-1)


def _ranked(scores: torch.Tensor, eligible: list[int]) -> list[int]:
    """Positions of ``eligible`` by descending score (the oracle's ranking)."""
    return sorted(eligible, key=lambda p: -float(scores[p]))


@pytest.fixture(scope="module")
def lm():
    return tiny.build_model("llama", 0), tiny.tokenizer()


def test_a_method_from_a_test_file_is_computed_and_ranks_in_top(lm, tmp_path):
    model, tok = lm
    assert NAME in nxl.method_names() and isinstance(nxl.get_method(NAME), Method)
    res = nxl.explain(model, tok, TEXT, methods=[NAME])
    assert res.methods == ["normxlogit", "logat", NAME]
    ids = tok(TEXT, return_tensors="pt")["input_ids"]
    logits, _ = _lm_oracle(model, ids)
    target = logits[-1, 0, -1].argmax()
    logat = logits[:, 0, :, target]  # (L+1, seq)
    torch.testing.assert_close(res.scores[NAME][:, 0], -logat, atol=1e-5, rtol=1e-4)
    eligible = res.rankable(0).nonzero()[:, 0].tolist()
    assert [p for p, _, _ in res.top(len(eligible), method=NAME)] == _ranked(-logat[-1], eligible)
    assert [p for p, _, _ in res.top(len(eligible), method="logat")] == _ranked(logat[-1], eligible)
    back = nxl.Attribution.load(res.save(tmp_path / "a.safetensors"))  # the file keeps it
    assert back.methods == res.methods and torch.equal(back.scores[NAME], res.scores[NAME])
    assert f"{NAME} per token and layer" in res.to_html(method=NAME)
    with pytest.raises(ValueError, match=f"method='{NAME}': use 'normxlogit' or 'logat', the methods this record holds"):
        nxl.explain(model, tok, TEXT).top(method=NAME)


def test_one_method_instance_or_class_is_what_methods_takes_beside_a_list(lm):
    model, tok = lm
    logits, norms = _lm_oracle(model, tok(TEXT, return_tensors="pt")["input_ids"])
    target = int(logits[-1, 0, -1].argmax())
    foil = 3 if target != 3 else 4
    res = nxl.explain(model, tok, TEXT, methods=Contrastive(foil=foil))  # one instance, not a list
    by_hand = norms[0] * (logits[:, 0, :, target] - logits[:, 0, :, foil])
    torch.testing.assert_close(res.scores["contrastive"][:, 0], by_hand, atol=1e-5, rtol=1e-4)
    assert nxl.explain(model, tok, TEXT, methods=NegLogAt).methods == ["normxlogit", "logat", NAME]  # one class
    for wrong in (3, 2.5):
        with pytest.raises(ValueError, match=rf"^methods={wrong}: give method names or Method objects"):
            nxl.attach(model, methods=wrong)


class Same(Method):
    """A method that gives LogAt's scores as they are: the very tensor LogAt gives."""

    name = "test_same_as_logat"
    description = "LogAt itself (tests/oracle/test_methods.py)"

    def score(self, given: Given) -> torch.Tensor:
        return given.logat.float()  # (float32 already: no copy)


def test_a_method_whose_scores_are_another_methods_tensor_saves_and_loads(lm, tmp_path):
    """safetensors refuses tensors that share memory; the record keeps both (save raised its RuntimeError)."""
    model, tok = lm
    res = nxl.explain(model, tok, TEXT, methods=[Same()])
    assert res.scores[Same.name].data_ptr() == res.scores["logat"].data_ptr()
    back = nxl.Attribution.load(res.save(tmp_path / "same.safetensors"))
    assert back.methods == res.methods and torch.equal(back.scores[Same.name], res.scores["logat"])


class Clamps(Method):
    """A method that changes what it is given in place: positive LogAt by ``clamp_`` (a slip), or doubles ``field``."""

    name = "test_clamps"
    description = "LogAt clamped at 0 in place (tests/oracle/test_methods.py)"
    pointwise = True

    def __init__(self, field: str = "logat") -> None:
        self.field = field

    def score(self, given: Given) -> torch.Tensor:
        if self.field != "logat":
            getattr(given, self.field).mul_(2)
            return given.logat.clamp(min=0)
        return given.logat.clamp_(min=0)


def test_a_method_that_changes_its_given_tensors_in_place_is_refused_in_one_line(lm):
    """LogAt's record is ``given.logat`` itself: a later method's ``clamp_`` rewrote it (and the embedding norms
    likewise); such a method is refused in one line naming it, the record's numbers never changed."""
    model, tok = lm
    ids = tok(TEXT, return_tensors="pt")["input_ids"]
    logits, _ = _lm_oracle(model, ids)
    with torch.no_grad(), nxl.attach(model, methods=[Clamps()]) as probe:
        model(input_ids=ids)
    with pytest.raises(ValueError, match=r"^attribution method 'test_clamps' changed given.logat in place: the record "
                                         r"keeps it; return new tensors \(given.logat.clamp\(min=0\), not clamp_\)$"):
        probe.result()
    with torch.no_grad(), nxl.attach(model, methods=[Clamps("embed_norm")]) as probe:
        model(input_ids=ids)
    with pytest.raises(ValueError, match="changed given.embed_norm in place"):
        probe.result()
    res = nxl.explain(model, tok, TEXT)  # (the probe's own scores, unchanged)
    assert res.logat.min() < 0
    torch.testing.assert_close(res.logat[:, 0], logits[:, 0, :, logits[-1, 0, -1].argmax()], atol=1e-5, rtol=1e-4)
    with nxl.attach(model, methods=[Clamps()]) as probe:
        model.generate(input_ids=ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert probe.calls[0].steps == [] and "'test_clamps' changed given.logat in place" in probe.calls[0].error


class NoGiven:
    """A method whose ``score`` takes no ``given``."""

    name = "test_no_given"
    description = "score written without its argument"

    def score(self):
        return None


class NoDescription:
    """A method written without a description."""

    name = "test_no_description"

    def score(self, given):
        return given.logat


def test_a_method_lacking_a_member_or_whose_score_takes_no_given_is_refused_when_registered_naming_what(lm):
    """A ``score(self)`` was registered and attached, then every forward went unrecorded for it; a method without a
    description was "<tests.NoDescription object at 0x...> is not an attribution method: it needs a name, a
    description and score(given)", naming no member it lacks."""
    model, _ = lm
    ids = torch.tensor([[5, 9, 12, 7]])
    logits, _ = _lm_oracle(model, ids)
    with pytest.raises(TypeError) as no_given:
        nxl.register_method(NoGiven)
    with pytest.raises(TypeError) as no_description:
        nxl.register_method(NoDescription)
    with pytest.raises(TypeError, match="^NoGiven is not an attribution method: its score cannot be called"):
        nxl.attach(model, methods=[NoGiven()])
    assert "test_no_given" not in nxl.method_names() and nxl.detach_all(model) == 0
    assert str(no_given.value) == ("NoGiven is not an attribution method: its score cannot be called as score(given) "
                                   "(too many positional arguments); define it as def score(self, given) -> tensor")
    assert str(no_description.value).startswith("NoDescription is not an attribution method: it lacks description;")
    with torch.no_grad(), nxl.attach(model, layers="all") as probe:  # the refusals left nothing behind
        model(input_ids=ids)
    res = probe.result()
    torch.testing.assert_close(res.logat[:, 0], logits[:, 0, :, logits[-1, 0, -1].argmax()], atol=1e-5, rtol=1e-4)


class NeedsFoil:
    """A method class whose ``__init__`` takes an argument: given as the class, it cannot be made."""

    name = "test_needs_foil"
    description = "needs its foil"

    def __init__(self, foil):
        self.foil = foil

    def score(self, given):
        return given.logat


def test_a_method_class_that_cannot_be_made_without_arguments_is_refused_saying_to_give_an_instance(lm):
    """``register_method(NeedsFoil)`` and ``attach(methods=[NeedsFoil])`` raised the class's own
    "NeedsFoil.__init__() missing 1 required positional argument", saying neither that a class is made without
    arguments there nor what to pass instead."""
    model, _ = lm
    for refused in (lambda: nxl.register_method(NeedsFoil), lambda: nxl.attach(model, methods=[NeedsFoil])):
        with pytest.raises(TypeError) as error:
            refused()
        assert str(error.value) == ("NeedsFoil cannot be made without arguments (missing a required argument: "
                                    "'foil'): give an instance (NeedsFoil(...)) instead of the class, or defaults to "
                                    "its arguments")
    assert "test_needs_foil" not in nxl.method_names() and nxl.detach_all(model) == 0


class LogitGap(Method):
    """docs/methods.md's example of a method that is not pointwise: LogAt minus the mean over the row's real tokens."""

    name = "test_logit_gap"
    description = "LogAt minus the mean LogAt of the row's tokens at that layer (tests/oracle/test_methods.py)"

    def score(self, given: Given) -> torch.Tensor:
        real = given.mask[None, :, :, None]
        mean = given.logat.where(real, 0).sum(dim=2, keepdim=True) / real.sum(dim=2, keepdim=True)
        return given.logat - mean


def test_a_method_is_given_the_padding_mask_of_a_batch_and_a_generation(lm):
    """``given.mask`` (False at padding): a left-padded row's mean over its real tokens is the oracle's of the text
    alone, in a batched forward and in each step of a batched ``generate`` (Given had no mask: the documented
    example averaged over padding)."""
    model, tok = lm[0], tiny.tokenizer()
    tok.padding_side = "left"
    texts = ["bad plot", "the film was very good and the plot was great"]
    enc = tok(texts, return_tensors="pt", padding=True, return_token_type_ids=False)
    real = enc["attention_mask"][0].bool()
    alone = enc["input_ids"][:1, real]

    def gap(logat: torch.Tensor) -> torch.Tensor:  # (L+1, seq) of the text alone
        return logat - logat.mean(-1, keepdim=True)

    with torch.no_grad(), nxl.attach(model, methods=[LogitGap()], target=7) as probe:
        model(**enc)
    logits, _ = _lm_oracle(model, alone)
    torch.testing.assert_close(probe.result().scores[LogitGap.name][:, 0][:, real], gap(logits[:, 0, :, 7]),
                               atol=1e-5, rtol=1e-4)
    with nxl.attach(model, methods=[LogitGap()]) as probe:
        sequences = model.generate(**enc, max_new_tokens=3, do_sample=False, pad_token_id=0)
    logits, _ = _lm_oracle(model, sequences[:1, torch.cat([real, torch.ones(3, dtype=torch.bool)])])
    for step in probe.steps:
        kept = torch.cat([real, torch.ones(step.step, dtype=torch.bool)])
        n, token = int(kept.sum()), int(step.token[0])
        torch.testing.assert_close(step.scores[LogitGap.name][:, 0][:, kept], gap(logits[:, 0, :n, token]),
                                   atol=1e-5, rtol=1e-4)


def test_the_cli_ranks_by_a_registered_method(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    path = tiny.save_model(tmp_path / "lm", "llama", seed=0)
    out_file = tmp_path / "a.safetensors"
    assert cli_main(["attribute", str(path), TEXT, "--method", NAME, "--out", str(out_file), "--layers", "last"]) == 0
    printed = capsys.readouterr().out
    assert f"{NAME} of " in printed
    model, tok = tiny.build_model("llama", 0), tiny.tokenizer()
    logits, _ = _lm_oracle(model, tok(TEXT, return_tensors="pt")["input_ids"])
    logat = logits[-1, 0, :, logits[-1, 0, -1].argmax()]
    saved = nxl.Attribution.load(out_file)
    torch.testing.assert_close(saved.scores[NAME][0, 0], -logat, atol=1e-5, rtol=1e-4)
    row = next(line for line in printed.splitlines() if line.startswith(("┃ L2", "│ L2")))  # the layers view
    cells = [float(cell) for cell in re.split(r"[┃│]", row)[2:-1]]
    torch.testing.assert_close(torch.tensor(cells), -logat, atol=1e-3, rtol=2e-3)  # 4 significant digits
    assert cli_main(["attribute", str(path), TEXT, "--method", "no_such_method"]) == 2
    assert "unknown attribution method 'no_such_method'" in capsys.readouterr().err


def test_the_cli_says_a_method_that_raises_in_one_line(tmp_path, capsys, monkeypatch):
    """``nxl attribute --method NAME`` of a method whose ``score`` raises (a plugin's ValueError) ended in a
    traceback of nxl's own and status 1, where a broken plugin is one line and status 2 everywhere else."""
    nxl.method_names()  # (the registry as it is, restored after the test: the method is registered for it alone)
    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))
    nxl.register_method(Exits(ValueError("bad input")), replace=True)
    path = tiny.save_model(tmp_path / "lm", "llama", seed=0)
    assert cli_main(["attribute", str(path), TEXT, "--method", "test_exits", "--layers", "last"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "nxl attribute: error: attribution method 'test_exits' raised ValueError: bad input")
    assert cli_main(["attribute", str(path), TEXT, "--layers", "last", "--out", str(tmp_path / "a.safetensors")]) == 0
    model, tok = tiny.build_model("llama", 0), tiny.tokenizer()  # the model is explained as before, by the oracle
    logits, _ = _lm_oracle(model, tok(TEXT, return_tensors="pt")["input_ids"])
    saved = nxl.Attribution.load(tmp_path / "a.safetensors")
    torch.testing.assert_close(saved.logat[0, 0], logits[-1, 0, :, logits[-1, 0, -1].argmax()], atol=1e-5, rtol=1e-4)


def _generate(model, tok, **attach_options):
    ids = tok("the film was", return_tensors="pt", return_token_type_ids=False)
    with nxl.attach(model, tokenizer=tok, **attach_options) as probe:
        out = model.generate(**ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    return probe, out


def test_parquet_live_and_exported_carry_every_computed_method(lm, tmp_path):
    pyarrow = pytest.importorskip("pyarrow.parquet")
    model, tok = lm
    live = tmp_path / "live.parquet"
    probe, sequences = _generate(model, tok, methods=[NAME, "contrastive"], sink=f"parquet:{live}")
    _, also = _generate(model, tok, methods=[NAME], sink=tmp_path / "run.nxl")
    assert torch.equal(sequences, also)
    exported = tmp_path / "exported.parquet"
    from nxl_hooks.records.parquet import export_parquet

    export_parquet(nxl.read_stream(tmp_path / "run.nxl"), exported)
    logits, _ = _lm_oracle(model, sequences)
    for path, methods in ((live, [NAME, "contrastive"]), (exported, [NAME])):
        table = pyarrow.read_table(path).to_pylist()
        assert set(methods) <= set(table[0]) and ("contrastive" in table[0]) == ("contrastive" in methods)
        for row in table:
            n, layer, position = row["emitted_position"], row["layer"], row["position"]
            logat = float(logits[layer, 0, position, row["emitted_id"]])
            assert row[NAME] == pytest.approx(-logat, rel=1e-4, abs=1e-5)
            assert row["logat"] == pytest.approx(logat, rel=1e-4, abs=1e-5)
            if "contrastive" in methods:
                final = logits[-1, 0, n - 1].clone()
                final[row["emitted_id"]] = float("-inf")
                foil = float(logits[layer, 0, position, final.argmax()])
                assert row["contrastive"] == pytest.approx(row["embed_norm"] * (logat - foil), rel=1e-4, abs=1e-5)
    old_columns = set(pyarrow.read_table(exported).column_names) - {NAME}
    assert old_columns == set(nxl.records.parquet.schema().names)  # the columns of before stay as they were


class Offset(Method):
    """A method whose scores are float64: LogAt plus an offset float32 cannot hold."""

    name = "test_offset_logat"
    description = "LogAt in float64 plus 1e-9 (tests/oracle/test_methods.py)"

    def score(self, given: Given) -> torch.Tensor:
        return given.logat.double() + 1e-9


def test_parquet_keeps_a_float64_methods_scores_exact(lm, tmp_path):
    """The live sink and nxl export wrote every method's column as float32: a float64 method's scores rounded,
    unlike the record in memory and the stream file."""
    pyarrow = pytest.importorskip("pyarrow.parquet")
    from nxl_hooks.records.parquet import export_parquet

    model, tok = lm
    live, exported = tmp_path / "live.parquet", tmp_path / "exported.parquet"
    _, sequences = _generate(model, tok, methods=[Offset()], sink=f"parquet:{live}")
    _generate(model, tok, methods=[Offset()], sink=tmp_path / "run.nxl")
    export_parquet(nxl.read_stream(tmp_path / "run.nxl"), exported)
    logits, _ = _lm_oracle(model, sequences)
    for path in (live, exported):
        table = pyarrow.read_table(path)
        assert table.schema.field(Offset.name).type == "double"
        for row in table.to_pylist():
            logat = float(logits[row["layer"], 0, row["position"], row["emitted_id"]])
            assert row["logat"] == pytest.approx(logat, rel=1e-4, abs=1e-5)
            assert row[Offset.name] == row["logat"] + 1e-9  # float64 arithmetic on the float32 LogAt, exactly


class Fine(Method):
    """float64 scores that differ below float32's resolution: 1 + 1e-12 × position (the last token ranks first)."""

    name = "test_fine64"
    description = "1 + 1e-12 × position in float64 (tests/oracle/test_methods.py)"

    def score(self, given: Given) -> torch.Tensor:
        steps = torch.arange(given.logat.shape[2], dtype=torch.float64, device=given.logat.device) * 1e-12
        return 1 + steps[None, None, :, None].expand(given.logat.shape)


def test_top_ranks_a_float64_methods_scores_in_float64(lm):
    """Scores that differ only below float32's resolution rank by position, not as ties in token order."""
    model, tok = lm
    res = nxl.explain(model, tok, TEXT, methods=[Fine()])
    eligible = res.rankable(0).nonzero()[:, 0].tolist()
    assert [p for p, _, _ in res.top(3, method=Fine.name)] == sorted(eligible, reverse=True)[:3]


def test_nxl_tail_ranks_by_a_method_the_programs_probe_computes(tmp_path, capsys, monkeypatch):
    from nxl_hooks.apps.serve.controller import Controller
    from nxl_hooks.apps.serve.settings import Settings

    monkeypatch.setenv("COLUMNS", "200")  # nxl tail fits its lines to the terminal: whole lines here
    path = tiny.save_model(tmp_path / "lm", "llama")
    model = AutoModelForCausalLM.from_pretrained(path)
    run = tmp_path / "run"
    controller = Controller(Settings(run_dir=run, methods=[NAME], layers=[-1]))
    controller.adopt(model, str(path))
    try:
        codes: list[int] = []
        follower = threading.Thread(target=lambda: codes.append(cli_main(
            ["tail", "--run", str(run), "--count", "2", "--method", NAME, "-k", "1"])), daemon=True)
        follower.start()
        live_reader(controller)  # tail follows steps from now on
        ids = torch.tensor([[5, 7, 9, 11]])  # words: no special token, every position but the last ranks
        sequences = model.generate(input_ids=ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
        follower.join(timeout=60)
        assert codes == [0]
        lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("!")]
        logits, _ = _lm_oracle(model, sequences)
        assert len(lines) == 2
        for step, line in enumerate(lines):
            n = ids.shape[1] + step
            token = int(sequences[0, n])
            minus_logat = -logits[-1, 0, :n, token]
            best = _ranked(minus_logat, list(range(n - 1)))[0]  # what ranks: not the prediction position
            found = re.search(r"L2: (\d+):'.*?' (\S+)", line)
            assert found and int(found.group(1)) == best, line
            assert float(found.group(2)) == pytest.approx(float(minus_logat[best]), rel=5e-3)  # 3 digits
        capsys.readouterr()
        assert cli_main(["tail", "--run", str(run), "--count", "1", "--method", "contrastive", "--last", "1"]) == 0
        said = capsys.readouterr().out
        assert "the program's probe does not compute 'contrastive'" in said  # registered, not computed there
    finally:
        controller.close()


def test_contrastive_matches_the_oracle_on_a_classifier_and_a_generation(lm):
    bert, tok = tiny.build_model("bert", 0), tiny.tokenizer()
    res = nxl.explain(bert, tok, TEXT, methods=["contrastive"])
    enc = tok(TEXT, return_tensors="pt")
    with torch.no_grad():
        out = bert(**enc, output_hidden_states=True)
    logits = oracle.bert_classifier(bert).layer_logits(out.hidden_states)[:, 0]  # (L+1, seq, 2)
    target = int(out.logits[0].argmax())
    norms = out.hidden_states[0][0].float().norm(dim=-1)
    expected = norms * (logits[..., target] - logits[..., 1 - target])  # two labels: the foil is the other one
    torch.testing.assert_close(res.scores["contrastive"][:, 0], expected, atol=1e-5, rtol=1e-4)

    model, tok = lm
    probe, sequences = _generate(model, tok, methods=["contrastive"])
    layer_logits, norms = _lm_oracle(model, sequences)
    for step in probe.steps:
        n, token = step.position, int(step.token[0])
        final = layer_logits[-1, 0, n - 1].clone()
        final[token] = float("-inf")  # the foil: the model's best output other than the emitted token
        gap = layer_logits[:, 0, :n, token] - layer_logits[:, 0, :n, int(final.argmax())]
        torch.testing.assert_close(step.scores["contrastive"][:, 0], norms[0, :n] * gap, atol=1e-5, rtol=1e-4)


def test_contrastive_with_a_fixed_foil_on_a_regression_head_is_the_documented_gap_of_raw_outputs():
    """‖h⁰‖ × (HoT[y] − HoT[foil]) of the head's raw outputs (its LogAt is |HoT − HoT_p|: the gap mixed the two)."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=20, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        pad_token_id=0, max_position_embeddings=64, num_labels=2, problem_type="regression")).eval()
    ids = torch.tensor([[2, 7, 10, 11, 12, 3]])
    with torch.no_grad(), nxl.attach(model, methods=[Contrastive(foil=1)], layers="all", target=0) as probe:
        out = model(input_ids=ids, output_hidden_states=True)
    res = probe.result()
    logits = oracle.bert_classifier(model).layer_logits(out.hidden_states)[:, 0]  # (L+1, seq, 2): raw HoT
    norms = out.hidden_states[0][0].float().norm(dim=-1)
    torch.testing.assert_close(res.logat[:, 0], (logits[..., 0] - out.logits[0, 0]).abs(), atol=1e-5,
                               rtol=1e-4)  # (the regression LogAt, unchanged)
    torch.testing.assert_close(res.scores["contrastive"][:, 0], norms * (logits[..., 0] - logits[..., 1]),
                               atol=1e-5, rtol=1e-4)


def test_rows_a_fixed_foil_is_the_prediction_of_are_named_wherever_notes_show():
    """Contrastive(foil=f) of a batch where the model predicts f in some rows, not all: those rows have no foil and
    their scores are NaN; nothing said so (the note came only when every score was NaN). The repr, the attribution
    page and the terminal name them, and why; the others keep ‖h⁰‖ × (HoT[y] − HoT[f]). The oracle: the model's
    own logits (which rows predict f) and the hand-applied head."""
    import io

    from rich.console import Console

    from nxl_hooks.apps.terminal import show_attribution
    from nxl_hooks.records.html import attribution_html

    model = tiny.generating_llama()
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    predicted = out.logits[:, -1].argmax(-1)
    foil = int(predicted[1])
    without = (predicted == foil).nonzero().flatten().tolist()
    assert 0 < len(without) < ids.shape[0]  # some rows, not all
    with torch.no_grad(), nxl.attach(model, methods=[Contrastive(foil=foil)], layers="all") as probe:
        model(ids)
    res = probe.result()
    logits = oracle.llama(model).layer_logits(out.hidden_states)  # (L+1, rows, seq, vocab)
    norms = out.hidden_states[0].float().norm(dim=-1)
    for row in range(ids.shape[0]):
        scores = res.scores["contrastive"][:, row]
        if row in without:
            assert scores.isnan().all()
        else:
            expected = norms[row] * (logits[:, row, :, int(predicted[row])] - logits[:, row, :, foil])
            torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-4)
    named = (f"row {without[0]} has no foil" if len(without) == 1
             else f"rows {', '.join(map(str, without))} have no foil")
    console = Console(file=io.StringIO(), width=400)
    show_attribution(res, console, method="contrastive")
    for shown in (repr(res), attribution_html(res, method="contrastive"), console.file.getvalue()):
        assert named in shown and "the fixed foil is the output" in shown


def test_the_reserved_names_cover_every_parquet_column_and_evaluations_own_methods():
    """method.registry.RESERVED is written by hand (the method layer imports neither records' Parquet schema nor
    eval): a column or an evaluation baseline added there must be reserved too, or a method could take its name."""
    from nxl_hooks.eval import faithfulness as ev
    from nxl_hooks.records import parquet

    columns = {field.name for field in parquet.schema()} - set(registry.DEFAULT)  # the default methods' own columns
    baselines = set(ev.METHODS) - set(registry.builtin_names())
    assert not (columns | baselines) - registry.RESERVED, sorted((columns | baselines) - registry.RESERVED)


def test_a_method_with_a_wrong_shape_is_refused_with_its_name(lm, caplog):
    model, tok = lm

    class Flat(Method):
        name = "test_flat"
        description = "one number per token, not per layer (wrong)"

        def score(self, given: Given) -> torch.Tensor:
            return given.embed_norm

    with pytest.raises(ValueError, match="method 'test_flat' returned .*expected float scores shaped like logat"):
        nxl.explain(model, tok, TEXT, methods=[Flat()])
    with pytest.raises(ValueError, match="method name 'Bad-Name'"):
        nxl.register_method(type("Bad", (NegLogAt,), {"name": "Bad-Name"}))
    with pytest.raises(ValueError, match="taken by a record field"):
        nxl.register_method(type("Taken", (NegLogAt,), {"name": "position"}))
    with pytest.raises(ValueError, match="registered already"):
        nxl.register_method(NegLogAt)


def test_a_method_named_normxlogit_or_logat_is_never_registered_and_every_record_keeps_the_built_in(lm):
    """``register_method(Mine, replace=True)`` for a method named ``normxlogit`` (the line for a name taken said to
    pass ``replace=True``) put it in the built-in's place: every probe's ``res.normxlogit`` was then its scores, with
    nothing said. It is refused, replace or not, and the records stay the oracle's."""
    model, tok = lm
    ids = torch.tensor([[5, 9, 12, 7]])
    logits, norms = _lm_oracle(model, ids)

    class Zeros(Method):
        name = "normxlogit"
        description = "zeros in NormXLogit's place"

        def score(self, given: Given) -> torch.Tensor:
            return given.logat * 0

    for replace in (False, True):
        with pytest.raises(ValueError) as refused:
            nxl.register_method(Zeros, replace=replace)
        assert str(refused.value) == ("method name 'normxlogit' is the built-in method every record holds "
                                      "(res.normxlogit), which no registration replaces: give yours another name")
    with pytest.raises(ValueError, match="^method name 'logat' is the built-in method every record holds"):
        nxl.register_method(type("MyLogAt", (Zeros,), {"name": "logat"}), replace=True)
    assert type(nxl.get_method("normxlogit")) is not Zeros
    with torch.no_grad(), nxl.attach(model, layers="all") as probe:
        model(input_ids=ids)
    target = logits[-1, 0, -1].argmax()
    expected = norms[0] * logits[:, 0, :, target]
    torch.testing.assert_close(probe.result().normxlogit[:, 0], expected, atol=1e-5, rtol=1e-4)


def test_a_method_whose_scores_carry_a_gradient_is_stored_detached(lm, recwarn):
    """Scores made with autograd on (a weight that requires grad) were stored with their graph: top() warned
    'Converting a tensor with requires_grad=True to a scalar', and the record kept the graph alive."""
    model, tok = lm
    weight = torch.tensor(2.0, requires_grad=True)

    class Graphed(Method):
        name = "test_graphed"
        description = "twice LogAt, through a weight that requires grad"

        def score(self, given: Given) -> torch.Tensor:
            with torch.enable_grad():
                return given.logat * weight

    res = nxl.explain(model, tok, TEXT, methods=[Graphed()])
    scores = res.scores[Graphed.name]
    assert not scores.requires_grad and scores.grad_fn is None
    logits, _ = _lm_oracle(model, tok(TEXT, return_tensors="pt")["input_ids"])
    logat = logits[:, 0, :, logits[-1, 0, -1].argmax()]
    torch.testing.assert_close(scores[:, 0], 2 * logat, atol=1e-5, rtol=1e-4)
    eligible = res.rankable(0).nonzero()[:, 0].tolist()
    assert [p for p, _, _ in res.top(len(eligible), method=Graphed.name)] == _ranked(logat[-1], eligible)
    assert not [w for w in recwarn if "requires_grad" in str(w.message)]


class Exits(Method):
    """A method whose ``score`` exits the process (``sys.exit``), or raises ``error`` where one is given."""

    name = "test_exits"
    description = "sys.exit in score (defined in tests/oracle/test_methods.py)"
    pointwise = True

    def __init__(self, error: BaseException = SystemExit("method gave up")) -> None:
        self.error = error

    def score(self, given: Given) -> torch.Tensor:
        raise self.error


def test_a_method_that_exits_never_ends_the_hosts_forward_generate_or_batching(caplog):
    """A method's ``SystemExit`` (anything it raises but the user's Ctrl-C) is its failure, said in one line naming
    it: the forward, ``generate`` and continuous batching go on as unattached (the exit ended them, and batching
    returned nothing)."""
    from transformers import GenerationConfig

    model, ids = tiny.generating_llama(), torch.tensor([[3, 4, 5, 6, 7, 8]])
    said = "attribution method 'test_exits' raised SystemExit: method gave up"
    with torch.no_grad():
        plain_logits = model(input_ids=ids).logits
        plain = model.generate(input_ids=ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
        with nxl.attach(model, methods=[Exits()]) as probe:
            assert torch.equal(model(input_ids=ids).logits, plain_logits)
            assert str(probe.peek()) == said
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="nxl_hooks"):
                assert torch.equal(model.generate(input_ids=ids, max_new_tokens=2, do_sample=False, pad_token_id=0),
                                   plain)
        assert probe.calls[0].error == said and probe.unrecorded.endswith(f": {said}")
        assert [r.getMessage() for r in caplog.records if said in r.getMessage()] == [
            f"nxl_hooks: {probe.unrecorded}; the model's own call is unaffected"]
        with nxl.attach(model, methods=[Exits(KeyboardInterrupt())]), pytest.raises(KeyboardInterrupt):
            model(input_ids=ids)  # the user's Ctrl-C goes on to the program
    lm, prompts = tiny.build_model("llama"), [[5, 6, 7, 8], [9, 10, 11]]
    config = GenerationConfig(do_sample=False, max_new_tokens=3, eos_token_id=-1, pad_token_id=0)
    plain = lm.generate_batch(prompts, generation_config=config, continuous_batching_config=tiny.cb_config())
    with nxl.attach(lm, methods=[Exits()]) as probe:
        got = lm.generate_batch(prompts, generation_config=config, continuous_batching_config=tiny.cb_config())
    assert {k: v.generated_tokens for k, v in got.items()} == {k: v.generated_tokens for k, v in plain.items()}
    assert len(probe.calls) == 2 and all(call.error == said and not call.complete for call in probe.calls)


class _UnprintableExit(SystemExit):
    """A method's exit whose message cannot be made: its ``__str__`` raises."""

    def __str__(self) -> str:
        raise ValueError("no text")


@pytest.mark.parametrize("error, told", [
    (_UnprintableExit(), "_UnprintableExit: <unprintable _UnprintableExit>"),  # making it raised ValueError('no text')
    (SystemExit(), "SystemExit"),  # a bare sys.exit(): it read 'SystemExit: SystemExit', the type as the message
], ids=["unprintable", "no-message"])
def test_a_method_whose_exit_cannot_be_printed_or_has_no_message_is_said_in_one_line(error, told):
    """The call's reason says ``<unprintable TYPE>`` for an exit's message that cannot be made, the type alone for
    none, where the method's failure is said; the forward's logits are the unattached model's."""
    model, ids = tiny.generating_llama(), torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        plain_logits = model(input_ids=ids).logits
        with nxl.attach(model, methods=[Exits(error)]) as probe:
            assert torch.equal(model(input_ids=ids).logits, plain_logits)
            said = str(probe.peek())
    assert said == f"attribution method 'test_exits' raised {told}"


def test_a_method_that_raises_is_named_in_its_forwards_error_and_log_line(caplog):
    """A method whose ``score`` raises an ordinary error (a plugin's ValueError) is named where that is said, as an
    exit is: its record's error and the one log line said ``ValueError: bad input`` alone, which in a server's log
    points at no method; the forward's logits are the unattached model's, and the method's error is the cause."""
    model, ids = tiny.generating_llama(), torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        plain_logits = model(input_ids=ids).logits
        with caplog.at_level(logging.WARNING, logger="nxl_hooks"), \
                nxl.attach(model, methods=[Exits(ValueError("bad input"))]) as probe:
            assert torch.equal(model(input_ids=ids).logits, plain_logits)
    said = "attribution method 'test_exits' raised ValueError: bad input"
    with pytest.raises(RuntimeError) as raised:
        probe.result()
    assert str(raised.value) == said and isinstance(raised.value.__cause__, ValueError)
    assert [r.getMessage() for r in caplog.records if "bad input" in r.getMessage()] == [
        f"nxl_hooks: this forward not recorded (MethodError: {said}); the model's own call is unaffected"]


def test_explain_raises_why_its_forward_is_not_recorded_without_logging_it_too(caplog):
    """``nxl.explain`` raises the reason its forward is not recorded; it also logged that reason as a line, so the
    one failure was said twice (``nxl attribute --method NAME`` printed both on stderr, the log line first). Only
    the raise says it; a forward of the user's under ``attach`` still logs its one line (the test above)."""
    model, tok = tiny.build_model("llama", 0), tiny.tokenizer()
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"):
        with pytest.raises(RuntimeError) as raised:
            nxl.explain(model, tok, TEXT, methods=[Exits(ValueError("bad input"))])
        res = nxl.explain(model, tok, TEXT)  # the flag is the forward's alone: the model explained as before
    assert str(raised.value) == "attribution method 'test_exits' raised ValueError: bad input"
    assert [r.getMessage() for r in caplog.records if "not recorded" in r.getMessage()] == []
    logits, norms = _lm_oracle(model, tok(TEXT, return_tensors="pt")["input_ids"])
    target = logits[-1, 0, -1].argmax()
    torch.testing.assert_close(res.normxlogit[:, 0], norms[0] * logits[:, 0, :, target], atol=1e-5, rtol=1e-4)


def _install_doubled(tmp_path, monkeypatch):
    """An installed distribution whose ``nxl_hooks.methods`` group has ``test_plugin_doubled`` (twice NormXLogit)
    and a broken ``test_plugin_broken``; the loader reads the group afresh, as a new process would, and the
    process's registry is as it was after the test."""
    (tmp_path / "nxl_test_plugin.py").write_text(
        "class Doubled:\n"
        "    name = 'test_plugin_doubled'\n"
        "    description = 'twice NormXLogit'\n"
        "    def score(self, given):\n"
        "        return 2 * given.embed_norm[None, :, :, None] * given.logat\n")
    info = tmp_path / "nxl_test_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nxl-test-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[nxl_hooks.methods]\ntest_plugin_doubled = nxl_test_plugin:Doubled\n"
                                           "test_plugin_broken = nxl_test_plugin_missing:Nothing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(plugins.SETTING, raising=False)
    for cache in ("_points", "_loaded", "_failed"):
        monkeypatch.setattr(plugins, cache, {})
    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))
    monkeypatch.setattr(registry, "_INSTALLED", set(registry._INSTALLED))


def test_methods_install_through_entry_points_and_a_broken_one_is_one_line(tmp_path, monkeypatch, caplog):
    _install_doubled(tmp_path, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"):
        names = nxl.method_names()
    assert "test_plugin_doubled" in names and "test_plugin_broken" not in names
    broken = [r.getMessage() for r in caplog.records if "test_plugin_broken" in r.getMessage()]
    assert len(broken) == 1 and "\n" not in broken[0] and "ModuleNotFoundError" in broken[0]
    model, tok = tiny.build_model("llama", 0), tiny.tokenizer()
    res = nxl.explain(model, tok, TEXT, methods=["test_plugin_doubled"])
    torch.testing.assert_close(res.scores["test_plugin_doubled"], 2 * res.normxlogit)
    with pytest.raises(ValueError, match="unknown attribution method 'test_plugin_broken': plugin .* failed to load"):
        nxl.attach(model, methods=["test_plugin_broken"])
    assert os.environ.get("NXL_METHODS") is None  # nothing of the host's environment was changed


@pytest.mark.parametrize("lookup", [nxl.method_names, lambda: nxl.get_method("test_plugin_doubled")])
def test_a_method_registered_in_code_wins_over_an_installed_one_read_before_it(tmp_path, monkeypatch, lm, lookup):
    _install_doubled(tmp_path, monkeypatch)
    lookup()  # the plugin is read first (a program listing what it can compute)

    class Own(NegLogAt):
        name = "test_plugin_doubled"

    nxl.register_method(Own)  # no replace=True: the installed one gives way, as docs/methods.md says
    model, tok = lm
    res = nxl.explain(model, tok, TEXT, methods=["test_plugin_doubled"])
    logits, _ = _lm_oracle(model, tok(TEXT, return_tensors="pt")["input_ids"])
    torch.testing.assert_close(res.scores["test_plugin_doubled"][:, 0], -logits[:, 0, :, logits[-1, 0, -1].argmax()],
                               atol=1e-5, rtol=1e-4)
    nxl.method_names()  # reading the plugins again keeps the program's own
    assert isinstance(nxl.get_method("test_plugin_doubled"), Own)
    with pytest.raises(ValueError, match="registered already"):  # but code registering twice still needs replace
        nxl.register_method(Own)


def test_evaluation_scores_a_method_from_a_test_file(lm):
    from nxl_hooks.eval import faithfulness as ev

    model, tok = lm
    assert NAME in ev.available_methods()
    rec = ev.score_example(model, tok, {"text": TEXT, "evidence": ["good"]}, methods=[NAME, "random"],
                           keep_scores=True)
    logits, _ = _lm_oracle(model, tok(TEXT, return_tensors="pt")["input_ids"])
    logat = logits[:, 0, :, logits[-1, 0, -1].argmax()]
    mine = rec["methods"][NAME]
    assert mine["layered"] and len(mine["ap"]) == logits.shape[0] and not rec["methods"]["random"]["layered"]
    torch.testing.assert_close(torch.tensor(mine["scores"]), -logat[-1], atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="unknown method"):
        ev.score_example(model, tok, {"text": TEXT}, methods=["no_such_method"])


def test_a_new_built_in_method_file_is_in_evaluates_default_and_the_method_help(tmp_path):
    """A built-in method is one file in nxl_hooks/method/methods (docs/methods.md): no other list to edit (the
    --method help names it with its description). Run in a child process, whose package path gets the file before
    anything lists the methods."""
    (tmp_path / "test_positive.py").write_text(
        "class Positive:\n"
        "    name, description, pointwise = 'test_positive', 'max(LogAt, 0)', True\n"
        "    def score(self, given):\n"
        "        return given.logat.clamp(min=0)\n"
        "METHOD = Positive()\n")
    script = (f"import nxl_hooks.method.methods as methods; methods.__path__.append({str(tmp_path)!r})\n"
              "from nxl_hooks.eval import faithfulness as ev\n"
              "from nxl_hooks.apps.cli import build_parser\n"
              "print('default:', ' '.join(ev.DEFAULT_METHODS))\n"
              "build_parser().parse_args(['attribute', '--help'])\n")  # prints the help, exits 0
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    default = next(line for line in done.stdout.splitlines() if line.startswith("default:")).split()[1:]
    assert "test_positive" in default and "integrated_gradients" not in default
    # named with its description
    assert re.search(r"scores and ranks tokens \(default normxlogit\):[^.]*\btest_positive \(max\(LogAt, 0\)\)",
                     " ".join(done.stdout.split()))


def test_evaluation_gives_a_plain_class_that_contrasts_the_examples_foil(lm, monkeypatch):
    """A method contrasts with a foil by saying so (Contrasting: with_foil), however its class is written: a plain
    class (no dataclass field named foil) is given each example's foil, and left out of regression runs."""
    from nxl_hooks.eval import faithfulness as ev

    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))
    foils = []

    class PlainFoil(NegLogAt):
        name = "test_plain_foil"

        def __init__(self, foil=None):
            self.foil = foil

        def with_foil(self, foil):
            foils.append(foil)
            return PlainFoil(foil)

    nxl.register_method(PlainFoil)
    assert ev.foil_methods(["logat", "test_plain_foil", "contrastive"]) == ["test_plain_foil", "contrastive"]
    model, tok = lm
    rec = ev.score_example(model, tok, {"text": TEXT, "foil": 7}, methods=["test_plain_foil"])
    assert foils[-1] == 7 and "test_plain_foil" in rec["methods"]


def test_contrastive_adds_no_host_read_per_generated_token():
    """The contrastive method runs on the hot path with device tensors only: attached with it, generate reads values
    back from the device a constant number of times per call more than plain generate, whatever the tokens."""
    from test_host_reads import _reads

    model = tiny.generating_llama()
    inputs = {"input_ids": torch.randint(1, tiny.GEN_VOCAB, (2, 6), generator=torch.Generator().manual_seed(0)),
              "attention_mask": torch.ones(2, 6, dtype=torch.long), "do_sample": False}
    added = {}
    for new in (3, 10):
        plain = _reads(model, inputs, new)
        with nxl.attach(model, methods=["contrastive", NAME]) as probe:
            added[new] = _reads(model, inputs, new) - plain
        assert len(probe.steps) == new and not probe.steps[-1].scores["contrastive"].isnan().any()
    assert added[3] == added[10], added


class Share(Method):
    """A method that is not pointwise: each token's share of its row's NormXLogit at that layer (it reads every
    position of the context, so padding a step's context with later positions would change it)."""

    name = "test_share"
    description = "NormXLogit over its row's total (defined in tests/oracle/test_methods.py)"

    def score(self, given: Given) -> torch.Tensor:
        scores = given.embed_norm[None, :, :, None] * given.logat
        return scores / scores.sum(dim=2, keepdim=True)


nxl.register_method(Share, replace=True)


@pytest.mark.parametrize("methods", [["contrastive"], ["contrastive", "test_share"]], ids=["pointwise", "mixed"])
def test_generated_tokens_scored_together_equal_the_oracle_one_by_one(lm, methods, monkeypatch):
    """The steps a call scores together (at its end here) take one score call per method when every method is
    pointwise (rows of all steps stacked, each context padded to the longest), one per step otherwise; every step,
    every row, equals the oracle at its own context length either way."""
    from nxl_hooks.hooks import generate

    # all at the end, however slow a token of a loaded machine is (else the first waits at most BATCH_SECONDS)
    monkeypatch.setattr(generate, "BATCH_SECONDS", None)
    model, _ = lm
    ids = torch.randint(3, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(3))
    with nxl.attach(model, methods=methods) as probe:
        sequences = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                   do_sample=False, pad_token_id=0)
    assert len(probe.steps) == 6
    for row in range(2):
        layer_logits, norms = _lm_oracle(model, sequences[row:row + 1])
        for step in probe.steps:
            n, token = step.position, int(sequences[row, step.position])
            assert int(step.token[row]) == token and step.normxlogit.shape[2] == n
            logat = layer_logits[:, 0, :n, token]
            final = layer_logits[-1, 0, n - 1].clone()
            final[token] = float("-inf")
            gap = logat - layer_logits[:, 0, :n, int(final.argmax())]
            torch.testing.assert_close(step.logat[:, row], logat, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(step.normxlogit[:, row], norms[0, :n] * logat, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(step.scores["contrastive"][:, row], norms[0, :n] * gap, atol=1e-5, rtol=1e-4)
            if "test_share" in methods:
                share = norms[0, :n] * logat
                torch.testing.assert_close(step.scores["test_share"][:, row], share / share.sum(-1, keepdim=True),
                                           atol=1e-5, rtol=1e-4)
    # scored together: one score call's output, each record a view of its own rows and positions
    storages = {step.normxlogit.untyped_storage().data_ptr() for step in probe.steps}
    assert len(storages) == (1 if methods == ["contrastive"] else 6)


def test_generated_tokens_are_scored_in_the_publisher_thread_and_a_failure_there_ends_the_calls_records(
        lm, monkeypatch, caplog):
    """Waiting steps are scored off the generating thread, in the hub's publisher, where the model's device allows it
    (a GPU's; here the CPU made one of them), and in the generating thread otherwise and under an ``on_step``
    callback (which wants each record there); the records equal the oracle either way. A batch whose
    scoring raises there is lost, said in the call's error and in one line of the log; the batches after it are
    dropped (the call is not recorded from that step on); the generation itself is unchanged."""
    from nxl_hooks.hooks import generate

    model, _ = lm
    monkeypatch.setattr(generate, "BATCH_STEPS", 2)  # 6 tokens: three batches
    elsewhere = generate.SCORED_ELSEWHERE | {"cpu"}
    ids = torch.randint(3, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(4))

    def run(method: tiny.ScoringThreads, use_cache: bool = True, **options):
        with nxl.attach(model, methods=[method], **options) as probe:
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                 do_sample=False, pad_token_id=0, use_cache=use_cache)
        return out, probe

    plain = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                           pad_token_id=0)
    cases = ((elsewhere, {}, "nxl_hooks-publisher"), (generate.SCORED_ELSEWHERE, {}, "MainThread"),
             (elsewhere, {"on_step": lambda step: None}, "MainThread"))
    for devices, options, thread in cases:
        monkeypatch.setattr(generate, "SCORED_ELSEWHERE", devices)
        scorer = tiny.ScoringThreads()
        out, probe = run(scorer, **options)
        assert torch.equal(out, plain) and set(scorer.threads) == {thread}
        oracle.check_call(model, probe.calls[0], 6)
        for step in probe.steps:
            torch.testing.assert_close(step.scores["test_scoring_threads"], step.logat)
    monkeypatch.setattr(generate, "SCORED_ELSEWHERE", elsewhere)
    # a call that rewrites every position (use_cache=False) scores what waits before each rewrite in its own thread:
    # scored later, the batch would keep the buffer the rewrite goes over; its last step goes to the publisher
    rewriting = tiny.ScoringThreads()
    out, probe = run(rewriting, use_cache=False)
    assert torch.equal(out, plain) and sorted(rewriting.threads) == ["MainThread"] * 5 + ["nxl_hooks-publisher"]
    oracle.check_call(model, probe.calls[0], 6)
    broken = tiny.ScoringThreads(fail=True)
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"):
        out, probe = run(broken)
    call = probe.calls[0]
    assert torch.equal(out, plain) and set(broken.threads) == {"nxl_hooks-publisher"}
    said = "attribution method 'test_scoring_threads' raised RuntimeError: scoring broke"  # the method named
    assert call.steps == [] and not call.complete and call.error == said
    assert f"not recorded (scoring its steps): {said}" in probe.unrecorded
    assert [r.getMessage() for r in caplog.records if "scoring broke" in r.getMessage()] == [
        f"nxl_hooks: not recorded (scoring its steps): {said}; the model's own call is unaffected"]


class Late(Method):
    """LogAt, but a RuntimeError for a context longer than 7 positions."""

    name = "test_late"
    description = "LogAt; raises past 7 positions (tests/oracle/test_methods.py)"

    def score(self, given: Given) -> torch.Tensor:
        if given.logat.shape[2] > 7:
            raise RuntimeError(f"context {given.logat.shape[2]} too long")
        return given.logat.clone()


def test_a_method_failure_scoring_steps_in_the_calling_thread_is_said_as_the_publisher_says_it(monkeypatch, caplog):
    """Steps scored in the generating thread (the CPU) whose method raises at step 2: the call is not recorded from
    that batch on, "(scoring its steps)" from the step it begins with, as where the publisher scores them (it said
    "(the last generated token)"); the batch before it is kept."""
    from nxl_hooks.hooks import generate

    monkeypatch.setattr(generate, "BATCH_SECONDS", None)
    monkeypatch.setattr(generate, "BATCH_STEPS", 2)  # batches of steps [0, 1] and [2, 3]
    model, ids = tiny.generating_llama(), torch.tensor([[3, 4, 5, 6, 7, 8]])
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"), nxl.attach(model, methods=[Late()]) as probe:
        model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    call = probe.calls[0]
    assert [step.step for step in call.steps] == [0, 1] and not call.complete
    assert call.error == "attribution method 'test_late' raised RuntimeError: context 8 too long"
    assert probe.unrecorded == f"not recorded after step 1 (scoring its steps): {call.error}"
    assert [r.getMessage() for r in caplog.records if "too long" in r.getMessage()] == [
        f"nxl_hooks: {probe.unrecorded}; the model's own call is unaffected"]
    oracle.check_steps(model, call)  # the kept steps, against the oracle


def test_a_failure_in_the_generating_thread_is_the_one_said_and_steps_lost_in_the_publisher_after_it_are_noted(
        lm, monkeypatch, caplog):
    """A call that fails in its generating thread (here a hook's forward, at its fourth forward) is said not recorded
    for that failure, from the first step whose record did not go out: the steps waiting then are scored in that
    thread first (in the publisher, their own failure could win the race to be said). A batch already waiting in
    the publisher that fails there after that is not silent either: the call's notes and the log say which records
    were lost; the generation itself is unchanged."""
    from nxl_hooks.hooks import generate

    model, _ = lm
    monkeypatch.setattr(generate, "SCORED_ELSEWHERE", generate.SCORED_ELSEWHERE | {"cpu"})
    new_run = generate.Generations.new_run  # steps wait only for BATCH_STEPS, never for a time (a loaded machine)
    monkeypatch.setattr(generate.Generations, "new_run", lambda self, **options: new_run(self, **{**options,
                                                                                               "wait": None}))
    ids = torch.randint(3, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(4))
    after_forward, fail = generate.Run.after_forward, generate.Run.fail
    forwards, said = [], threading.Event()

    def breaking(self, capture):
        forwards.append(None)
        if len(forwards) == 4:
            raise RuntimeError("hook broke")
        after_forward(self, capture)

    def failing(self, what, error):
        fail(self, what, error)
        said.set()

    monkeypatch.setattr(generate.Run, "after_forward", breaking)
    monkeypatch.setattr(generate.Run, "fail", failing)

    def run(method: tiny.ScoringThreads):
        forwards.clear()
        with nxl.attach(model, methods=[method]) as probe:
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                 do_sample=False, pad_token_id=0)
        return out, probe

    plain = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                           pad_token_id=0)
    # the steps waiting when the hook fails (three: none were handed on yet) are scored in this thread, and their
    # scoring's own failure is not the one said
    scorer = tiny.ScoringThreads(fail=True)
    out, probe = run(scorer)
    call = probe.calls[0]
    assert torch.equal(out, plain) and scorer.threads == ["MainThread"]
    assert call.steps == [] and call.error == "hook broke" and call.notes == []
    assert "not recorded (this call): hook broke" in probe.unrecorded
    # two steps a batch: steps 0 and 1 wait in the publisher, which fails them once the hook's failure is said;
    # step 2 is recorded in this thread meanwhile, then dropped with them (the records stop at the gap)
    monkeypatch.setattr(generate, "BATCH_STEPS", 2)
    said.clear()
    scorer = tiny.ScoringThreads(fail="nxl_hooks-publisher", wait=said)
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"):
        out, probe = run(scorer)
    call = probe.calls[0]
    assert torch.equal(out, plain) and sorted(scorer.threads) == ["MainThread", "nxl_hooks-publisher"]
    assert call.steps == [] and call.error == "hook broke"
    assert "not recorded after step 2 (this call): hook broke" in probe.unrecorded
    lost = ("the records of its steps from step 0 on were lost (scoring them raised MethodError: attribution method "
            "'test_scoring_threads' raised RuntimeError: scoring broke)")
    assert call.notes == [lost]
    assert f"nxl_hooks: {lost}; the model's own call is unaffected" in [r.getMessage() for r in caplog.records]


def test_a_call_whose_batch_was_lost_keeps_that_failure_when_its_end_finds_more(lm, monkeypatch, caplog):
    """What a call's end finds (forwards its hooks never saw) is said only where nothing was said before: when a
    batch of it was lost in the publisher first (here, at the moment the end looks), the call keeps that failure as
    its one error and notice, and what the end found goes to its notes and the log."""
    from nxl_hooks.hooks import generate

    model, _ = lm
    ids = torch.randint(3, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(4))
    missed = "not recorded: 2 of the generated tokens came from forwards that never reached the probe's hooks"

    def lost_meanwhile(self, sequences):
        self._lost(0, RuntimeError("scoring broke"))  # as the publisher does for a batch whose scoring raised
        return missed

    monkeypatch.setattr(generate.Run, "_missed", lost_meanwhile)
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"), nxl.attach(model) as probe:
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                       pad_token_id=0)
    call = probe.calls[0]
    assert call.error == "scoring broke" and probe.unrecorded == "not recorded (scoring its steps): scoring broke"
    assert call.notes == [missed]
    logged = [record.getMessage() for record in caplog.records]
    assert f"nxl_hooks: {missed}; the model's own call is unaffected" in logged
    assert not any(missed in line for line in logged if "unaffected" not in line)


def test_a_given_made_by_hand_without_a_mask_has_every_position_real():
    """A method's own unit test may build ``Given`` without ``mask`` (the field came after the others): it builds,
    every position real, on ``logat``'s device (a required mask broke such tests with a TypeError)."""
    logat = torch.randn(2, 3, 5, 1)
    given = Given(logat, torch.rand(3, 5), torch.zeros(3, 1, dtype=torch.long), None, lambda ids: logat)
    assert given.mask.dtype == torch.bool and given.mask.shape == (3, 5) and bool(given.mask.all())
    assert given.mask.device == logat.device
