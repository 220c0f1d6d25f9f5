"""LogAt (SPEC section 1): HoT(h_i^l)[y], the logit lens of the explained target at every layer and token."""

from __future__ import annotations

import torch

from ..protocol import Given


class LogAt:
    name = "logat"
    description = "HoT(h_i^l)[target]: the head applied to each token's hidden state (logit lens of the target)"
    pointwise = True  # (Pointwise)

    def score(self, given: Given) -> torch.Tensor:
        return given.logat


METHOD = LogAt()
