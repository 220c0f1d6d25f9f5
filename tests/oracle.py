"""Independent oracle for the tests: NormXLogit from ``output_hidden_states=True`` and a head applied by hand.

Written apart from the library on purpose: nothing here imports nxl_hooks. Each family's head is spelled
out as plain tensor code on the model's own weights.
"""

from __future__ import annotations

from typing import Callable

import torch

Fn = Callable[[torch.Tensor], torch.Tensor]


def layer_logits(hidden_states: tuple[torch.Tensor, ...], norm: Fn, head: Fn, *, last_is_normed: bool) -> torch.Tensor:
    """Full HoT logits per layer: (L+1, batch, seq, outputs).

    transformers already applies the final norm to ``hidden_states[-1]`` for most decoders
    (``last_is_normed=True``); applying it twice would be the silent bug the SPEC warns about.
    """
    out = []
    last = len(hidden_states) - 1
    for index, hidden in enumerate(hidden_states):
        normed = hidden if (index == last and last_is_normed) else norm(hidden)
        out.append(head(normed).float())
    return torch.stack(out)


def normxlogit(logits: torch.Tensor, embeddings: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logat, normxlogit), each (L+1, batch, seq) for one target id per row."""
    index = target.view(1, -1, 1, 1).expand(logits.shape[0], -1, logits.shape[2], 1)
    logat = logits.gather(-1, index)[..., 0]
    return logat, embeddings.float().norm(dim=-1)[None] * logat


def rms_norm(module: torch.nn.Module, *, one_plus: bool = False) -> Fn:
    """Llama-style RMSNorm by hand (Gemma stores ``weight - 1``)."""

    def apply(h: torch.Tensor) -> torch.Tensor:
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
        x = h.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        weight = module.weight.float()
        return (x * ((1.0 + weight) if one_plus else weight)).to(h.dtype)

    return apply


def layer_norm(module: torch.nn.LayerNorm) -> Fn:
    def apply(h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(h, module.normalized_shape, module.weight, module.bias, module.eps)

    return apply


def linear(module: torch.nn.Module) -> Fn:
    def apply(h: torch.Tensor) -> torch.Tensor:
        out = h @ module.weight.t()
        return out + module.bias if getattr(module, "bias", None) is not None else out

    return apply
