"""Metrics on score vectors, for every attribution method alike (SPEC section 5).

    average_precision(scores, evidence)     # evidence alignment: AP of ranking by signed score
    normalized_dot(scores, evidence)        # dot product with one normalization for every method
    evidence_mask(text, offsets, ["keys"])  # which tokens are the known evidence
"""

from __future__ import annotations

import math
import re
from typing import Sequence

import torch

from ..method.select import order

__all__ = ["average_precision", "evidence_mask", "mean", "normalized_dot", "pearson"]


def average_precision(scores: torch.Tensor, relevant: torch.Tensor) -> float:
    """AP of ranking by signed score, descending: sum_k (R_k - R_{k-1}) P_k. ``average_precision(s, e)``

    ``scores`` and ``relevant`` (0/1) are 1-D over the ranked tokens (drop the prediction position and special tokens first).
    Ties keep token order.
    """
    relevant = relevant.bool()
    if not relevant.any():
        raise ValueError("average_precision needs at least one relevant (evidence) token")
    hits = relevant[order(scores, torch.ones_like(relevant))].float()
    precision = hits.cumsum(0) / torch.arange(1, len(hits) + 1)
    return float((precision * hits).sum() / hits.sum())


def normalized_dot(scores: torch.Tensor, relevant: torch.Tensor) -> float:
    """sum_i E_i s'_i with s' = (s - min s) / sum(s - min s): one normalization for every method.

    Min-shift then L1 keeps the signed order (the ranking the paper uses), is invariant to the scale and
    offset of a method's scores (gradients and logits live on different scales, where a softmax is not
    fair), and makes s' a distribution over tokens. All-equal scores give the uniform distribution.
    """
    shifted = scores.float() - scores.float().min()
    total = shifted.sum()
    weights = shifted / total if total > 0 else torch.full_like(shifted, 1.0 / len(shifted))
    return float((weights * relevant.float()).sum())


def evidence_mask(text: str, offsets: Sequence[tuple[int, int]], words: Sequence[str]) -> tuple[torch.Tensor, list[str]]:
    """0/1 per token whose character span overlaps a whole-word, case-insensitive match of an evidence word.

    Returns (mask, words that matched no token). ``offsets`` comes from a fast tokenizer
    (``return_offsets_mapping=True``); special tokens have empty spans and never match.
    """
    spans = []
    missing = []
    for word in words:
        found = [m.span() for m in re.finditer(rf"(?<!\w){re.escape(word)}(?!\w)", text, flags=re.IGNORECASE)]
        spans += found
        if not found:
            missing.append(word)
    mask = torch.tensor(
        [int(end > start and any(s < end and start < e for s, e in spans)) for start, end in offsets], dtype=torch.long
    )
    return mask, missing


def mean(values: Sequence[float | None]) -> float | None:
    """The mean of the values that are not None (None if there are none): ``mean([1.0, None, 3.0]) == 2.0``."""
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def pearson(x: Sequence[float], y: Sequence[float]) -> float | None:
    if len(x) < 2:
        return None
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx = sum((a - mx) ** 2 for a in x)
    syy = sum((b - my) ** 2 for b in y)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else None
