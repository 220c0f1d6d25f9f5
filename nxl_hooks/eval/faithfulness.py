"""Faithfulness of token attributions (SPEC section 5): AOPC comprehensiveness and sufficiency, accuracy /
Pearson after perturbation, and per-layer evidence alignment, for several methods side by side.

CONTRACT (record based, everything JSON-able; the dataset runner shards, resumes and merges these)::

    from nxl_hooks.eval import faithfulness as ev
    rec = ev.score_example(model, tokenizer, example, methods=ev.DEFAULT_METHODS, layer=-1, seed=0)
    summary = ev.aggregate(records)

``example``: {"text": str,                      # required; a masked LM needs exactly one mask token in it
              "label": int | float | str,       # optional gold: class id / label name / regression value /
                                                #   LM token string
              "evidence": [str, ...],           # optional words whose tokens are the known evidence
              "target": int | str,              # optional: what to explain; default the model's prediction
              "foil": int | str,                # optional: the contrast for "contrastive" (default: runner-up);
                                                #   when given, p and accuracy are over (target, foil), BLiMP-style
              "id": any JSON value}             # optional, copied to the record
``rec`` (one dict per example; see :func:`score_example` for every key):
    rec["methods"][name] = {"comprehensiveness": [per K], "sufficiency": [per K],
                            "comp_correct": [per K] | None, "suff_correct": [...] | None,
                            "comp_pred": [per K], "suff_pred": [per K],
                            "layered": bool, "ap": [per layer] | [one] | None, "dot": same, "seconds": float | None}
``summary`` = aggregate(records): {"n", "ks", "layers", "eval_layer", "kind", "perturbation", "accuracy",
    "pearson", "methods": {name: {"aopc_comprehensiveness", "aopc_sufficiency", "comprehensiveness_curve",
    "sufficiency_curve", "accuracy_comprehensiveness", "accuracy_sufficiency", "pearson_comprehensiveness",
    "pearson_sufficiency", "layered", "ap", "dot", "ap_eval", "dot_eval", "n_evidence", "seconds"}}}

Methods: random (seeded by seed and text), embed_norm, every registered attribution method
(:mod:`nxl_hooks.method.registry`: logat, normxlogit, contrastive (NormXLogit[target] - NormXLogit[foil]) and any
registered in code or through an entry point), grad_norm, grad_x_input, integrated_gradients (captum;
:mod:`nxl_hooks.eval.baselines`). :func:`available_methods` lists them.
"""

from __future__ import annotations

import math
import numbers
import time
import zlib
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from ..arch.registry import HeadKind, blocks, log_probabilities, resolve
from ..arch.values import integer
from ..hooks.probe import attach
from ..method.chat import locate_template
from ..method.placement import input_device
from ..method.protocol import Contrasting, Method
from ..method.registry import builtin_names, get_method, method_names
from ..method.scores import OVERFLOWED, WIDER, flat_norms, norm_spread, wide
from ..method.select import (check_length, layer_index, order, pad_token_id, position_limit, prediction_rows,
                             rankable, resolve_layers, resolve_target)
from ..method.subject import unwrap
from ..records.tokens import describe_target, label_text, readable_ids
from .baselines import GRADIENT_METHODS, check_ig_steps, gradient_scores_many, keeps_logits, one_row_only
from .metrics import average_precision, evidence_mask, mean, normalized_dot, pearson

__all__ = [
    "BASELINES",
    "DEFAULT_KS",
    "DEFAULT_METHODS",
    "METHODS",
    "aggregate",
    "available_methods",
    "average_precision",
    "evidence_mask",
    "foil_methods",
    "mean",
    "normalized_dot",
    "perturb",
    "run_padded",
    "score_example",
]

SCHEMA = "nxl_hooks.eval/1"
#: Fractions of the non-pad length perturbed: int(n * K) tokens.
DEFAULT_KS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
#: The built-in methods: the baselines and every built-in attribution method (a new file in
#: nxl_hooks.method.methods is one here too, with no edit); "contrastive" is NormXLogit[target] - NormXLogit[foil]
#: (a variant beyond the paper). :func:`available_methods` adds every registered attribution method.
METHODS = ("random", "embed_norm", *builtin_names(), *GRADIENT_METHODS)
#: What runs unless asked otherwise: every method but Integrated Gradients, whose 50 forward and backward passes
#: cost more than all the others together (on SmolLM2-135M, CPU: 3.4 s per example with it, 1.5 s without).
DEFAULT_METHODS = tuple(m for m in METHODS if m != "integrated_gradients")
#: Methods that are a floor to beat, not candidates: never "best" in a report (random costs nothing, too).
BASELINES = ("random",)


def k_as_written(k: float) -> Fraction:
    """K as the decimal the user wrote, exactly: 90 * 0.7 is 62.99999999999999 in floats (int() perturbed 62 tokens,
    not 63), and a float32 0.7 is 0.699999988 (str() gives it back as 0.7). ``k_as_written(0.7) * 90 == 63``"""
    return Fraction(k) if isinstance(k, numbers.Integral) else Fraction(str(k))


def available_methods() -> tuple[str, ...]:
    """Every method :func:`score_example` takes: :data:`METHODS` and each registered attribution method
    (:func:`~nxl_hooks.method.registry.method_names`), which score every layer."""
    return tuple(dict.fromkeys([*METHODS[:2], *method_names(), *METHODS[2:]]))


def _foiled(method: Method, foil: int | None) -> Method | None:
    """``method`` as one example runs it: a method that contrasts with a foil
    (:class:`~nxl_hooks.method.protocol.Contrasting`, as :class:`~nxl_hooks.method.methods.contrastive.Contrastive`
    is) gets the example's (None: nothing to contrast with, the method is left out); any other as it is."""
    if not isinstance(method, Contrasting):
        return method
    return None if foil is None else method.with_foil(foil)


def foil_methods(methods: Sequence[str]) -> list[str]:
    """The names in ``methods`` of registered attribution methods that contrast the target with a foil (as
    "contrastive" does): a regression head, whose one output has nothing to contrast with, cannot run them.
    ``foil_methods(["logat", "contrastive"])`` -> ``["contrastive"]``"""
    registered = set(method_names())
    return [m for m in methods if m in registered and _foiled(get_method(m), None) is None]

_Predict = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# -- perturbation ----------------------------------------------------------------------------------------


def perturb(
    input_ids: torch.Tensor,
    position: int,
    scores: torch.Tensor,
    count: int,
    *,
    keep_top: bool,
    mode: str,
    mask_id: int | None = None,
    protected_ids: Sequence[int] = (),
    template: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """One perturbed copy of a 1-D ``input_ids`` and the new prediction position.

    The top-``count`` tokens by signed ``scores`` (the prediction ``position`` and tokens whose id is in
    ``protected_ids`` excluded) are perturbed (comprehensiveness), or with ``keep_top=True`` every other
    token is (sufficiency). ``mode``: "mask" replaces with ``mask_id``, "delete" drops the tokens. The
    prediction position, protected tokens and a chat ``template``'s tokens (bool (seq,),
    :func:`nxl_hooks.method.chat.locate_template`) are never touched.
    ``perturb(ids, 0, s, 3, keep_top=False, mode="mask", mask_id=tok.mask_token_id, protected_ids=tok.all_special_ids)``
    """
    n = input_ids.shape[0]
    ranked = order(scores, _candidates(input_ids, position, protected_ids, template))
    chosen = ranked[count:] if keep_top else ranked[:count]
    if mode == "mask":
        if mask_id is None:
            raise ValueError("mode='mask' needs mask_id (the tokenizer's mask_token_id)")
        out = input_ids.clone()
        out[chosen] = mask_id
        return out, position
    if mode == "delete":
        keep = torch.ones(n, dtype=torch.bool)
        keep[chosen] = False
        return input_ids[keep], int(keep[:position].sum())
    raise ValueError(f"mode={mode!r}: use 'mask' or 'delete'")


def _candidates(input_ids: torch.Tensor, position: int, protected_ids: Sequence[int],
                template: torch.Tensor | None = None) -> torch.Tensor:
    """bool (seq,): what a method ranks and perturbation may touch, by the one rule of
    :func:`nxl_hooks.method.select.rankable` (not the prediction, not the protected special tokens, not a chat
    template's markers and system prompt), without its fall-back to special tokens: they are never perturbed
    (docs/faithfulness.md), and a one-word text's <s> deleted would measure the model without its <s>, not the
    ranking."""
    special = torch.isin(input_ids, torch.tensor(list(protected_ids), dtype=input_ids.dtype))
    return rankable(torch.ones_like(input_ids, dtype=torch.bool), position, special, template, fallback=False)


#: What one more forward costs, in padded tokens: on a CPU a forward of a few short rows is bound by reading every
#: weight once (SmolLM2-135M: about 50 ms for one token, then 1.8 ms per token more, with one thread).
FORWARD_TOKENS = 32


def _batches(lengths: Sequence[int], max_rows: int, max_tokens: int) -> list[tuple[int, int]]:
    """(start, stop) batches of rows sorted by length, cheapest in padded tokens plus FORWARD_TOKENS per forward
    (dynamic programming over where batches end); a batch holds at most ``max_rows`` rows and, unless it is one
    row, ``max_tokens`` padded tokens."""
    best = [0.0] + [float("inf")] * len(lengths)
    start_of = [0] * (len(lengths) + 1)
    for stop in range(1, len(lengths) + 1):
        for start in range(max(0, stop - max_rows), stop):
            padded = (stop - start) * lengths[stop - 1]  # sorted: the last row is the widest
            if padded > max_tokens and stop - start > 1:
                continue
            cost = best[start] + padded + FORWARD_TOKENS
            if cost < best[stop]:
                best[stop], start_of[stop] = cost, start
    cuts, stop = [], len(lengths)
    while stop:
        cuts.append((start_of[stop], stop))
        stop = start_of[stop]
    return cuts[::-1]


def run_padded(predict: _Predict, rows: Sequence[tuple[torch.Tensor, int]], *, pad_id: int, max_rows: int = 64,
               max_tokens: int = 4096, known: tuple[torch.Tensor, int, torch.Tensor] | None = None) -> torch.Tensor:
    """Outputs (len(rows), outputs) of variable-length ``(ids, position)`` rows, in few padded forwards.

    Identical rows run once, and a row equal to ``known`` = (ids, position, output) not at all (sufficiency
    keeps every token once K covers them all: that row is the unperturbed input). The others are sorted by
    length and cut into batches (:func:`_batches`: few forwards, little padding); each batch is right-padded
    with ``pad_id`` and an attention mask of 0 on the padding. Right padding leaves every real token where it
    was (positions 0..n-1, the prediction position unchanged) and a causal decoder never lets a real token see
    a later pad, so no position ids are needed; encoders mask the padding out. ``predict(ids, mask, positions)``
    reads each row's output. ``run_padded(setup.predict, [(ids, 4), (ids[1:], 3)], pad_id=0)``
    """
    keys = [(tuple(ids.tolist()), int(position)) for ids, position in rows]
    done = {} if known is None else {(tuple(known[0].tolist()), int(known[1])): known[2]}
    todo = sorted((key for key in dict.fromkeys(keys) if key not in done), key=lambda key: len(key[0]))
    for start, stop in _batches([len(tokens) for tokens, _ in todo], max_rows, max_tokens):
        part = todo[start:stop]
        ids = torch.full((len(part), len(part[-1][0])), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (tokens, _) in enumerate(part):
            ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[row, : len(tokens)] = 1
        done.update(zip(part, predict(ids, mask, torch.tensor([position for _, position in part]))))
    return torch.stack([done[key] for key in keys])


# -- one example -----------------------------------------------------------------------------------------


class _Setup:
    """What score_example needs to know about a model: head kind, perturbation mode, how to read outputs."""

    def __init__(self, model: nn.Module, tokenizer: Any, perturbation: str) -> None:
        self.inner = unwrap(model)  # resolved for its kind and blocks only: each timed attach resolves as a user's
        spec, self.kind = resolve(self.inner)
        self.pooling = spec.pooling
        self.model = model
        self.tokenizer = tokenizer
        self.n_blocks = len(blocks(self.inner, spec))
        self.mask_id = getattr(tokenizer, "mask_token_id", None)
        # Encoders that read CLS were trained with [MASK]; decoders see deletion (SPEC 5).
        self.reads_first = spec.pooling == "first" and self.kind.pooled
        encoder = self.kind is HeadKind.MASKED_LM or self.reads_first
        self.mode = ("mask" if encoder else "delete") if perturbation == "auto" else perturbation
        if self.mode not in ("mask", "delete"):
            raise ValueError(f"perturbation={perturbation!r}: use 'auto', 'mask' or 'delete'")
        if self.mode == "mask" and self.mask_id is None:
            raise ValueError("mask perturbation needs a tokenizer with a mask token; pass perturbation='delete'")
        self.device = input_device(model)
        self.max_rows = 1 if one_row_only(model, self.kind) else 64
        # Decoder classifiers pool the last token that is not config.pad_token_id: pad with exactly that id.
        pad_id = pad_token_id(model)
        pad_id = getattr(tokenizer, "pad_token_id", None) if pad_id is None else pad_id
        self.pad_id = 0 if pad_id is None else int(pad_id)
        self.keeps_logits = keeps_logits(model, self.kind)
        # SPEC 5: perturbation never touches CLS/SEP/BOS (nor the prediction position).
        self.special_ids = list(getattr(tokenizer, "all_special_ids", []))
        # targets of several tokens (the first explained), label names that are other ids too, methods not computed
        self.notes: list[str] = []

    def predict(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Model outputs at each row's prediction position: (rows, outputs), at least float32 (a float64 model's as
        they are: two of its logits rounded to float32 may tie, and the argmax miss its prediction). ``mask``: 0 on
        padding."""
        extra: dict[str, Any] = {}
        columns = positions
        if self.keeps_logits:
            keep = positions.unique()  # sorted: row r's output is at searchsorted(keep, positions[r])
            extra["logits_to_keep"] = keep.to(self.device)
            columns = torch.searchsorted(keep, positions)
        with torch.no_grad():
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **extra).logits
        if self.kind.vocabulary:
            logits = logits[torch.arange(len(ids)), columns.to(logits.device)]
        return logits.to(wide(logits.dtype)).cpu()

    def position(self, ids: torch.Tensor) -> int:
        """Where an unpadded example's prediction is read (the rule attach uses): a decoder classifier reads its
        last token that is not config.pad_token_id, as transformers pools, even when the text ends with that id."""
        _, positions = prediction_rows(self.kind, self.pooling, ids[None], torch.ones(1, len(ids), dtype=torch.long),
                                       shape=(1, len(ids)), pad_id=pad_token_id(self.model), mask_id=self.mask_id)
        if len(positions) != 1:
            raise ValueError(f"a masked-LM example needs exactly one {self.tokenizer.mask_token!r}; "
                             f"found {len(positions)}")
        return int(positions[0])

    def label_id(self, value: Any, n_outputs: int, prompt: str) -> int | float | None:
        """A target, foil or gold label as an output id: words are read after the example's text (``prompt``); a
        word of several tokens stands for its first, and :attr:`notes` says so (and which reading of a label name
        that is also another output's id was taken)."""
        if value is None:
            return None
        if self.kind is HeadKind.REGRESSION:
            # float() reads a label "nan" as NaN, and one NaN gold value voids the run's Pearson; a word ("abc") or a
            # list would fail in float()'s words, which say nothing of the label, and a JSON true would read as 1.0
            number = math.nan if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)) else value
            try:
                number = float(number)
            except ValueError:
                number = math.nan
            if not math.isfinite(number):
                raise ValueError(f"regression label {value!r} is not a finite number: give a number")
            return number
        resolved = resolve_target(self.inner, self.kind, self.tokenizer, value, n_outputs, prompt=prompt)
        note = describe_target(self.tokenizer, self.inner.config, self.kind, resolved)["note"]
        if note:
            self.notes.append(note)
        return resolved.id


def _finite(setup: _Setup, outputs: torch.Tensor, of: str) -> torch.Tensor:
    """``outputs`` (rows, outputs) of :meth:`_Setup.predict`; ValueError where one is NaN or +inf (or a regression's
    -inf; a classifier's rules that output out): every probability would be NaN, the example recorded as predicting
    output 0 and the run's AOPC NaN."""
    if outputs.isnan().any() or outputs.isposinf().any() or (setup.kind is HeadKind.REGRESSION
                                                               and outputs.isneginf().any()):
        raise ValueError(f"the model's {OVERFLOWED}{of}: {WIDER}")
    return outputs


def _seed(seed: int, text: str) -> int:
    # Stable across processes and shards (unlike hash()), so a sharded run draws the same random ranking.
    return (seed * 1_000_003 + zlib.crc32(text.encode("utf-8"))) % (2**63)


def _method_scores(setup: _Setup, methods: Sequence[str], ids: torch.Tensor, position: int, t: _Targets,
                   seed: int, text: str, ig_steps: int,
                   aggregation: str) -> tuple[dict[str, torch.Tensor], dict[str, float | None]]:
    """name -> scores, (layers, seq) for layered methods and (seq,) otherwise; name -> seconds."""
    scores: dict[str, torch.Tensor] = {}
    seconds: dict[str, float | None] = {}
    regression = setup.kind is HeadKind.REGRESSION
    batch = ids[None].to(setup.device)
    mask = torch.ones_like(batch)
    registered = set(method_names())
    for name in (m for m in methods if m == "embed_norm" or m in registered):
        method = None if name == "embed_norm" else _foiled(get_method(name), t.foil)
        # Each timed on its own attached forward, as a user computing only it would run it (embed_norm: one layer):
        # one shared forward would give every method one number.
        start = time.perf_counter()
        with torch.no_grad(), attach(setup.model, layers=[0] if name == "embed_norm" else "all",
                                     target="predicted" if regression else [t.target], tokenizer=setup.tokenizer,
                                     methods=[] if method is None else [method]) as probe:
            setup.model(input_ids=batch, attention_mask=mask)
        res = probe.result()
        seconds[name] = time.perf_counter() - start
        # every attached forward has the embedding norms: the record's norm_spread reads them, asked for or not
        scores.setdefault("embed_norm", res.embed_norm[0])
        if name != "embed_norm":
            scores[name] = res.scores[name][:, 0] if regression else res.scores[name][:, 0, :, 0]
    if "random" in methods:
        generator = torch.Generator().manual_seed(_seed(seed, text))
        scores["random"] = torch.rand(len(ids), generator=generator)
        seconds["random"] = 0.0
    wanted = [name for name in methods if name in GRADIENT_METHODS]
    if wanted:
        found = gradient_scores_many(setup.model, batch, mask, position=position, target=t.target, methods=wanted,
                                     ig_steps=ig_steps, kind=setup.kind, aggregation=aggregation)
        for name, (values, elapsed) in found.items():
            scores[name], seconds[name] = values.cpu(), elapsed
    return scores, seconds


@dataclass
class _Targets:
    """What one example explains and how its outputs are judged."""

    target: int  #: the explained output (0 for regression)
    foil: int | None  #: the contrast of "contrastive": the example's foil, else the runner-up
    pair: int | None  #: the example's own foil: probability and accuracy over (target, pair), BLiMP-style
    label: int | float | None  #: the gold label id / value
    prediction: int | float  #: the model's own argmax (or regression output) on the unperturbed text


def _targets(setup: _Setup, example: Mapping[str, Any], original: torch.Tensor) -> _Targets:
    n, text = original.shape[-1], example["text"]
    if setup.kind is HeadKind.REGRESSION:
        # its one output is what is explained: a target or foil the data names is left unused, and said so
        unused = [key for key in ("target", "foil") if example.get(key) not in (None, "predicted")]
        setup.notes += [f"{' and '.join(unused)} not used: a regression head explains its one output"] if unused else []
        return _Targets(0, None, None, setup.label_id(example.get("label"), n, text), float(original[0]))
    prediction = int(original.argmax())
    requested = example.get("target")
    target = prediction if requested in (None, "predicted") else setup.label_id(requested, n, text)
    pair = setup.label_id(example.get("foil"), n, text)
    if pair is not None and pair == target:  # p over (target, target) is 0.5 whatever is perturbed: every value 0
        if requested in (None, "predicted") or requested == example["foil"] or isinstance(example["foil"], int):
            raise ValueError(f"the foil {example['foil']!r} is the target itself (output {target}): give a foil "
                             "other than the target, or none")
        raise ValueError(f"the foil {example['foil']!r} and the target {requested!r} are one output ({target}: a word "
                         "of several tokens stands for its first): give a foil whose first token differs, or none")
    runner_up = int(original.topk(2).indices[1]) if prediction == target else prediction
    return _Targets(target, runner_up if pair is None else pair, pair, setup.label_id(example.get("label"), n, text),
                    prediction)


def _outcome(setup: _Setup, outputs: torch.Tensor, t: _Targets) -> tuple[torch.Tensor, list | None, list]:
    """Per row: the explained quantity (p[target], or the regression output), still correct?, prediction.

    With a pair, p is the softmax over (target, foil), so that an LM's uncertainty about what kind of word
    comes next does not drown the decision the pair tests; correct means label scores above foil.
    """
    if setup.kind is HeadKind.REGRESSION:
        return outputs[:, 0], None, outputs[:, 0].tolist()
    if t.pair is not None:
        explained = outputs[:, [t.target, t.pair]].softmax(-1)[:, 0]
    else:
        explained = log_probabilities(setup.inner, outputs)[:, t.target].exp()
    if t.label is None:
        correct = None
    elif t.pair is not None:
        correct = (outputs[:, t.label] > outputs[:, t.pair]).tolist()
    else:
        correct = (outputs.argmax(-1) == t.label).tolist()
    return explained, correct, outputs.argmax(-1).tolist()


def _evidence(example: Mapping[str, Any], encoding: Mapping,
              ranked: torch.Tensor) -> tuple[torch.Tensor | None, list[str]]:
    """The 0/1 evidence vector on the ``ranked`` tokens (None when the example names none, or none matched) and
    the words that matched none of them: a word found only on tokens that never rank (the prediction, special
    tokens, a chat template's) has no place in a ranking to be found at."""
    if not example.get("evidence"):
        return None, []
    if "offset_mapping" not in encoding:
        raise ValueError("evidence alignment needs a fast tokenizer (offset mapping); load it with use_fast=True")
    found = [(word, evidence_mask(example["text"], encoding["offset_mapping"], [word])[0] * ranked)
             for word in example["evidence"]]
    evidence = torch.stack([mask for _, mask in found]).amax(0)
    return (evidence if evidence.any() else None), [word for word, mask in found if not mask.any()]


def score_example(
    model: nn.Module,
    tokenizer: Any,
    example: Mapping[str, Any],
    methods: Sequence[str] = DEFAULT_METHODS,
    *,
    layer: int = -1,
    ks: Sequence[float] = DEFAULT_KS,
    seed: int = 0,
    perturbation: str = "auto",
    ig_steps: int = 50,
    aggregation: str = "l1",
    keep_scores: bool = False,
    custom: Mapping[str, Sequence[float]] | None = None,
) -> dict[str, Any]:
    """Faithfulness record of one example, JSON-able. ``ev.score_example(model, tok, {"text": "...", "label": 1})``

    - ``layer``: the layer whose scores rank tokens for AOPC (layered methods; default the last).
      Alignment (``ap``, ``dot``) is reported at every layer 0..L for layered methods.
    - ``ks``: the fractions of the tokens perturbed, each from 0 to 1 (``int(n * K)`` tokens).
    - ``perturbation``: "auto" (mask token for encoders that read CLS and masked LMs, deletion for
      decoders), "mask" or "delete".
    - Comprehensiveness per K: ``p_orig[y] - p_new[y]`` with K's top tokens perturbed; sufficiency: the
      same with all but the top tokens perturbed. Regression: ``|out_orig - out_new|``. When the example
      names a ``foil``, p is the softmax over the pair (target, foil) (BLiMP-style minimal pairs).
    - ``aggregation``: how the gradient baselines reduce a token's (d,) attribution: "l1" (the paper), "l2", "sum".
    - ``contrastive`` contrasts with ``example["foil"]``, else the runner-up output; a regression head has no foil,
      so there it is left out and ``notes`` says so (a ValueError when no method is left).
    - ``keep_scores``: also store each method's per-token scores at ``layer`` (for reports).
    - ``custom``: your own methods, name -> one score per token of ``tokenizer(text)`` (special tokens
      included), measured exactly like the built-in ones (``seconds`` is then None).
    - An example with no token to perturb (all but the prediction are special tokens or a chat template's: a
      one-word text after ``<s>``) is a ValueError, one line: special tokens are never perturbed.

    Keys: schema, id, text, tokens (pieces), readable (each token's text, '␣Paris'), target_text,
    target_probability / foil_text, foil_probability (the model's own probabilities: its softmax over all
    outputs, a multi-label classifier's sigmoid), notes (a target word of several tokens, a method not computed),
    norm_spread and flat_norms (embedding norms nearly equal on the ranked tokens: NormXLogit ranks as LogAt), kind,
    perturbation, position, target, target_token, foil, label, prediction, output (the explained p, or the
    regression output), probability ("all" outputs, "pair", or "output" for regression), correct (None without a
    label), evidence (0/1 per token, 1 on ranked ones only; or None), evidence_missing (words that matched no ranked
    token: none, or only special / template tokens), layers, eval_layer, ks, counts (tokens per K), methods.
    """
    known = available_methods()
    unknown = [m for m in methods if m not in known]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {known}")
    if not isinstance(example.get("text"), str) or not example["text"].strip():
        raise ValueError(f"example needs a non-empty 'text' string, got keys {sorted(example)}")
    if not ks or not all(isinstance(k, numbers.Real) and 0 <= k <= 1 for k in ks):  # (NaN is no fraction either)
        raise ValueError(f"ks={list(ks)!r}: give one or more fractions of the tokens to perturb, each from 0 to 1 "
                         "(0.1 for 10%)")
    # (1.5 failed in torch's manual_seed after the other methods had run)
    number = integer(seed)  # (a numpy integer overflowed in the random baseline's seed arithmetic)
    if number is None:
        raise ValueError(f"seed={seed!r}: give a whole number")
    seed = number
    if "integrated_gradients" in methods:  # before any method runs, as the seed
        ig_steps = check_ig_steps(ig_steps)
    setup = _Setup(model, tokenizer, perturbation)
    # Never cut to fit (evidence past the cut would vanish): a text longer than the model reads is refused.
    check_length(tokenizer, example["text"], position_limit(setup.inner))
    encoding = tokenizer(example["text"], return_offsets_mapping=bool(example.get("evidence")))
    ids = torch.tensor(encoding["input_ids"], dtype=torch.long)
    n = len(ids)
    if n < 2:
        raise ValueError(f"example {example['text']!r} has {n} token(s): perturbation needs at least 2")
    position = setup.position(ids)
    original = _finite(setup, setup.predict(ids[None], torch.ones(1, n, dtype=torch.long), torch.tensor([position])),
                       "")
    t = _targets(setup, example, original[0])
    layered = set(method_names())
    # a regression head's one output has no foil to contrast the target with
    dropped = foil_methods(methods) if setup.kind is HeadKind.REGRESSION else []
    methods = [m for m in methods if m not in dropped]
    setup.notes += [f"{name} not computed: a regression head has one output, no foil to contrast with"
                    for name in dropped]
    if not methods and not custom:  # (the targets are checked first: a bad one is the error to read)
        why = f"{', '.join(dropped)} contrasts with a foil, which a regression head lacks" if dropped else "none named"
        raise ValueError(f"no method to score ({why}): choose from {', '.join(known)}, or give custom scores")
    # A chat-templated text (nxl evaluate --chat): its template's tokens neither rank nor count towards K.
    template = locate_template(tokenizer, ids.tolist())
    ranked = _candidates(ids, position, setup.special_ids, template)
    if not ranked.any():
        raise ValueError(f"example {example['text']!r} has no token to perturb: all but the prediction are special "
                         "tokens (or a chat template's)")
    evidence, missing = _evidence(example, encoding, ranked)
    if missing:  # (a typo, or a word on special tokens only): the example leaves AP and dot, or counts fewer words
        left = "AP and dot are over the words found" if evidence is not None else "it counts for AOPC, not AP and dot"
        setup.notes.append(f"evidence word(s) on no token that ranks (not in the text, or only on special or chat "
                           f"template tokens; evidence_missing names them): {left}")
    scores, seconds = _method_scores(setup, methods, ids, position, t, seed, example["text"], ig_steps, aggregation)
    for name, values in (custom or {}).items():
        if name in known or len(values) != n:
            raise ValueError(f"custom method {name!r}: give a new name and one score per token ({n} tokens here)")
        scores[name], seconds[name] = torch.as_tensor(values, dtype=torch.float32), None
        methods.append(name)
    eval_layer = layer_index(layer, setup.n_blocks)
    ranking = {name: scores[name][eval_layer] if name in layered else scores[name] for name in methods}

    length = n if template is None else n - int(template.sum())
    counts = [int(length * k_as_written(k)) for k in ks]
    rows = [
        perturb(ids, position, ranking[name], count, keep_top=keep_top, mode=setup.mode, mask_id=setup.mask_id,
                protected_ids=setup.special_ids, template=template)
        for name in methods
        for keep_top in (False, True)
        for count in counts
    ]
    p_orig, correct_orig, _ = _outcome(setup, original, t)
    outputs = _finite(setup, run_padded(setup.predict, rows, pad_id=setup.pad_id, max_rows=setup.max_rows,
                                        known=(ids, position, original[0])), " on a perturbed text")
    p_new, correct, predicted = _outcome(setup, outputs, t)
    change = p_orig - p_new
    change = change.abs() if setup.kind is HeadKind.REGRESSION else change

    records: dict[str, Any] = {}
    for index, name in enumerate(methods):
        comp = slice(2 * index * len(counts), (2 * index + 1) * len(counts))
        suff = slice(comp.stop, comp.stop + len(counts))
        by_layer = scores[name] if name in layered else scores[name][None]
        records[name] = {
            "comprehensiveness": change[comp].tolist(),
            "sufficiency": change[suff].tolist(),
            "comp_correct": None if correct is None else correct[comp],
            "suff_correct": None if correct is None else correct[suff],
            "comp_pred": predicted[comp],
            "suff_pred": predicted[suff],
            "layered": name in layered,
            "ap": None if evidence is None else [average_precision(s[ranked], evidence[ranked]) for s in by_layer],
            "dot": None if evidence is None else [normalized_dot(s[ranked], evidence[ranked]) for s in by_layer],
            "seconds": seconds[name],
        }
        if keep_scores:
            records[name]["scores"] = ranking[name].tolist()
    regression = setup.kind is HeadKind.REGRESSION
    spread = norm_spread(scores["embed_norm"], ranked) if "embed_norm" in scores else None
    id2label = getattr(setup.inner.config, "id2label", None)
    probabilities = log_probabilities(setup.inner, original[0].float()).exp()
    foil = t.foil if foil_methods(methods) else t.pair
    return {
        "schema": SCHEMA,
        "id": example.get("id"),
        "text": example["text"],
        "tokens": tokenizer.convert_ids_to_tokens(ids.tolist()),
        "readable": readable_ids(tokenizer, ids.tolist()),
        "target_text": None if regression else label_text(tokenizer, id2label, setup.kind, t.target),
        "target_probability": None if regression else float(probabilities[t.target]),
        "foil_text": None if foil is None else label_text(tokenizer, id2label, setup.kind, foil),
        "foil_probability": None if foil is None else float(probabilities[foil]),
        "notes": list(dict.fromkeys(setup.notes)),
        "norm_spread": spread,
        "flat_norms": spread is not None and flat_norms(spread),
        "kind": setup.kind,
        "perturbation": setup.mode,
        "position": position,
        "target": t.target,
        "target_token": tokenizer.convert_ids_to_tokens(t.target) if setup.kind.vocabulary else None,
        "foil": foil,
        "label": t.label,
        "prediction": t.prediction,
        "output": float(p_orig[0]),
        "probability": "output" if regression else ("pair" if t.pair is not None else "all"),
        "correct": None if correct_orig is None else correct_orig[0],
        "evidence": None if evidence is None else evidence.tolist(),
        "evidence_missing": missing,
        "layers": resolve_layers("all", setup.n_blocks),
        "eval_layer": eval_layer,
        "ks": list(ks),
        "counts": counts,
        "methods": records,
    }


# -- many examples ---------------------------------------------------------------------------------------


def _columns(records: Sequence[Mapping], name: str, key: str) -> list[list]:
    """Per K (or per layer), the values of every record that has them."""
    rows = [r["methods"][name][key] for r in records if name in r["methods"] and r["methods"][name][key] is not None]
    return [list(column) for column in zip(*rows)] if rows else []


def _method_summary(records: Sequence[Mapping], name: str, eval_layer: int, regression: bool) -> dict[str, Any]:
    mine = [r for r in records if name in r["methods"]]
    comp, suff = _columns(mine, name, "comprehensiveness"), _columns(mine, name, "sufficiency")
    ap, dot = _columns(mine, name, "ap"), _columns(mine, name, "dot")
    layered = mine[0]["methods"][name]["layered"]
    entry: dict[str, Any] = {
        "n": len(mine),
        "aopc_comprehensiveness": mean([mean(c) for c in comp]),
        "aopc_sufficiency": mean([mean(c) for c in suff]),
        "comprehensiveness_curve": [mean(c) for c in comp],
        "sufficiency_curve": [mean(c) for c in suff],
        "layered": layered,
        "ap": [mean(c) for c in ap] or None,
        "dot": [mean(c) for c in dot] or None,
        "n_evidence": len(ap[0]) if ap else 0,
        "seconds": mean([r["methods"][name]["seconds"] for r in mine]),
    }
    pick = eval_layer if layered else 0
    entry["ap_eval"] = entry["ap"][pick] if entry["ap"] else None
    entry["dot_eval"] = entry["dot"][pick] if entry["dot"] else None
    labelled = [r for r in mine if r["label"] is not None]
    for part, long in (("comp", "comprehensiveness"), ("suff", "sufficiency")):
        if regression:
            gold = [r["label"] for r in labelled]
            entry[f"pearson_{long}"] = [pearson(list(c), gold) for c in _columns(labelled, name, f"{part}_pred")] or None
        else:
            entry[f"accuracy_{long}"] = [mean([float(v) for v in c]) for c in _columns(labelled, name, f"{part}_correct")] or None
    return entry


def aggregate(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Means over records (and over K for AOPC), in one JSON-able dict. ``ev.aggregate(records)``

    Per method: ``aopc_comprehensiveness`` / ``aopc_sufficiency`` (mean over examples and K), their
    per-K ``*_curve``, ``accuracy_*`` per K (classification / LM; against the gold label, or target >
    foil for LM minimal pairs) or ``pearson_*`` per K with the gold values (regression), ``ap`` and
    ``dot`` per layer (layered methods, aligned with ``layers``) or a one-element list, ``ap_eval`` /
    ``dot_eval`` at the AOPC layer, and mean ``seconds`` per example. Records without a label count
    for AOPC and alignment, not for accuracy / Pearson.
    """
    if not records:
        raise ValueError("aggregate needs at least one record")
    first = records[0]
    for record in records:
        if record.get("schema") != SCHEMA:
            raise ValueError(f"not an nxl_hooks evaluation record (schema {record.get('schema')!r}, expected {SCHEMA!r})")
        if record["ks"] != first["ks"] or record["eval_layer"] != first["eval_layer"] or record["kind"] != first["kind"]:
            raise ValueError("records differ in ks, eval_layer or head kind: aggregate runs of one setting at a time")
    regression = first["kind"] == "regression"
    labelled = [r for r in records if r["label"] is not None]
    names = list(dict.fromkeys(name for r in records for name in r["methods"]))
    return {
        "schema": SCHEMA,
        "n": len(records),
        "kind": first["kind"],
        "perturbation": first["perturbation"],
        "ks": first["ks"],
        "layers": first["layers"],
        "eval_layer": first["eval_layer"],
        "accuracy": None if regression else mean([float(r["correct"]) for r in labelled]),
        "pearson": pearson([r["prediction"] for r in labelled], [r["label"] for r in labelled]) if regression else None,
        "normalization": "min-shift L1 over the ranked tokens (prediction position and special tokens removed), for every method",
        "flat_norms": sum(1 for r in records if r.get("flat_norms")),  # examples where NormXLogit ranks as LogAt
        "methods": {name: _method_summary(records, name, first["eval_layer"], regression) for name in names},
    }
