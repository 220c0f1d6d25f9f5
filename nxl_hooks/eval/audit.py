"""Quantization audit: what changed in the attributions between a reference model and a candidate.

    rec = audit_example(reference, candidate, tokenizer, {"text": "a fine film"})
    summary = aggregate(records)             # per layer: Spearman, Kendall, top-k overlap, drift; agreement

Both models explain the same thing, so a change in the scores is a change in the model, not in the question: with
``explain="target"`` (the default, as ``nxl evaluate``) the example's ``target`` where it has one, else the
reference's prediction; with ``explain="reference"`` the reference's prediction always (a dataset's target is then
only shown). Each record says which (``explained``: ``"target"`` or ``"reference prediction"``). Per layer l, over
the real tokens:

- ``spearman[l]``, ``kendall[l]``: rank correlation of the two NormXLogit vectors over the tokens that rank
  (:meth:`Attribution.rankable`: no padding, prediction position or special tokens, as everywhere);
  ``None`` when either is constant or fewer than two tokens rank (``topk`` is then None too).
- ``topk[l]``: |top-k(reference) ∩ top-k(candidate)| / k by signed score, same tokens ranked (k at most the
  number of tokens that rank). With no more ranked tokens than k it is 1 whatever changed: ``ranked`` (the number
  of tokens that rank) says so, and :func:`aggregate` leaves such examples out of the top-k means.
- ``drift[l]``: ‖candidate − reference‖₂ / ‖reference‖₂ over all real tokens.
- ``agree``: the candidate's own prediction equals the reference's (classifiers and causal LMs).

Records also carry each token's readable text (``readable``), the target's and both predictions' texts,
``flat_norms`` (the reference's embedding norms nearly equal on the ranked tokens: NormXLogit ranks as LogAt) and
``model_last_layer`` (the model's own last layer: the layers audited may stop short of it).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from ..arch.registry import HeadKind, log_probabilities, resolve
from ..method.subject import unwrap
from ..hooks.probe import attach
from ..method.placement import input_device
from ..method.scores import OVERFLOWED, WIDER, flat_norms, wide
from ..method.select import check_length, order, position_limit, resolve_target, whole_number
from ..records.attribution import Attribution
from ..records.tokens import describe_target, label_text, readable_ids
from .metrics import mean

__all__ = ["EXPLAIN", "SCHEMA", "aggregate", "audit_example", "check_auditable", "check_same_head", "check_same_tokens",
           "compare", "most_changed"]

SCHEMA = "nxl_hooks.audit/1"
#: What an audit may explain (:func:`audit_example`'s ``explain``), the default first.
EXPLAIN = ("target", "reference")


def _head(model: nn.Module) -> str:
    """What a model's outputs are, in words: its head kind, how many outputs, and a classifier's labels."""
    inner = unwrap(model)
    _, kind = resolve(inner)
    config = inner.config
    if kind.vocabulary:
        return f"a {kind} head of {config.get_text_config().vocab_size} outputs"
    labels = ", ".join(str(config.id2label[i]) for i in sorted(config.id2label))
    # (transformers fills problem_type in at the first training forward: only multi-label reads its outputs otherwise)
    problem = ", multi-label" if config.problem_type == "multi_label_classification" else ""
    return f"a {kind} head of {config.num_labels} outputs ({labels}{problem})"


def check_same_head(reference: nn.Module, candidate: nn.Module) -> None:
    """A ValueError (one line) unless both models have one output space: the same head kind, number of outputs and,
    for classifiers, labels. An audit explains one output id in both: in another output space that id is another
    thing (a label of one model, a token of the other), and every number would compare unrelated outputs."""
    ours, theirs = _head(reference), _head(candidate)
    if ours != theirs:
        raise ValueError(f"the candidate has {theirs} but the reference {ours}: an audit compares one output of "
                         "both models, so give a candidate with the reference's head (another checkpoint or a "
                         "quantized copy of the same task model)")


def check_auditable(model: nn.Module) -> None:
    """A ValueError (one line) for a model no audit compares, whatever the example: a masked LM (it explains each of
    its mask tokens, an audit one prediction per text). ``check_auditable(reference)``, once before a dataset runs."""
    if resolve(unwrap(model))[1] is HeadKind.MASKED_LM:
        raise ValueError("a masked LM cannot be audited: the audit compares classifiers and causal LMs; audit a "
                         "classifier built on it")


def check_same_tokens(tokenizer: Any, candidate_tokenizer: Any, texts: Sequence[str]) -> None:
    """A ValueError (one line) unless the candidate's tokenizer reads each of ``texts`` into the reference's ids. An
    audit feeds both models the reference's tokens: a candidate whose own tokenizer reads the text otherwise (one
    vocabulary but another normalizer, or no [CLS] / BOS added) would be measured on input it is never given.
    ``check_same_tokens(tok, candidate_tok, [e["text"] for e in examples])``"""
    if candidate_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError("the candidate's tokenizer differs from the reference's: the audit compares token by token, "
                         "so both models must share one tokenizer")
    for index, text in enumerate(texts):
        ours, theirs = tokenizer(text)["input_ids"], candidate_tokenizer(text)["input_ids"]
        if ours != theirs:
            shown = [" ".join(readable_ids(tokenizer, ids)) for ids in (theirs, ours)]
            raise ValueError(f"the candidate's tokenizer reads example {index} as {shown[0]!r} but the reference's as "
                             f"{shown[1]!r}: the audit feeds both models the reference's tokens, so both must share "
                             "one tokenizer")


def _check_top_k(top_k: Any) -> None:
    """A ValueError (one line) unless ``top_k`` is a whole number of at least 1: k = 0 divided by zero, and a negative
    k sliced from the end, giving an overlap of -1."""
    whole_number(top_k, f"top_k={top_k!r}: give the k of the top-k overlap as a whole number of at least 1", least=1)


def _finite(value: float) -> float | None:
    return None if math.isnan(value) else float(value)


def _rank_metrics(ref: torch.Tensor, cand: torch.Tensor, top_k: int) -> tuple[float | None, float | None, float | None]:
    from scipy import stats

    if len(ref) < 2:
        return None, None, None
    a, b = ref.double().numpy(), cand.double().numpy()
    with warnings.catch_warnings():  # constant input: the correlation is undefined, reported as None
        warnings.simplefilter("ignore")
        rho = _finite(stats.spearmanr(a, b).statistic)
        tau = _finite(stats.kendalltau(a, b).statistic)
    k = min(top_k, len(ref))
    everything = torch.ones_like(ref, dtype=torch.bool)
    top_ref = set(order(ref, everything)[:k].tolist())
    top_cand = set(order(cand, everything)[:k].tolist())
    return rho, tau, len(top_ref & top_cand) / k


def compare(reference: Attribution, candidate: Attribution, *, row: int = 0, top_k: int = 5) -> dict[str, Any]:
    """Per-layer agreement of two attributions of the same input and target: ``compare(ref_res, cand_res)``.

    Returns ``{"layers", "spearman", "kendall", "topk", "drift"}`` with one value per layer, and ``ranked``: how
    many tokens rank (those the correlations and the overlap are over).
    """
    _check_top_k(top_k)
    if reference.layers != candidate.layers or reference.normxlogit.shape != candidate.normxlogit.shape:
        raise ValueError("the two attributions differ in layers or shape: attribute the same text with the same layers")
    if reference.normxlogit.dim() != 3:
        raise ValueError("compare one target at a time (the attributions have a trailing target axis)")
    real = reference.rankable(row)
    everywhere = reference.mask[row].bool()
    out: dict[str, Any] = {"layers": list(reference.layers), "spearman": [], "kendall": [], "topk": [], "drift": [],
                           "ranked": int(real.sum())}
    for ref, cand in zip(reference.normxlogit[:, row], candidate.normxlogit[:, row]):
        rho, tau, overlap = _rank_metrics(ref[real], cand[real], top_k)
        scale = float(ref[everywhere].norm())
        out["spearman"].append(rho)
        out["kendall"].append(tau)
        out["topk"].append(overlap)
        out["drift"].append(float((cand - ref)[everywhere].norm()) / scale if scale > 0 else None)
    return out


def _attribute(
    model: nn.Module, tokenizer: Any, ids: torch.Tensor, target: Any, layers: Any
) -> tuple[Attribution, torch.Tensor]:
    """The attribution and the model's own outputs at the prediction position ((outputs,), at least float32: a
    float64 model's as they are, whose argmax float32 could tie with the next)."""
    with torch.no_grad(), attach(model, layers=layers, target=target, tokenizer=tokenizer) as probe:
        logits = model(input_ids=ids.to(input_device(model))).logits
    res = probe.result()
    if logits.dim() == 3:  # causal LM: (1, seq, vocab)
        logits = logits[:, int(res.position[0])]
    return res, logits[0].to(wide(logits.dtype)).cpu()


def audit_example(
    reference: nn.Module,
    candidate: nn.Module,
    tokenizer: Any,
    example: Mapping[str, Any],
    *,
    layers: Any = "all",
    top_k: int = 5,
    explain: str = "target",
) -> dict[str, Any]:
    """Compare the two models' attributions on one example; a JSON-able record. See the module docstring.

    ``audit_example(ref, quantized, tok, {"text": "a fine film"}, explain="reference")``. ``explain="target"``:
    both explain ``example["target"]`` (an id or a label/token string) where it is given, else the reference's
    prediction; ``"reference"``: the reference's prediction.
    """
    if explain not in EXPLAIN:
        raise ValueError(f"explain={explain!r}: use 'target' (the example's target, else the reference's prediction) "
                         "or 'reference' (the reference's prediction)")
    _check_top_k(top_k)  # before the two forwards
    check_auditable(reference)  # (a text without a mask token would fail first, saying less)
    text = example.get("text")
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"example needs a non-empty 'text' string, got keys {sorted(example)}")
    limits = [n for n in (position_limit(unwrap(reference)), position_limit(unwrap(candidate))) if n is not None]
    check_length(tokenizer, text, min(limits, default=None))  # the model has no position for the rest
    ids = torch.tensor([tokenizer(text)["input_ids"]], dtype=torch.long)
    given, notes = example.get("target", "predicted"), []
    requested = given if explain == "target" else "predicted"
    inner = unwrap(reference)
    kind = resolve(inner)[1]
    # a regression head explains its one output, as in nxl evaluate (a word there failed as a label it lacks)
    if requested != "predicted" and kind is HeadKind.REGRESSION:
        notes.append("target not used: a regression head explains its one output")
        requested = "predicted"
    if requested != "predicted":  # a word is read after the text, as everywhere
        resolved = resolve_target(inner, kind, tokenizer, requested, prompt=text)
        requested = resolved.id
        note = describe_target(tokenizer, inner.config, kind, resolved)["note"]
        notes += [note] if note else []
    ref, ref_out = _attribute(reference, tokenizer, ids, requested, layers)
    target = int(ref.target[0])
    cand, cand_out = _attribute(candidate, tokenizer, ids, target, layers)
    # (its prediction would be argmax's pick among NaN, its scores, output change and drift NaN)
    overflowed = [which for which, res in (("reference", ref), ("candidate", cand)) if res.overflowed()]
    if overflowed:
        raise ValueError(f"the {' and '.join(overflowed)} model's {OVERFLOWED}: {WIDER}")
    kind = HeadKind(ref.meta["head_kind"])
    regression = kind is HeadKind.REGRESSION
    real = ref.mask[0]
    id2label = getattr(unwrap(reference).config, "id2label", None)

    def name(label: torch.Tensor) -> str | None:
        return None if regression else label_text(tokenizer, id2label, kind, int(label))

    return {
        "schema": SCHEMA,
        "id": example.get("id"),
        "text": text,
        "tokens": [t for t, keep in zip(ref.tokens[0], real.tolist()) if keep],
        "readable": [t for t, keep in zip(ref.readable[0], real.tolist()) if keep],
        "position": int(ref.position[0]),
        "target": target,
        "target_token": tokenizer.convert_ids_to_tokens(target) if kind is HeadKind.CAUSAL_LM else None,
        "target_text": name(ref.target[0]),
        "explained": "target" if requested != "predicted" else "reference prediction",
        "dataset_target": None if given == "predicted" else given,
        "notes": notes,
        "flat_norms": flat_norms(ref.norm_spread(0)),
        "reference_prediction": None if regression else int(ref_out.argmax()),
        "candidate_prediction": None if regression else int(cand_out.argmax()),
        "reference_prediction_text": name(ref_out.argmax()),
        "candidate_prediction_text": name(cand_out.argmax()),
        "agree": None if regression else bool(ref_out.argmax() == cand_out.argmax()),
        "reference_output": float(ref_out[0] if regression
                                  else log_probabilities(unwrap(reference), ref_out)[target].exp()),
        "candidate_output": float(cand_out[0] if regression
                                  else log_probabilities(unwrap(candidate), cand_out)[target].exp()),
        "model_last_layer": ref.meta.get("n_blocks"),  # layer n_blocks is the model's output: --layers may stop short
        "reference_scores": ref.normxlogit[-1, 0][real].tolist(),  # the last captured layer
        "candidate_scores": cand.normxlogit[-1, 0][real].tolist(),
        **compare(ref, cand, top_k=top_k),
        "top_k": top_k,
    }


def most_changed(records: Sequence[Mapping[str, Any]]) -> list[int]:
    """Positions in ``records``, most changed first: flipped predictions, then lowest last-layer Spearman.

    Where Spearman is undefined: with two or more ranked tokens (``topk`` is defined) one side's scores are all
    equal, so its ranking collapsed (or appeared out of a flat reference): the whole order changed, ranked before
    the lowest correlation. With fewer than two (``topk`` None too) there is no order that could change: those come
    after every defined correlation. Ties go by drift, largest first."""

    def key(i: int) -> tuple:
        rec = records[i]
        rho = rec["spearman"][-1]
        undefined = 0 if rec["topk"][-1] is not None else 2  # a collapsed ranking first, too short to rank last
        return (rec["agree"] is not False, 1 if rho is not None else undefined, rho or 0.0, -(rec["drift"][-1] or 0.0),
                i)

    return sorted(range(len(records)), key=key)


METRICS = ("spearman", "kendall", "topk", "drift")

#: Why an example's value at a layer is in no mean (``aggregate``'s ``left_out``).
SHORT = "fewer than two ranked tokens"
COLLAPSED = "one side's scores all equal (no correlation)"
ALL_RANKED = "no more ranked tokens than k (its overlap is 1 whatever changed)"
ZERO = "the reference's scores all zero"


def _trivial_topk(record: Mapping[str, Any]) -> bool:
    """Both top-k sets are every ranked token: the overlap is 1 whatever the models did (records of 0.3 do not
    say how many tokens rank: their overlap counts, as it did)."""
    ranked = record.get("ranked")
    return ranked is not None and ranked <= record["top_k"]


def _counted(record: Mapping[str, Any], name: str, layer: int) -> float | None:
    """The record's value of ``name`` at ``layer`` as the means take it: None where it says nothing."""
    return None if name == "topk" and _trivial_topk(record) else record[name][layer]


def _left_out(records: Sequence[Mapping[str, Any]], name: str) -> dict[str, int]:
    """How many examples the mean of ``name`` at the last audited layer leaves out, by why."""
    why: dict[str, int] = {}
    for record in records:
        if _counted(record, name, -1) is not None:
            continue
        if name == "drift":
            reason = ZERO
        elif record["topk"][-1] is None:
            reason = SHORT
        else:
            reason = ALL_RANKED if name == "topk" else COLLAPSED
        why[reason] = why.get(reason, 0) + 1
    return why


def aggregate(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Means over examples, per layer and at the last audited layer, and the order of change. ``aggregate(records)``

    ``last_layer`` holds the means at ``layers[-1]``, the last of the layers audited: ``last_layer_index`` says which
    it is, and it is the model's own last layer only where it equals ``model_last_layer`` (None in records that do
    not say). A mean is over the examples where its metric says something: ``counted[name]`` gives how many, per
    layer, and ``left_out[name]`` why the others are not in it at the last audited layer (:data:`SHORT`,
    :data:`COLLAPSED`, :data:`ALL_RANKED`, :data:`ZERO`)."""
    if not records:
        raise ValueError("aggregate needs at least one audit record")
    layers = records[0]["layers"]
    if any(r.get("schema") != SCHEMA or r["layers"] != layers for r in records):
        raise ValueError(f"records must all be {SCHEMA} records with the same layers: aggregate one audit at a time")
    counted = {name: [[_counted(r, name, i) for r in records] for i in range(len(layers))] for name in METRICS}
    per_layer = {name: [mean(values) for values in counted[name]] for name in METRICS}
    agreement = [r["agree"] for r in records if r["agree"] is not None]
    return {
        "schema": SCHEMA,
        "n": len(records),
        "layers": layers,
        "top_k": records[0]["top_k"],
        "agreement": sum(agreement) / len(agreement) if agreement else None,
        "flipped": sum(1 for a in agreement if not a),
        "output_change": mean([abs(r["candidate_output"] - r["reference_output"]) for r in records]),
        "last_layer": {name: values[-1] for name, values in per_layer.items()},
        "last_layer_index": layers[-1],
        "model_last_layer": records[0].get("model_last_layer"),
        "per_layer": per_layer,
        # how many examples each mean is over, per layer, and why the others are left out at the last layer
        "counted": {name: [sum(v is not None for v in values) for values in counted[name]] for name in METRICS},
        "left_out": {name: _left_out(records, name) for name in METRICS},
        "most_changed": [records[i].get("index", i) for i in most_changed(records)],
        "flat_norms": sum(1 for r in records if r.get("flat_norms")),  # examples where NormXLogit ranks as LogAt
        # what the examples explain: {"target": n, "reference prediction": m} (records of 0.2 do not say)
        "explained": {what: sum(1 for r in records if r.get("explained") == what)
                      for what in ("target", "reference prediction")},
    }
