"""One forward's capture, and the attribution assembled from it when the forward returns.

The probe's hooks fill a :class:`Capture` as the model runs (inputs, the embedding norm, a reference to each
selected layer's hidden states: no copy, no computation in the hooks) and :func:`assemble` turns it into an
:class:`~nxl_hooks.Attribution`, one layer at a time. Everything here belongs to
one call, in the thread that made it; the :class:`~nxl_hooks.hooks.plan.Plan` is shared and read-only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..method.placement import readable, weights_materialized
from ..method.protocol import Given
from ..arch.registry import HeadKind, log_probabilities, word_embedding
from ..method.scores import regression_logat, row_norms, wide
from ..method.select import VIRTUAL_ID
from ..records.attribution import Attribution
from ..records.tokens import target_texts
from .conventions import token_mask
from .plan import Plan

__all__ = ["NEEDS_IDS", "Capture", "assemble", "check_tokens", "embed_norms", "embedding_norms", "head_features",
           "layer_states", "open_capture", "pin_last_layer", "real_tokens"]


@dataclass(eq=False)
class Capture:
    """What one backbone forward has captured so far."""

    input_ids: torch.Tensor | None
    attention_mask: torch.Tensor | None
    shape: tuple[int, int]  #: (batch, seq) of the input
    #: PEFT prompt tuning's virtual tokens before the ids (:func:`open_capture`): the model itself saw no ids
    virtual: int = 0
    embed_norm: torch.Tensor | None = None  #: (batch, seq) float32
    #: the task model's class where it was given input_ids and built the backbone's inputs_embeds itself (Fuyu merges
    #: image patches into them), out of the probe's sight: what ``embedding="word"`` cannot read (:func:`embed_norms`)
    built_embeds: str | None = None
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  #: layer -> its hidden states, as the model made them
    last_hidden: torch.Tensor | None = None  #: the last block's output, for final logits the model did not give
    #: the very tensor kept as the last block's output: what the next block must be called on, or a hook of the
    #: user's changed it after the probe's hook read it (:meth:`~.recorder.Recorder._changed`)
    handed: torch.Tensor | None = None


def _not_run(plan: Plan, layer: int) -> ValueError:
    """Layer ``layer`` of a forward has no hidden states: the block that makes it (block 1's input, for layer 0) did
    not run, as when a config runs fewer blocks than the model holds (Llama runs ``layers[:num_hidden_layers]``)."""
    index = max(layer, 1) - 1
    # h[l] (not h[0], block 1's input) read from what layer_outputs names
    moved = layer > 0 and plan.subject.layer_modules[index] is not plan.blocks[index]
    block = plan.spec.layer_outputs[index + 1] if moved else f"{plan.spec.blocks}.{index}"
    return ValueError(f"block {block} did not run in this forward, so layer {layer} has no hidden states (does "
                      f"{type(plan.model).__name__}'s config run fewer than the {plan.n_blocks} blocks of "
                      f"{plan.spec.blocks!r}?): pass layers= only layers of the blocks that run, or make the config "
                      "run every block")


def layer_states(plan: Plan, capture: Capture) -> list[torch.Tensor]:
    """Each selected layer's hidden states of a forward, in ``plan.layers``' order; ValueError naming the block that
    did not run when one is missing."""
    try:
        return [capture.hidden[layer] for layer in plan.layers]
    except KeyError as missing:
        raise _not_run(plan, missing.args[0]) from None


def embedding_norms(plan: Plan, rows: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """The paper's ‖x_i⁰‖₂ of each token, (batch, seq) float32, from the rows the probe's embedding hook saw: block
    1's input (``embedding="layer_input"``) or the word embedding's output, unscaled (Gemma-style embeddings multiply
    inside the module; the norm is of the raw row). ``ids``: the token ids of ``rows`` where the output is the
    embedding's own rows, scaled (no wrapper adds to them): a scaled embedding's norms are then its weight rows'."""
    # the word embedding found inside a PEFT wrapper too
    embedding = word_embedding(plan.model) if plan.embedding == "word" else None
    scale = getattr(embedding, "embed_scale", None)
    if scale is None:  # (a hook's rows are outside autograd already, but for a forward that trains)
        return row_norms(rows.detach() if rows.requires_grad else rows).float()
    # (not a weight sharded or quantized: its rows are not plain here; one offloaded to meta is loaded for the read,
    # as the model's own call of it just did, and put back)
    if ids is not None and type(embedding.weight.data) is torch.Tensor and readable(embedding):
        with weights_materialized(embedding):
            weight = embedding.weight.detach()
            if weight.device == rows.device:
                # the raw rows: the 16-bit output, scaled then rounded, is up to 1e-3 off them once divided back
                return row_norms(weight[ids]).float()
    norms = row_norms(rows.detach())  # a buffer (Gemma) or a float (XGLM, BioGPT, BART), > 0: ‖x / s‖ = ‖x‖ / s
    return (norms / torch.as_tensor(scale, dtype=norms.dtype, device=norms.device)).float()


#: Positions whose layers the head takes at once (:func:`head_features`): bounds the float32 temporaries of its
#: final norm (256 positions of 33 layers of 4096: about 140 MB) over a long prompt, a compiled call's positions run
#: again or a step's every packed token.
HEAD_CHUNK = 256


def head_features(plan: Plan, hidden: Sequence[torch.Tensor], first: int, end: int) -> torch.Tensor:
    """Head features (batch, end - first, layers, d') of positions first..end-1 of each selected layer's hidden
    states (``hidden``: one (batch, positions, d) tensor per layer, as the model made them): every layer in one head
    call per :data:`HEAD_CHUNK` positions."""
    with torch.no_grad():
        if end - first <= HEAD_CHUNK:  # one head call, its output as it is
            return plan.head.features(torch.stack([h[:, first:end] for h in hidden], dim=2))
        features = None
        for low in range(first, end, HEAD_CHUNK):
            high = min(end, low + HEAD_CHUNK)
            part = plan.head.features(torch.stack([h[:, low:high] for h in hidden], dim=2))
            if features is None:
                features = part.new_empty((part.shape[0], end - first, *part.shape[2:]))
            features[:, low - first: high - first] = part
        return features


def check_tokens(reference: torch.Tensor | None) -> None:
    """ValueError unless ``reference`` (a forward's input ids or embeddings) holds at least one token per row."""
    if reference is None or reference.dim() < 2 or reference.shape[0] == 0 or reference.shape[1] == 0:
        raise ValueError("empty input: nxl_hooks needs at least one token per row (got a zero-length batch)")


def open_capture(bound: dict[str, Any], prompted: tuple[torch.Tensor, int, torch.Tensor | None] | None = None
                 ) -> Capture:
    """A capture for a backbone forward called with ``bound`` arguments; ValueError on an empty input. A 2-D mask
    wider than the tokens (it covers what a KV cache holds before them too: PEFT prefix tuning's virtual tokens) is
    cut to the tokens' own columns. ``prompted``: (the ids a PEFT prompt-tuning model was called with, its number of
    virtual tokens, the word-embedding norms of those ids or None): where the backbone got its inputs_embeds only,
    those ids being v positions shorter, its ids are the virtual tokens' (:data:`VIRTUAL_ID`) then those, and its
    word-embedding norms (``embedding="word"``) the virtual tokens' own embeddings' (what the backbone got) then
    those."""
    input_ids = bound.get("input_ids")
    reference = input_ids if input_ids is not None else bound.get("inputs_embeds")
    check_tokens(reference)
    rows, seq = int(reference.shape[0]), int(reference.shape[1])
    mask = bound.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] > seq:
        mask = mask[:, -seq:]  # (as conventions.token_mask reads a decoding step's)
    if input_ids is None and prompted is not None:
        ids, virtual, words = prompted
        if isinstance(ids, torch.Tensor) and ids.dim() == 2 and tuple(ids.shape) == (rows, seq - virtual):
            ids = torch.cat([ids.new_full((rows, virtual), VIRTUAL_ID), ids], dim=1)
            embed = None if words is None else torch.cat(
                [row_norms(reference[:, :virtual].detach()).float(), words.to(reference.device)], dim=1)
            return Capture(input_ids=ids, attention_mask=mask, shape=(rows, seq), virtual=virtual, embed_norm=embed)
    return Capture(input_ids=input_ids, attention_mask=mask, shape=(rows, seq))


def _model_logits(plan: Plan, output: Any, examples: torch.Tensor, positions: torch.Tensor, seq: int,
                  keep: Any = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The task model's own logits at the explained rows (rows, outputs), at least float32 (a float64 model's as they
    are: two of them rounded to float32 may tie, and the argmax miss its prediction), and which rows they cover
    ((rows,) bool, CPU): a forward never pays twice for its final logits.
    A causal LM called with an int ``logits_to_keep`` returns its last positions' only: the rows predicting there
    are its own (its 16-bit readout on that slice may round the bias apart from the product, so a logit recomputed
    here can miss its by a step, and flip a near tie). Rows not covered (a tuple output, a row whose prediction
    position it did not keep) are computed from the last layer's features. A ``logits_to_keep`` of indices keeps the
    positions it names, in its order (its row j is position ``keep[j]``'s, not position j's, even where it names
    them all)."""
    covered = torch.zeros(len(examples), dtype=torch.bool)
    logits = getattr(output, "logits", None)
    if not isinstance(logits, torch.Tensor) or logits.shape[-1] != plan.head.n_outputs:
        return None, covered
    if plan.kind.pooled:
        if logits.dim() != 2:
            return None, covered
        return logits[examples.to(logits.device)].to(wide(logits.dtype)), ~covered
    kept = logits.shape[1] if logits.dim() == 3 else 0
    if isinstance(keep, torch.Tensor):  # (a plain forward's end: this host read is once per call)
        kept_at = keep.cpu().nonzero()[:, 0] if keep.dtype == torch.bool else keep.cpu()  # (a mask selects)
        if keep.dim() != 1 or len(kept_at) != kept or kept_at.is_floating_point():
            return None, covered
        row = torch.full((seq,), -1, dtype=torch.long)
        row[kept_at.long() % seq] = torch.arange(kept)  # (a position kept twice has one logit row)
        at = row[positions]
        covered = at >= 0
        return logits[examples.to(logits.device), at.clamp(min=0).to(logits.device)].to(wide(logits.dtype)), covered
    if kept != seq and not (isinstance(keep, int) and 0 < kept < seq):
        return None, covered
    offset = seq - kept  # (0: every position's)
    covered = positions >= offset
    at = (positions - offset).clamp(min=0)
    return logits[examples.to(logits.device), at.to(logits.device)].to(wide(logits.dtype)), covered


def pin_last_layer(layers: Sequence[int], n_blocks: int, logat: torch.Tensor, rows: torch.Tensor | slice,
                   positions: torch.Tensor | int, own: torch.Tensor) -> None:
    """Set LogAt (layers, rows, seq, k) at l = L (when among ``layers``) and each of ``rows``' ``positions`` to
    ``own`` (rows, k): the model's own logits of the explained ids, wherever the model gave them. A recomputation
    misses them where its readout ran on a slice of the forward's positions (``logits_to_keep``: a 16-bit readout
    with a bias rounds its product and its bias apart on a strided 3-D input), where the head is not
    :attr:`~nxl_hooks.method.head.Head.per_position` (a called 8-bit head gives a row another result beside other
    positions), and by float32 roundings where a forward's final RMS norm is folded into the gathered rows (its
    products reassociated); at l = L the prediction position's LogAt is the model's logit by definition."""
    if n_blocks in layers:
        rows = rows.to(logat.device) if isinstance(rows, torch.Tensor) else rows
        positions = positions.to(logat.device) if isinstance(positions, torch.Tensor) else positions
        logat[layers.index(n_blocks), rows, positions] = own.to(logat.device, logat.dtype)


#: Why a forward given ``inputs_embeds`` cannot be recorded with ``embedding="word"``.
NEEDS_IDS = ("embedding='word' needs input_ids: the word-embedding module did not run (inputs_embeds given); use "
             "embedding='layer_input'")


def embed_norms(capture: Capture) -> torch.Tensor:
    """A forward's embedding norms (batch, seq); ValueError (:data:`NEEDS_IDS`) where its word-embedding module did
    not run, or one naming the model where it built its inputs_embeds itself (:attr:`Capture.built_embeds`)."""
    if capture.embed_norm is None and capture.built_embeds is not None:
        raise ValueError(
            f"embedding='word' reads the word-embedding rows of the input_ids the backbone is given, but "
            f"{capture.built_embeds} builds the embeddings its backbone reads itself (inputs_embeds), before the "
            "backbone runs; use embedding='layer_input' (the default: the input of block 1, which it reads)")
    if capture.embed_norm is None:
        raise ValueError(NEEDS_IDS)
    return capture.embed_norm


def real_tokens(capture: Capture) -> torch.Tensor | None:
    """Which of a plain forward's tokens are real, not padding: (batch, seq) bool, read from its attention mask by
    :func:`~.conventions.token_mask`, 2-D, 4-D (a custom mask) or a dict of them by layer type; None without a
    mask, or with one of another shape, which says nothing of padding."""
    mask = capture.attention_mask
    if isinstance(mask, dict) or (isinstance(mask, torch.Tensor) and mask.dim() in (2, 4)):
        # (a 4-D mask's keys start at the forward's own tokens: a plain forward continues no cache but prefix
        # tuning's, whose mask comes 2-D; one mask of batch 1 is every row's, as attention broadcasts it)
        return token_mask(mask, 0, capture.shape[1]).expand(capture.shape[0], -1)
    return None


def assemble(plan: Plan, capture: Capture, output: Any = None, keep: Any = None) -> Attribution:
    """The :class:`~nxl_hooks.Attribution` of a finished forward; ``output``: the task model's output, if seen, and
    ``keep`` the ``logits_to_keep`` it was called with."""
    embed = embed_norms(capture)
    seq, hidden, real = capture.shape[1], layer_states(plan, capture), real_tokens(capture)
    # (rows read as the model read them: given no ids, a classifier pools its last position, not its last non-pad)
    examples, positions = plan.rows(None if capture.virtual else capture.input_ids, real, capture.shape)
    with plan.head.reading() as readout:
        final, covered = _model_logits(plan, output, examples, positions, seq, keep)
        if not covered.all():  # HoT of the last layer at the prediction rows the model gave no logits for
            last = capture.last_hidden
            if last is None:
                raise _not_run(plan, plan.n_blocks)
            rest = (~covered).nonzero()[:, 0]
            computed = readout.logits(plan.head.features(last[examples[rest].to(last.device),
                                                              positions[rest].to(last.device)]))
            if final is None:
                final = computed
            else:
                final[rest.to(final.device)] = computed.to(final.device)

        def by_row(values: torch.Tensor) -> torch.Tensor:
            # Masked LMs explain an example once per [MASK]; every other head explains each example once, and
            # indexing would copy every layer's features for nothing.
            return values[examples.to(values.device)] if plan.kind is HeadKind.MASKED_LM else values

        if plan.kind is HeadKind.REGRESSION:
            targets = plan.explained(torch.zeros(len(examples), 1, dtype=torch.long, device=final.device))
            log_probs = None
        else:  # the model's own probabilities at the prediction rows
            targets = plan.explained(final.argmax(-1, keepdim=True))
            log_probs = log_probabilities(plan.model, final).float()

        kept = covered.nonzero()[:, 0]

        def head_logits(ids: torch.Tensor) -> torch.Tensor:  # (layers, rows, seq, k)
            logits = torch.stack([readout.explain(by_row(states), ids).to(final.device) for states in hidden])
            if len(kept):  # the model's own logits where it gave them (a contrastive foil's too)
                pin_last_layer(plan.layers, plan.n_blocks, logits, kept, positions[kept],
                               final[kept.to(final.device)].gather(-1, ids[kept.to(ids.device)].to(final.device)))
            return logits

        logat = head_logits(targets)
        if plan.kind is HeadKind.REGRESSION:
            logat = regression_logat(logat, final.gather(-1, targets.to(final.device)))
        embed_norm = by_row(embed).to(final.device)
        mask = by_row(real).to(final.device) if real is not None else torch.ones_like(embed_norm, dtype=torch.bool)
        scores, targets = plan.scores(Given(logat, embed_norm, targets, log_probs, head_logits, mask,
                                            regression=plan.kind is HeadKind.REGRESSION))
    probability = None if log_probs is None else log_probs.gather(-1, targets.view(len(examples), -1)).exp()
    ids = by_row(capture.input_ids) if capture.input_ids is not None else None
    return Attribution(
        scores={name: value.cpu() for name, value in scores.items()},
        embed_norm=embed_norm.cpu(),
        layers=list(plan.layers),
        target=targets.cpu(),
        mask=mask.cpu(),
        position=positions,
        example=examples,
        tokens=plan.token_strings(ids),
        meta={**plan.describe(), "prediction": final.cpu().tolist() if plan.kind is HeadKind.REGRESSION else None},
        special=plan.special(ids),
        input_ids=ids.cpu() if ids is not None else None,
        readable=plan.readable_rows(ids),
        probability=None if probability is None else (probability if plan.label_axis else probability[:, 0]).cpu(),
        target_text=target_texts(plan.tokenizer, plan.model.config, plan.kind, targets),
    )
