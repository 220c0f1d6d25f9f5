"""The head-on-top (HoT) applied per token: ``features`` (final norm and any pre-head transform), then a
readout that gathers only the target rows of the last linear map, then elementwise logit post-processing.

Kept apart from the hooks: everything here is a function of hidden states and the model's own modules.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .registry import ArchSpec, UnknownArchitectureError, _get_path, spec_head

_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "tanh": torch.tanh,
    "gelu": F.gelu,
    "relu": F.relu,
}

# Logit post-processing steps after the readout, "<op>:<config attribute>" (see ArchSpec).
_POST: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "softcap": lambda x, c: torch.tanh(x / c) * c,
    "scale": lambda x, s: x * s,
    "divide": lambda x, s: x / s,
}


def module_device(module: nn.Module) -> torch.device:
    """Where ``module`` computes: accelerate's execution device when offloaded, else its weights' device."""
    hook = getattr(module, "_hf_hook", None)
    hooks = getattr(hook, "hooks", (hook,))  # a SequentialHook holds several
    execution_device = next((h.execution_device for h in hooks if getattr(h, "execution_device", None) is not None), None)
    if execution_device is not None:
        if isinstance(execution_device, int):
            execution_device = f"cuda:{execution_device}"
        return _indexed(torch.device(execution_device))
    for tensor in module.parameters():
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


def input_device(model: nn.Module) -> torch.device:
    """Where ``model``'s token ids must go: its input embedding's device, also under a device_map."""
    embeddings = getattr(model, "get_input_embeddings", None)
    return module_device(embeddings() if callable(embeddings) else model)


def _indexed(device: torch.device) -> torch.device:
    # Tensors report "cuda:0", accelerate may say "cuda": compare like with like.
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _plain(module: nn.Module) -> bool:
    """Only ordinary float weights, no adapter routing: the module can be read row by row or copied.

    bitsandbytes (Params4bit, Int8Params), optimum-quanto and torchao store weights as tensor subclasses,
    and PEFT wrappers pick the active adapter at call time: those must be called where they live.
    """
    return all(
        type(param) in (nn.Parameter, torch.Tensor) and type(param.data) is torch.Tensor and param.is_floating_point()
        for param in module.parameters()
    ) and not any(type(sub).__module__.startswith("peft.") for sub in module.modules())


_ACCELERATE_ATTRIBUTES = ("_hf_hook", "_old_forward", "forward")


def _replica(module: nn.Module, device: torch.device) -> nn.Module:
    """A hook-free copy of a small plain module (a final norm) on ``device``, made once per device.

    accelerate's hook attributes are set aside during the copy: deep-copying them would copy the offload map
    (the whole offloaded state dict); offloaded weights are read under ``align_module_device``.
    """
    saved = [(sub, {key: sub.__dict__.pop(key) for key in _ACCELERATE_ATTRIBUTES if key in sub.__dict__})
             for sub in module.modules()]
    try:
        clone = copy.deepcopy(module)
    finally:
        for sub, attributes in saved:
            sub.__dict__.update(attributes)
    with _weights_materialized(module):
        state = {name: tensor.detach().to(device, copy=True) for name, tensor in module.state_dict().items()}
    clone.load_state_dict(state, assign=True)
    return clone.to(device).eval()


def _readable(module: nn.Module) -> bool:
    """Its own weights can be read directly: they are on a real device, or offloaded behind accelerate's offload
    hook, which ``align_module_device`` undoes. (``disk_offload`` on a bare Linear wraps that hook in a
    SequentialHook, which it does not: such a module is only ever called.)"""
    if all(param.device.type != "meta" for param in module.parameters(recurse=False)):
        return True
    from accelerate.utils import has_offloaded_params

    return has_offloaded_params(module)


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
        spec_kind = spec_head(kind)
        names = list(spec.heads[spec_kind])
        self._post_ops: list[tuple[Callable[[torch.Tensor, float], torch.Tensor], float]] = []
        while names and names[-1].split(":", 1)[0] in _POST:
            op, attribute = names.pop().split(":", 1)
            value = getattr(model.config, attribute, None)
            if value is not None:
                self._post_ops.insert(0, (_POST[op], float(value)))
        steps: list[nn.Module | Callable] = []
        for step in names:
            if step in _FUNCTIONS:
                steps.append(_FUNCTIONS[step])
            elif step.startswith("act:"):
                steps.append(_activation(model.config, step[4:]))
            else:
                try:
                    module = _get_path(model, step)
                except (AttributeError, IndexError):
                    raise UnknownArchitectureError(
                        f"{type(model).__name__} has no module {step!r}, which the {spec_kind!r} head of registry "
                        f"entry {spec.name!r} ({spec.source}) names: this model is a variant the entry does not "
                        "cover; register it with nxl.register_architecture(...) or fix the registry/*.toml entry"
                    ) from None
                if module is not None:
                    steps.append(module)
        readout = steps.pop()
        if not isinstance(readout, nn.Module):
            raise ValueError(f"spec {spec.name!r}: the last head step must be a module (the readout), got {readout}")
        self._steps = steps
        self._replicas: dict[tuple[int, torch.device], nn.Module] = {}
        self._rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None  # (targets, rows, bias)
        self._held = False  # inside reading(): the readout's weights are materialized
        self.readout = readout
        self.n_outputs = self._count_outputs(readout)
        # Only a plain Linear can be gathered row by row: bitsandbytes' Linear4bit/8bitLt subclass nn.Linear
        # but store packed weights, torchao keeps nn.Linear with a quantized weight tensor, and PEFT wrappers
        # route to the active adapter. Checked once: it is asked per layer and per generated token.
        self._plain_linear = type(readout) is nn.Linear and _plain(readout)

    @staticmethod
    def _count_outputs(readout: nn.Module) -> int:
        for module in readout.modules():
            if isinstance(module, nn.Linear):
                return module.out_features
        raise ValueError(f"cannot find the output size of the readout {type(readout).__name__}")

    @property
    def device(self) -> torch.device:
        return module_device(self.readout)

    def _gatherable(self) -> bool:
        return self._plain_linear and _readable(self.readout)

    def _step_on(self, index: int, step: nn.Module, device: torch.device) -> nn.Module:
        """``step`` itself where it computes on ``device``; else a local copy when it is plain (a norm's weights
        cross devices once instead of every hidden state), else ``step`` (quantized, adapter: inputs go to it)."""
        device = _indexed(device)
        if module_device(step) == device or not (_plain(step) and all(_readable(sub) for sub in step.modules())):
            return step
        key = (index, device)
        if key not in self._replicas:
            self._replicas[key] = _replica(step, device)
        return self._replicas[key]

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """Everything before the readout (final norm, pooler transform...), applied to every position.

        Computed on ``hidden``'s device (the block's own, under a device_map) wherever the steps allow.
        """
        for index, step in enumerate(self._steps):
            if isinstance(step, nn.Module):
                step = self._step_on(index, step, hidden.device)
                hidden = hidden.to(module_device(step))
            hidden = step(hidden)
        return hidden

    def _post(self, logits: torch.Tensor) -> torch.Tensor:
        for op, value in self._post_ops:
            logits = op(logits, value)
        return logits

    @contextlib.contextmanager
    def reading(self):
        """Hold an offloaded readout's weights across several reads: an offloaded module loads its whole weight
        on every call or ``align_module_device``, so the final logits and every layer's target rows of one
        forward share one load. ``with head.reading(): head.logits(...); head.target_logits(...)``"""
        offloaded = any(param.device.type == "meta" for param in self.readout.parameters(recurse=False))
        if self._held or not offloaded or not self._gatherable():
            yield
            return
        with _weights_materialized(self.readout):
            self._held = True
            try:
                yield
            finally:
                self._held = False

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """All outputs of HoT for ``features`` of shape (..., d): use only on a few positions."""
        if self._held:  # a plain Linear with its weights already materialized: calling it would load them again
            weight = self.readout.weight
            return self._post(F.linear(features.to(weight.device), weight, self.readout.bias)).float()
        return self._post(self.readout(features.to(self.device))).float()

    def _target_rows(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The readout's weight rows (rows, k, d) and bias (rows, k) for ``targets``, read once per targets
        tensor (one per forward, shared by all layers): reading an offloaded head loads its whole weight."""
        if self._rows is None or self._rows[0] is not targets:
            with contextlib.nullcontext() if self._held else _weights_materialized(self.readout):
                weight, bias = self.readout.weight, self.readout.bias
                index = targets.to(weight.device)
                self._rows = (targets, weight[index], None if bias is None else bias[index])
        return self._rows[1], self._rows[2]

    def target_logits(self, features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """HoT outputs for ``targets`` only.

        ``features``: (rows, seq, d); ``targets``: (rows, k) label ids. Returns float32 (rows, seq, k), on
        ``features``' device when the readout is a plain Linear: only its k target rows travel there, so
        under a device_map each layer is scored where its block ran and only scores cross devices.
        """
        if self._gatherable():
            rows, bias = self._target_rows(targets)
            out = torch.einsum("rsd,rkd->rsk", features, rows.to(features.device, features.dtype))
            if bias is not None:
                out = out + bias.to(out.device, out.dtype)[:, None, :]
        else:
            full = self.readout(features.to(self.device))
            out = full.gather(-1, targets.to(full.device)[:, None, :].expand(-1, full.shape[1], -1))
        return self._post(out).float()
