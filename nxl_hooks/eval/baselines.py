"""Gradient baselines of the paper, through captum, on the word-embedding rows (what the word-embedding module
gives): Gradient Norm, Gradient x Input and Integrated Gradients. Each returns one score per token.

    scores = gradient_scores(model, input_ids, attention_mask, position=0, target=1, method="grad_x_input")

The explained scalar is the target's logit at the prediction position (the same quantity LogAt reads at
the last layer; regression: the model's output). Integrated Gradients uses an all-zero embedding baseline.
A token's (d,) attribution becomes one score by the L1 norm over the hidden dimension, as the paper aggregates
all three; ``aggregation="l2"`` or ``"sum"`` (signed) are the other common choices.
"""

from __future__ import annotations

import inspect
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..arch.registry import HeadKind, head_kind
from ..method.select import pad_token_id, whole_number
from ..method.subject import unwrap

__all__ = [
    "AGGREGATIONS", "GRADIENT_METHODS", "gradient_scores", "gradient_scores_many", "keeps_logits", "one_row_only"
]

GRADIENT_METHODS = ("grad_norm", "grad_x_input", "integrated_gradients")

#: How a token's (d,) attribution becomes one score: the paper's L1 norm (default), the L2 norm, or the signed sum.
AGGREGATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "l1": lambda x: x.float().abs().sum(-1),
    "l2": lambda x: x.float().norm(dim=-1),
    "sum": lambda x: x.float().sum(-1),
}


def one_row_only(model: nn.Module, kind: str) -> bool:
    """Whether the model takes one row per forward: transformers' decoder classifiers find the pooled token
    through pad_token_id and refuse batches > 1 without one. ``chunk = 1 if one_row_only(model, kind) else 64``
    """
    return HeadKind(kind).pooled and pad_token_id(model) is None


def keeps_logits(model: nn.Module, kind: str) -> bool:
    """Whether a causal LM takes ``logits_to_keep``, so that its head runs only where predictions are read:
    ``model(input_ids=ids, logits_to_keep=torch.tensor([4])).logits`` is (rows, 1, vocab), position 4's."""
    causal = HeadKind(kind) is HeadKind.CAUSAL_LM
    return causal and "logits_to_keep" in inspect.signature(unwrap(model).forward).parameters


def _target_logit(model: nn.Module, kind: str, input_ids: torch.Tensor, attention_mask: torch.Tensor, position: int,
                  target: int) -> Callable:
    """f(word embeddings) -> (rows,) the explained logit, for captum (which expands the batch itself).

    The model is given the ``input_ids`` with its word-embedding output replaced by ``embeds``, not
    ``inputs_embeds``: a decoder classifier finds the token it pools (the last that is not pad_token_id) in the
    ids; from inputs_embeds alone it would read the last token, another prediction than the one explained."""
    keep, kind = keeps_logits(model, kind), HeadKind(kind)
    embedding = model.get_input_embeddings()

    def forward(embeds: torch.Tensor) -> torch.Tensor:
        rows = embeds.shape[0]
        extra = {"logits_to_keep": torch.tensor([position], device=embeds.device)} if keep else {}
        handle = embedding.register_forward_hook(lambda module, args, output: embeds)
        try:
            logits = model(input_ids=input_ids.expand(rows, -1), attention_mask=attention_mask.expand(rows, -1),
                           **extra).logits
        finally:
            handle.remove()
        if kind.vocabulary:
            logits = logits[:, 0 if keep else position]
        return logits[:, 0] if kind is HeadKind.REGRESSION else logits[:, target]

    return forward


def gradient_scores(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    position: int,
    target: int,
    method: str,
    ig_steps: int = 50,
    kind: str | None = None,
    aggregation: str = "l1",
) -> torch.Tensor:
    """One float32 score per token of a single example (``input_ids`` of shape (1, seq)) -> (seq,).

    ``grad_norm``: the gradient ``d f / d e_i``; ``grad_x_input``: ``e_i * d f / d e_i``;
    ``integrated_gradients``: captum IG with ``ig_steps`` steps from a zero embedding; each reduced over d by
    ``aggregation`` (see :data:`AGGREGATIONS`). ``kind``: the head kind when the caller knows it.
    """
    return gradient_scores_many(model, input_ids, attention_mask, position=position, target=target, methods=[method],
                                ig_steps=ig_steps, kind=kind, aggregation=aggregation)[method][0]


def check_ig_steps(ig_steps: Any) -> int:
    """``ig_steps`` as the int captum's step list is made from (a numpy integer too); a one-line ValueError unless
    it is a whole number of at least 1 (captum said 0 by an AssertionError, numpy 2.5 by a TypeError)."""
    return whole_number(ig_steps, f"ig_steps={ig_steps!r}: give the number of Integrated Gradients steps, a whole "
                                  "number of at least 1 (the paper's: 50)", least=1)


def gradient_scores_many(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    position: int,
    target: int,
    methods: Sequence[str],
    ig_steps: int = 50,
    kind: str | None = None,
    aggregation: str = "l1",
) -> dict[str, tuple[torch.Tensor, float]]:
    """:func:`gradient_scores` of several ``methods`` at once: name -> (scores (seq,), seconds).

    ``grad_norm`` and ``grad_x_input`` share one backward pass (the second is the first times the input), so
    each reports the seconds of that one pass. ``gradient_scores_many(model, ids, mask, position=4, target=7,
    methods=GRADIENT_METHODS)``
    """
    from captum.attr import IntegratedGradients, Saliency

    unknown = [m for m in methods if m not in GRADIENT_METHODS]
    if unknown:
        raise ValueError(f"method {unknown[0]!r} is not a gradient baseline; use one of {GRADIENT_METHODS}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation {aggregation!r}: use one of {', '.join(AGGREGATIONS)}")
    reduce = AGGREGATIONS[aggregation]
    if "integrated_gradients" in methods:
        ig_steps = check_ig_steps(ig_steps)
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"gradient_scores explains one example: input_ids must be (1, seq), got {tuple(input_ids.shape)}")
    kind = kind or head_kind(model)
    forward = _target_logit(model, kind, input_ids, attention_mask, position, target)
    embeds = model.get_input_embeddings()(input_ids).detach().requires_grad_(True)
    out: dict[str, tuple[torch.Tensor, float]] = {}
    if any(m in ("grad_norm", "grad_x_input") for m in methods):
        start = time.perf_counter()
        gradient = Saliency(forward).attribute(embeds, abs=False)[0]
        seconds = time.perf_counter() - start
        products = {"grad_norm": gradient, "grad_x_input": gradient * embeds[0]}
        out.update({m: (reduce(products[m]).detach(), seconds) for m in methods if m in products})
    if "integrated_gradients" in methods:
        start = time.perf_counter()
        attributions = IntegratedGradients(forward).attribute(
            embeds, baselines=torch.zeros_like(embeds), n_steps=ig_steps,
            internal_batch_size=1 if one_row_only(model, kind) else None)
        out["integrated_gradients"] = (reduce(attributions[0]).detach(), time.perf_counter() - start)
    return out
