"""Gradient baselines of the paper, through captum, on the word-embedding rows (``inputs_embeds``):
Gradient Norm, Gradient x Input and Integrated Gradients. Each returns one score per token.

    scores = gradient_scores(model, input_ids, attention_mask, position=0, target=1, method="grad_x_input")

The explained scalar is the target's logit at the prediction position (the same quantity LogAt reads at
the last layer; regression: the model's output). Integrated Gradients uses an all-zero embedding baseline.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .registry import head_kind

__all__ = ["GRADIENT_METHODS", "gradient_scores", "one_row_only"]

#: method name -> what it reduces the (seq, d) attribution to.
GRADIENT_METHODS = ("grad_norm", "grad_x_input", "integrated_gradients")


def one_row_only(model: nn.Module, kind: str) -> bool:
    """Whether the model takes one row per forward: transformers' decoder classifiers find the pooled token
    through pad_token_id and refuse batches > 1 without one. ``chunk = 1 if one_row_only(model, kind) else 64``
    """
    return kind in ("sequence_classification", "regression") and getattr(model.config, "pad_token_id", None) is None


def _target_logit(model: nn.Module, kind: str, attention_mask: torch.Tensor, position: int, target: int) -> Callable:
    """f(inputs_embeds) -> (rows,) the explained logit, for captum (which expands the batch itself)."""

    def forward(embeds: torch.Tensor) -> torch.Tensor:
        mask = attention_mask.expand(embeds.shape[0], -1)
        logits = model(inputs_embeds=embeds, attention_mask=mask).logits
        if kind in ("causal_lm", "masked_lm"):
            logits = logits[:, position]
        return logits[:, 0] if kind == "regression" else logits[:, target]

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
) -> torch.Tensor:
    """One float32 score per token of a single example (``input_ids`` of shape (1, seq)) -> (seq,).

    ``grad_norm``: ``||d f / d e_i||_2``; ``grad_x_input``: ``sum_d e_i * d f / d e_i``;
    ``integrated_gradients``: captum IG with ``ig_steps`` steps from a zero embedding, summed over d.
    ``kind``: the head kind when the caller knows it (default: read from the model).
    """
    from captum.attr import InputXGradient, IntegratedGradients, Saliency

    if method not in GRADIENT_METHODS:
        raise ValueError(f"method {method!r} is not a gradient baseline; use one of {GRADIENT_METHODS}")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"gradient_scores explains one example: input_ids must be (1, seq), got {tuple(input_ids.shape)}")
    kind = kind or head_kind(model)
    forward = _target_logit(model, kind, attention_mask, position, target)
    embeds = model.get_input_embeddings()(input_ids).detach().requires_grad_(True)
    if method == "grad_norm":
        grads = Saliency(forward).attribute(embeds, abs=False)
        return grads[0].float().norm(dim=-1).detach()
    if method == "grad_x_input":
        return InputXGradient(forward).attribute(embeds)[0].float().sum(-1).detach()
    attributions = IntegratedGradients(forward).attribute(embeds, baselines=torch.zeros_like(embeds), n_steps=ig_steps,
                                                          internal_batch_size=1 if one_row_only(model, kind) else None)
    return attributions[0].float().sum(-1).detach()
