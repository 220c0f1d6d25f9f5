"""LogAt into NormXLogit (SPEC section 1), for forwards and generation steps alike.

    logat, normxlogit, targets = scores(logat, embed_norm, targets, label_axis=False)

``logat``: (layers, rows, seq, k) target logits HoT(h_i^l)[y]; ``embed_norm``: (rows, seq) ‖x_i^0‖₂.
Regression heads explain |HoT(h_i^l) − HoT(h_p^L)| (:func:`regression_logat`).
"""

from __future__ import annotations

import torch

__all__ = ["label_axis", "regression_logat", "scores"]


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
    normxlogit = embed_norm.to(logat.device, logat.dtype)[None, :, :, None] * logat
    if label_axis:
        return logat, normxlogit, targets
    return logat[..., 0], normxlogit[..., 0], targets[:, 0]
