"""NormXLogit (SPEC section 1): ‖h_i^0‖₂ × LogAt, the paper's method and every output's default."""

from __future__ import annotations

import torch

from ..protocol import Given


class NormXLogit:
    name = "normxlogit"
    description = "embedding norm × LogAt (the paper's method)"
    pointwise = True  # (Pointwise)

    def score(self, given: Given) -> torch.Tensor:
        return given.embed_norm.to(given.logat.device, given.logat.dtype)[None, :, :, None] * given.logat


METHOD = NormXLogit()
