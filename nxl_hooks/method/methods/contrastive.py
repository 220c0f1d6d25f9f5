"""Contrastive NormXLogit: ‖h_i^0‖₂ × (LogAt[y] − LogAt[foil]), i.e. NormXLogit[target] − NormXLogit[foil]: what
makes a token push towards the target *rather than* the model's best alternative (a variant beyond the paper).

The foil of a row is, by default, the output the model ranks highest at the prediction position among those not
explained in that row (the runner-up when the target is the prediction); ``Contrastive(foil=id)`` fixes it.
Without the model's own probabilities (a regression head, an engine that gives no logits) and no fixed foil,
there is nothing to contrast with: the scores are NaN; so are a row's where every output is explained (a one-logit
multi-label classifier, whose one output is the target; a 2-label classifier asked for both labels), and a row's
whose explained output is the fixed foil itself (``target="predicted"`` where the model predicts it; a fixed target
that is the foil is refused at attach).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ...arch.values import integer
from ..protocol import Given


#: What the terminal, the attribution page and the repr say when every contrastive score is NaN (no row had a foil).
NO_FOIL = ("every contrastive score is NaN: no output is left to be the foil (every output of the head is explained, "
           "as for a one-logit classifier or both labels of a 2-label one; or a fixed foil is the explained output "
           "itself, as the prediction) or the model's probabilities are unknown (a regression head); "
           "Contrastive(foil=id) of an output not explained fixes one")


@dataclass(frozen=True)
class Contrastive:
    foil: int | None = None  #: a fixed foil id for every row; None: the model's best output not explained
    name = "contrastive"
    description = "NormXLogit[target] − NormXLogit[foil]; foil: the model's best other output (runner-up)"
    pointwise = True  # (Pointwise): a row's foil is read from that row's own log-probabilities

    def __post_init__(self) -> None:
        foil = self.foil
        if foil is not None and (integer(foil) is None or foil < 0):
            raise ValueError(f"Contrastive(foil={foil!r}): give an output id (0 or more), or None for the model's "
                             "best other output")
        if foil is not None:
            object.__setattr__(self, "foil", integer(foil))  # (a numpy integer too)

    def check_outputs(self, n_outputs: int) -> None:
        """(Checked) a fixed foil is an output of the head: ``Contrastive(foil=7).check_outputs(n)``."""
        if self.foil is not None and self.foil >= n_outputs:
            raise ValueError(f"Contrastive(foil={self.foil}) is out of range: the head has {n_outputs} outputs "
                             f"(0..{n_outputs - 1})")

    def check_targets(self, targets: torch.Tensor) -> None:
        """(TargetChecked) a fixed foil is no explained target: ``Contrastive(foil=7).check_targets(ids)``."""
        if self.foil is not None and bool(self._explained(targets).any()):
            raise ValueError(f"Contrastive(foil={self.foil}) is contrasted with itself: output {self.foil} is an "
                             "explained target, and its gap to itself is 0 at every token; give a foil that is not "
                             "a target, or Contrastive() for the model's best other output")

    def _explained(self, targets: torch.Tensor) -> torch.Tensor:
        """(rows, 1) True where a row explains the fixed foil itself: that row has no foil (one rule: refused at
        attach where the targets are known, NaN where they are known only per forward, target="predicted")."""
        return (targets == self.foil).any(-1, keepdim=True)

    def with_foil(self, foil: int) -> "Contrastive":
        """(Contrasting) the method with ``foil`` fixed: ``Contrastive().with_foil(7)``."""
        return dataclasses.replace(self, foil=foil)

    def foils(self, given: Given) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(rows, 1) foil ids, on the device of the explained ids, and (rows, 1) True where a row has none (every
        output is explained, or the fixed foil is; None: every row has one); None when there is nothing to contrast
        with."""
        targets = given.targets
        if self.foil is not None:
            foils = torch.full((targets.shape[0], 1), self.foil, dtype=torch.long, device=targets.device)
            return foils, self._explained(targets)
        if given.log_probs is None:
            return None
        ranked = given.log_probs.scatter(-1, targets.to(given.log_probs.device), float("-inf"))
        none = ranked.isneginf().all(-1, keepdim=True) if targets.shape[-1] >= ranked.shape[-1] else None
        return ranked.argmax(-1, keepdim=True).to(targets.device), none

    def score(self, given: Given) -> torch.Tensor:
        found = self.foils(given)
        if found is None:
            return torch.full_like(given.logat, float("nan"))
        foils, none = found
        # a regression head's logat is |HoT − HoT_p|: the gap is of its raw outputs (a fixed foil's HoT is raw)
        target = given.head_logits(given.targets) if given.regression else given.logat
        gap = target - given.head_logits(foils).to(target.device, target.dtype)
        scores = given.embed_norm.to(gap.device, gap.dtype)[None, :, :, None] * gap
        if none is None:
            return scores
        # (on the device: which rows have no foil is never read back)
        return scores.masked_fill_(none.to(scores.device)[None, :, None, :], float("nan"))  # (scores: its own)


METHOD = Contrastive()


#: What they say when some rows have no foil, but not all (a fixed foil that is some rows' prediction).
SOME_NO_FOIL = ("{rows} no foil, so {their} contrastive scores are NaN: the fixed foil is the output {each} explains "
                "(as {its} prediction), or every output is explained; a foil no row explains, or Contrastive() for "
                "each row's best other output, gives every row one")


def foilless(method: str, scores: torch.Tensor) -> list[int]:
    """The rows (axis 1 of ``scores``, ``method``'s) whose every score is NaN where it is this method: those that
    had no foil (:meth:`Contrastive.score`); [] for any other method."""
    if method != Contrastive.name:
        return []
    return scores.transpose(0, 1).reshape(scores.shape[1], -1).isnan().all(-1).nonzero().flatten().tolist()


def no_foil(method: str, scores: torch.Tensor) -> str | None:
    """Why rows of ``scores`` are NaN where they are ``method``'s and it is this one (a table of "nan" or of blank
    cells says nothing of why): :data:`NO_FOIL` where no row had a foil, :data:`SOME_NO_FOIL` naming the rows that
    had none, else None. ``no_foil("contrastive", res.scores["contrastive"])``"""
    rows = foilless(method, scores)
    if not rows:
        return None
    if len(rows) == scores.shape[1]:
        return NO_FOIL
    one = len(rows) == 1
    named = f"row {rows[0]} has" if one else f"rows {', '.join(map(str, rows))} have"
    return SOME_NO_FOIL.format(rows=named, their="its" if one else "their", each="it" if one else "each",
                               its="its" if one else "their")
