"""LogAt into every method's scores (SPEC section 1), for forwards and generation steps alike.

    scores, targets = method_scores(methods, given, label_axis=False)   # {"normxlogit": ..., "logat": ...}

``given``: a :class:`~nxl_hooks.method.protocol.Given` (``logat``: (layers, rows, seq, k) target logits
HoT(h_i^l)[y]; ``embed_norm``: (rows, seq) ‖x_i^0‖₂). Regression heads explain |HoT(h_i^l) − HoT(h_p^L)|
(:func:`regression_logat`).

When the embedding norms are (nearly) the same on every token that ranks, NormXLogit is LogAt times a constant and
ranks tokens exactly as LogAt does: :func:`flat_norms` says when (some models normalize their embeddings).
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from ..arch import plugins
from ..arch.text import typed
from .protocol import Given, Method, Pointwise

__all__ = ["FLAT_NORM_CV", "OVERFLOWED", "OVERFLOW_NOTE", "WIDER", "MethodError", "flat_note", "flat_norms",
           "label_axis", "method_scores", "norm_spread", "pointwise", "regression_logat", "row_norms", "wide"]

#: Below this coefficient of variation (std / mean) of the embedding norms over the ranked tokens, NormXLogit is
#: LogAt times nearly one number: its ranking can differ from LogAt's only between tokens whose LogAt are that close.
FLAT_NORM_CV = 1e-3


@functools.cache  # (torch.promote_types dispatches as an operator: asked per forward and per scored step)
def wide(dtype: torch.dtype) -> torch.dtype:
    """At least float32: float32 for a 16-bit dtype, float64 kept (narrowed, values that differ below float32's
    resolution would tie)."""
    return torch.promote_types(dtype, torch.float32)


def row_norms(rows: torch.Tensor, *, keepdim: bool = False) -> torch.Tensor:
    """‖row‖₂ over the last axis of ``rows``, taken in :func:`wide` precision: float32 for a 16-bit input (its
    squares would round), a float64 input's own dtype (torch refuses to narrow it)."""
    return torch.linalg.vector_norm(rows, dim=-1, keepdim=keepdim, dtype=wide(rows.dtype))


def label_axis(target: object) -> bool:
    """Whether scores keep a trailing axis of k labels: a list target, or a (rows, k) id tensor."""
    return isinstance(target, (list, tuple)) or (isinstance(target, torch.Tensor) and target.dim() == 2)


def regression_logat(logat: torch.Tensor, prediction: torch.Tensor) -> torch.Tensor:
    """|HoT(h_i^l) − HoT(h_p^L)| for a regression head: ``logat`` (layers, rows, seq, k), ``prediction`` (rows, k),
    the prediction of each explained output."""
    return (logat - prediction.to(logat.device, logat.dtype)[None, :, None, :]).abs()


def _versions(given: Given) -> dict[str, int]:
    """The version counter (bumped by every in-place change) of each of ``given``'s tensors, by field; torch keeps
    none for a tensor made under ``torch.inference_mode``."""
    tensors = {"logat": given.logat, "embed_norm": given.embed_norm, "targets": given.targets,
               "log_probs": given.log_probs, "mask": given.mask}
    return {name: tensor._version for name, tensor in tensors.items()
            if tensor is not None and not tensor.is_inference()}


class MethodError(RuntimeError):
    """An attribution method raised (or exited) scoring a record, its error as the cause: the method's failure, not
    the caller's, which the command line says in one line (``nxl attribute --method NAME``) rather than as a
    traceback of its own."""


def method_scores(methods: Sequence[Method], given: Given, *, label_axis: bool
                  ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """({name: scores}, targets) of each method for ``given``, detached; the label axis is dropped unless kept.
    ValueError naming a method whose scores are not float, dense (no meta or sparse tensor) and shaped like
    ``given.logat``; RuntimeError naming a method that
    raises or exits (``SystemExit``, any ``BaseException`` but ``KeyboardInterrupt``), its error as its cause, which
    every caller says in one line; ValueError naming a method that changed one of ``given``'s tensors in place (the
    record keeps them: LogAt's scores are ``given.logat`` itself), seen by their version counters at no cost."""
    out = {}
    for method in methods:
        handed = _versions(given)
        try:
            value = method.score(given)
        except BaseException as error:  # noqa: BLE001 - a method's failure (sys.exit too) is its record's, never
            # the host's; named, or a plugin's 'ValueError: bad input' in a server's log would point at nothing
            said = typed(plugins.contained(error))
            raise MethodError(f"attribution method {method.name!r} raised {said}") from error
        if not (isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == given.logat.shape
                and not value.is_meta and value.layout == torch.strided):
            raise ValueError(f"attribution method {method.name!r} returned {_returned(value)}: expected float "
                             f"scores shaped like logat {tuple(given.logat.shape)}, a dense tensor with data")
        changed = [name for name, version in _versions(given).items() if version != handed[name]]
        if changed:
            raise ValueError(f"attribution method {method.name!r} changed given.{changed[0]} in place: the record "
                             "keeps it; return new tensors (given.logat.clamp(min=0), not clamp_)")
        value = value.detach()  # a record holds scores, not an autograd graph (nor what the graph keeps alive)
        out[method.name] = value if label_axis else value[..., 0]
    return out, given.targets if label_axis else given.targets[:, 0]


def _returned(value: object) -> str:
    """What a method returned, as its refusal names it: its dtype and shape (integer scores of the right shape said
    only their shape, which read as right), or what a tensor of that shape lacks (a meta tensor's data, which failed
    later as an unnamed NotImplementedError; a sparse tensor's dense layout)."""
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    if value.is_meta:
        return f"a tensor on the meta device (shape {tuple(value.shape)}, no data)"
    if value.layout != torch.strided:
        return f"a {value.layout} tensor"
    return f"{str(value.dtype).removeprefix('torch.')} {tuple(value.shape)}"


def pointwise(methods: Sequence[Method]) -> bool:
    """Whether every one of ``methods`` says it is :class:`~.protocol.Pointwise`: several generated tokens' scores
    may then come from one ``score`` call each."""
    return all(isinstance(method, Pointwise) and method.pointwise is True for method in methods)


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


#: What a model's outputs at a prediction position are when they overflowed (Attribution.overflowed): the target
#: "predicted" there is argmax's pick among NaN, not a prediction; and what to do.
OVERFLOWED = "outputs at the prediction position are NaN or infinite (an overflow, as in float16)"
WIDER = "load the model in bfloat16 or float32"
#: What every output says, once, of such a record.
OVERFLOW_NOTE = f"the model's own {OVERFLOWED}: its prediction and these scores say nothing; {WIDER}"
