"""The head-on-top (HoT) applied per token: ``features`` (final norm and any pre-head transform), then a
readout that gathers only the target rows of the last linear map, then elementwise logit post-processing.

Kept apart from the hooks: everything here is a function of hidden states and the model's own modules.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .registry import ArchSpec, _get_path

_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "tanh": torch.tanh,
    "gelu": F.gelu,
    "relu": F.relu,
}


def module_device(module: nn.Module) -> torch.device:
    """Where ``module`` computes: accelerate's execution device when offloaded, else its weights' device."""
    hook = getattr(module, "_hf_hook", None)
    execution_device = getattr(hook, "execution_device", None)
    if execution_device is not None:
        return torch.device(execution_device if not isinstance(execution_device, int) else f"cuda:{execution_device}")
    for tensor in module.parameters():
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


def _weights_materialized(module: nn.Module):
    """Offloaded weights sit on ``meta`` outside their forward; this brings them in for a direct read."""
    if not hasattr(module, "_hf_hook"):
        return contextlib.nullcontext()
    from accelerate.utils import align_module_device

    return align_module_device(module)


def _activation(config, attribute: str) -> Callable[[torch.Tensor], torch.Tensor]:
    from transformers.activations import ACT2FN

    return ACT2FN[getattr(config, attribute)]


class Head:
    """HoT of one task model, built from its :class:`ArchSpec`."""

    def __init__(self, model: nn.Module, spec: ArchSpec, kind: str) -> None:
        spec_kind = "sequence_classification" if kind == "regression" else kind
        steps: list[nn.Module | Callable] = []
        for step in spec.heads[spec_kind]:
            if step in _FUNCTIONS:
                steps.append(_FUNCTIONS[step])
            elif step.startswith("act:"):
                steps.append(_activation(model.config, step[4:]))
            else:
                module = _get_path(model, step)
                if module is not None:
                    steps.append(module)
        readout = steps.pop()
        if not isinstance(readout, nn.Module):
            raise ValueError(f"spec {spec.name!r}: the last head step must be a module (the readout), got {readout}")
        self._steps = steps
        self.readout = readout
        self.n_outputs = self._count_outputs(readout)
        config = model.config
        self._softcap = getattr(config, spec.softcap, None) if spec.softcap else None
        self._scale = getattr(config, spec.logit_scale, None) if spec.logit_scale else None
        self._divide = getattr(config, spec.logit_divide, None) if spec.logit_divide else None

    @staticmethod
    def _count_outputs(readout: nn.Module) -> int:
        for module in (readout, *readout.modules()):
            if isinstance(module, nn.Linear):
                return module.out_features
        raise ValueError(f"cannot find the output size of the readout {type(readout).__name__}")

    @property
    def device(self) -> torch.device:
        return module_device(self.readout)

    def _gatherable(self) -> bool:
        # Only a plain Linear can be gathered row by row: bitsandbytes' Linear4bit/8bitLt subclass
        # nn.Linear but store packed weights, and PEFT wrappers route to the active adapter.
        return type(self.readout) is nn.Linear

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """Everything before the readout (final norm, pooler transform...), applied to every position."""
        for step in self._steps:
            if isinstance(step, nn.Module):
                hidden = hidden.to(module_device(step))
            hidden = step(hidden)
        return hidden

    def _post(self, logits: torch.Tensor) -> torch.Tensor:
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        if self._scale:
            logits = logits * self._scale
        if self._divide:
            logits = logits / self._divide
        return logits

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """All outputs of HoT for ``features`` of shape (..., d): use only on a few positions."""
        return self._post(self.readout(features.to(self.device))).float()

    def target_logits(self, features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """HoT outputs for ``targets`` only.

        ``features``: (rows, seq, d); ``targets``: (rows, k) label ids. Returns float32 (rows, seq, k).
        """
        features = features.to(self.device)
        targets = targets.to(self.device)
        if self._gatherable():
            with _weights_materialized(self.readout):
                weight = self.readout.weight[targets]  # (rows, k, d)
                out = torch.einsum("rsd,rkd->rsk", features, weight.to(features.dtype))
                if self.readout.bias is not None:
                    out = out + self.readout.bias[targets].to(out.dtype)[:, None, :]
        else:
            full = self.readout(features)
            out = full.gather(-1, targets[:, None, :].expand(-1, full.shape[1], -1))
        return self._post(out).float()
