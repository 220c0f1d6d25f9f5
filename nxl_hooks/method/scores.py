"""LogAt into NormXLogit (SPEC section 1), for forwards and generation steps alike.

    logat, normxlogit, targets = scores(logat, embed_norm, targets, label_axis=False)

``logat``: (layers, rows, seq, k) target logits HoT(h_i^l)[y]; ``embed_norm``: (rows, seq) ‖x_i^0‖₂.
Regression heads explain |HoT(h_i^l) − HoT(h_p^L)| (:func:`regression_logat`).

When the embedding norms are (nearly) the same on every token that ranks, NormXLogit is LogAt times a constant and
ranks tokens exactly as LogAt does: :func:`flat_norms` says when (some models normalize their embeddings).
"""

from __future__ import annotations

import torch

__all__ = ["FLAT_NORM_CV", "flat_note", "flat_norms", "label_axis", "norm_spread", "regression_logat", "scores"]

#: Below this coefficient of variation (std / mean) of the embedding norms over the ranked tokens, NormXLogit is
#: LogAt times nearly one number: its ranking can differ from LogAt's only between tokens whose LogAt are that close.
FLAT_NORM_CV = 1e-3


def label_axis(target: object) -> bool:
    """Whether scores keep a trailing axis of k labels: a list target, or a (rows, k) id tensor."""
    return isinstance(target, (list, tuple)) or (isinstance(target, torch.Tensor) and target.dim() == 2)


def regression_logat(logat: torch.Tensor, prediction: torch.Tensor) -> torch.Tensor:
    """|HoT(h_i^l) − HoT(h_p^L)| for a one-output head: ``logat`` (layers, rows, seq, 1), ``prediction`` (rows,)."""
    return (logat - prediction.to(logat.device, logat.dtype)[None, :, None, None]).abs()


def scores(
    logat: torch.Tensor, embed_norm: torch.Tensor, targets: torch.Tensor, *, label_axis: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logat, normxlogit, targets): NormXLogit = ‖x_i^0‖₂ × LogAt; the label axis is dropped unless kept."""
    embed_norm = embed_norm.to(logat.device, logat.dtype)
    if label_axis:
        return logat, embed_norm[None, :, :, None] * logat, targets
    logat = logat[..., 0]  # dropped first: one product fewer views, once per generated token
    return logat, embed_norm * logat, targets[:, 0]


def norm_spread(embed_norm: torch.Tensor, eligible: torch.Tensor) -> float:
    """Coefficient of variation (population std / mean) of one row's embedding norms over the ``eligible`` (seq,)
    positions; NaN with fewer than two. ``norm_spread(res.embed_norm[0], res.rankable(0))``"""
    values = embed_norm[eligible.to(embed_norm.device)].double()
    if values.numel() < 2 or float(values.mean()) == 0.0:
        return float("nan")
    return float(values.std(unbiased=False) / values.mean())


def flat_norms(spread: float) -> bool:
    """Whether a :func:`norm_spread` is below :data:`FLAT_NORM_CV`: NormXLogit then ranks tokens as LogAt does."""
    return spread < FLAT_NORM_CV  # NaN (too few tokens) is not flat


def flat_note(spread: float) -> str:
    """What every output says, once, when :func:`flat_norms` holds."""
    return (f"the input-embedding norms are nearly equal on the ranked tokens (coefficient of variation {spread:.1e} "
            f"< {FLAT_NORM_CV:g}; this model may normalize its embeddings): NormXLogit ranks tokens exactly as "
            "LogAt does here")
