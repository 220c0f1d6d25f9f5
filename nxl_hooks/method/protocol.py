"""What a forward-only attribution method is given and what it returns: the :class:`Method` protocol.

    class Doubled(Method):                       # subclassing is optional: it states the intent
        name = "doubled"
        description = "twice LogAt"
        def score(self, given: Given) -> torch.Tensor:
            return 2 * given.logat                # (layers, rows, seq, k), shaped like given.logat

A method is a function of what the recorder has already computed, once per explained forward or generated token
(:class:`Given`): the per-layer target logits LogAt, the embedding norms, the explained ids, the model's own
log-probabilities at the prediction position, and HoT outputs for other ids on demand. It runs on the model's
hot path, inside the head's reading block: device tensors only, no host reads (``.item()``, ``.tolist()``), no
locks. Register it with :func:`~nxl_hooks.method.registry.register_method` (or the entry-point group
``nxl_hooks.methods``); a probe computes it when asked: ``nxl.attach(model, methods=["doubled"])``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch

__all__ = ["Checked", "Contrasting", "Given", "Method", "Pointwise", "TargetChecked", "check_name"]

#: What a method's name may be: it names a record's ``scores`` entry, a stream-file tensor and a Parquet column.
NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")


@dataclass(frozen=True, eq=False)
class Given:
    """What the recorder hands a method, for one forward (or one generated token's context).
    ``def score(self, given): return given.embed_norm[None, :, :, None] * given.logat``"""

    logat: torch.Tensor  #: float32 (layers, rows, seq, k): HoT(h_i^l)[y] (regression: |HoT(h_i^l) − HoT(h_p^L)|)
    embed_norm: torch.Tensor  #: float32 (rows, seq): ‖h_i^0‖₂ (or the word-embedding row's norm)
    targets: torch.Tensor  #: int64 (rows, k): the explained ids
    #: float32 (rows, outputs): the model's own log-probabilities at each row's prediction position (its
    #: log-softmax; a multi-label classifier's log-sigmoid, each output its own yes or no:
    #: :func:`~nxl_hooks.arch.registry.log_probabilities`); None for a regression head, or where the engine did not
    #: give its logits
    log_probs: torch.Tensor | None
    #: ``head_logits(ids)``: raw HoT(h_i^l)[ids] for other ids (rows, m) -> float32 (layers, rows, seq, m), one
    #: gather of m rows of the head per layer and token (what LogAt costs per target)
    head_logits: Callable[[torch.Tensor], torch.Tensor]
    #: bool (rows, seq), on ``logat``'s device: True at the row's real tokens, False at padding (a method that reads
    #: other positions, as a mean over the row, leaves padding out with it); a Given made without one (a method's own
    #: test) has every position real
    mask: torch.Tensor = None  # type: ignore[assignment]
    #: True for a regression head: ``logat`` is then |HoT(h_i^l) − HoT(h_p^L)|, and ``head_logits(targets)`` the raw
    #: HoT(h_i^l)[y]
    regression: bool = False

    def __post_init__(self) -> None:
        # (frozen: set once here) the mask where the scores are, whatever device the recorder kept it on
        mask = self.mask if self.mask is not None else torch.ones(self.logat.shape[1:3], dtype=torch.bool)
        object.__setattr__(self, "mask", mask.to(self.logat.device))


@runtime_checkable
class Method(Protocol):
    """A forward-only attribution method: ``score(given)`` -> float (layers, rows, seq, k), shaped like
    ``given.logat``. ``name`` (lowercase letters, digits, ``_``) keys ``Attribution.scores`` and ``Step.scores``;
    ``description`` says in one line what it computes (the CLI's ``--method`` help shows the built-in ones')."""

    name: str
    description: str

    def score(self, given: Given) -> torch.Tensor:
        """The per-layer, per-token scores of each explained target: (layers, rows, seq, k)."""
        ...


@runtime_checkable
class Pointwise(Method, Protocol):
    """A :class:`Method` that says (``pointwise = True``) its score at each (layer, row, position, label) reads only
    what ``given`` holds at that row and position (its LogAt, embedding norm, targets, log-probabilities,
    ``head_logits``): stacking rows, or padding a row with positions after its own, changes none of the scores it
    already had. Generated tokens scored together then take one ``score`` call for all of them (rows stacked, each
    token's context padded to the longest), not one each. Every built-in method is pointwise.

        class Doubled:
            name, description, pointwise = "doubled", "twice LogAt", True
            def score(self, given): return 2 * given.logat
    """

    pointwise: bool  #: True: it is (a False, or no attribute, is a method scored one call per generated token)


@runtime_checkable
class Checked(Method, Protocol):
    """A :class:`Method` whose settings name outputs of the head (a fixed foil id): ``check_outputs(n_outputs)`` raises
    ValueError, saying what to change, when they do not fit a head of ``n_outputs`` outputs. A probe calls it once,
    when it attaches, so that a setting no head of the model has is refused then, not in every forward."""

    def check_outputs(self, n_outputs: int) -> None:
        ...


@runtime_checkable
class TargetChecked(Method, Protocol):
    """A :class:`Method` whose settings must not name an explained output (a fixed foil, whose gap to itself is 0 at
    every token): ``check_targets(targets)`` raises ValueError, saying what to change, when one of the (rows, k)
    ``targets`` ids is such an output. A probe given its targets calls it once, when it attaches, before any forward;
    with ``target="predicted"`` they are known only per forward, where the method's scores say it (NaN)."""

    def check_targets(self, targets: torch.Tensor) -> None:
        ...


@runtime_checkable
class Contrasting(Method, Protocol):
    """A :class:`Method` that contrasts the target with a foil output: ``with_foil(foil)`` is the method contrasting
    with the output id ``foil``. An evaluation gives it each example's foil, and leaves it out where there is none
    (a regression head); whether a method contrasts is what it says here, not how its class is written.

        def with_foil(self, foil): return MyContrast(foil=foil)
    """

    def with_foil(self, foil: int) -> Method:
        ...


def check_name(name: object) -> str:
    """``name`` when it can name a method's scores, else ValueError saying what to use."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"method name {name!r}: use 1-40 lowercase letters, digits and '_', starting with a letter")
    return name
