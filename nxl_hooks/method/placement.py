"""Where a module computes and whether its weights can be read directly: devices under a device_map,
accelerate's CPU/disk offload, and quantized or adapter-wrapped modules (SPEC section 3).

    module_device(model.lm_head)     # accelerate's execution device when offloaded, else its weights' device
    input_device(model)              # where token ids go: the input embedding's device
    plain(model.lm_head)             # ordinary float weights, no adapter routing: readable row by row
    sharded(model.lm_head)           # DTensor weights (tensor parallel): calling it is a collective
"""

from __future__ import annotations

import contextlib
import copy
import enum
from typing import Any

import torch
from torch import nn

__all__ = ["DEQUANTIZED_FROM", "DeviceOf", "full", "input_device", "module_device", "offloaded", "plain",
           "quantization", "readable", "replica", "sharded", "weights_materialized"]


def module_device(module: nn.Module) -> torch.device:
    """Where ``module`` computes: accelerate's execution device when offloaded, else its weights' device."""
    hook = getattr(module, "_hf_hook", None)
    hooks = getattr(hook, "hooks", (hook,))  # a SequentialHook holds several
    execution_device = next((h.execution_device for h in hooks if getattr(h, "execution_device", None) is not None), None)
    if execution_device is not None:
        if isinstance(execution_device, int):
            execution_device = f"cuda:{execution_device}"
        return indexed(torch.device(execution_device))
    for tensor in module.parameters():
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


class DeviceOf:
    """:func:`module_device` of one module, looked up again only when its first parameter moves or accelerate's hook
    on it changes: asked on every forward and every generated token, where the full lookup walks the parameters.

    ``where = DeviceOf(model.model.norm); where()``
    """

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._anchor = next(module.parameters(), None)
        self._key: tuple | None = None
        self._device = torch.device("cpu")

    def __call__(self) -> torch.device:
        key = (vars(self._module).get("_hf_hook"), None if self._anchor is None else self._anchor.device)
        if key != self._key:
            self._key, self._device = key, module_device(self._module)
        return self._device


def input_device(model: nn.Module) -> torch.device:
    """Where ``model``'s token ids must go: its input embedding's device, also under a device_map."""
    embeddings = getattr(model, "get_input_embeddings", None)
    return module_device(embeddings() if callable(embeddings) else model)


def indexed(device: torch.device) -> torch.device:
    """``device`` with its index: tensors report "cuda:0" where accelerate may say "cuda"; compare like with like."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def plain(module: nn.Module) -> bool:
    """Only ordinary float weights, no adapter routing: the module can be read row by row or copied.

    bitsandbytes (Params4bit, Int8Params), optimum-quanto and torchao store weights as tensor subclasses,
    and PEFT wrappers pick the active adapter at call time: those must be called where they live.
    """
    return all(
        type(param) in (nn.Parameter, torch.Tensor) and type(param.data) is torch.Tensor and param.is_floating_point()
        for param in module.parameters()
    ) and not any(type(sub).__module__.startswith("peft.") for sub in module.modules())


def sharded(module: nn.Module) -> bool:
    """Some of its weights are DTensors: tensor parallelism (``tp_plan``) splits them over the ranks, and calling
    the module is a collective every rank must enter at the same point."""
    return any(hasattr(param, "full_tensor") for param in module.parameters())


def full(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` whole on this rank: a DTensor is gathered (a collective), any other tensor is returned as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def offloaded(module: nn.Module) -> bool:
    """Some of its own weights wait on ``meta`` for accelerate to load them at call time, or accelerate's offload hook
    on it has loaded them for a call under way (in another thread, which sets them back to ``meta`` when it ends):
    asked while the model runs, the answer must not depend on when."""
    hook = getattr(module, "_hf_hook", None)
    hooks = getattr(hook, "hooks", (hook,))  # (cpu_offload of a bare module: its offload hook in a SequentialHook)
    return any(getattr(each, "offload", False) is True for each in hooks) \
        or any(param.device.type == "meta" for param in module.parameters(recurse=False))


def readable(module: nn.Module) -> bool:
    """Its own weights can be read directly: they are on a real device, or offloaded behind accelerate's offload
    hook, which :func:`weights_materialized` undoes. (``disk_offload`` on a bare Linear wraps that hook in a
    SequentialHook, which it does not: such a module is only ever called.)"""
    if not offloaded(module):
        return True
    from accelerate.utils import has_offloaded_params

    return has_offloaded_params(module)


#: The attribute of a model whose weights a loader read from a quantized file and dequantized into plain tensors
#: (``load_model`` of a GGUF file), holding that file's quantization as plain JSON data:
#: ``{"quant_method": "gguf", "file_type": "MOSTLY_Q4_1", "tensor_types": {"F32": 61, "Q4_1": 210, "Q8_0": 1},
#: "dequantized_to": "float32"}``. On the model object, not its config: ``save_pretrained`` writes neither it nor
#: anything it says (the weights it saves are the plain ones), and a config carries no nxl_hooks field.
DEQUANTIZED_FROM = "_nxl_hooks_dequantized_from"


def quantization(model: nn.Module) -> dict[str, Any] | None:
    """How ``model``'s weights are quantized, as its config says (``config.quantization_config``: the quantizer's
    ``quant_method`` and its settings that are plain values), and what they were dequantized from
    (:data:`DEQUANTIZED_FROM`, a GGUF file's quantization); None for plain weights read as they are stored.
    ``quantization(model_4bit)["bnb_4bit_quant_type"] == "nf4"``; a GGUF file's model: its
    ``{"quant_method": "gguf", "file_type": ..., ...}``, and quantized again in memory, the quantizer's settings with
    that under ``"dequantized_from"``. Records carry it, so that a quantized model's numbers say which quantization
    made them. A new copy each call: its nested dicts are the caller's to change."""
    source = getattr(model, DEQUANTIZED_FROM, None)
    quantized = _configured(model)
    if source is None:
        return quantized
    if quantized is None:
        return copy.deepcopy(source)
    return {**quantized, "dequantized_from": copy.deepcopy(source)}


def _configured(model: nn.Module) -> dict[str, Any] | None:
    """``model``'s ``config.quantization_config`` as plain values (:func:`quantization`), or None without one."""
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    if config is None:
        return None
    try:  # a quantizer's own code: one that fails to describe itself is named by its class, never stops an attach
        settings = config.to_dict() if callable(getattr(config, "to_dict", None)) else config
    except Exception:  # noqa: BLE001
        settings = None
    if not isinstance(settings, dict):
        return {"quant_method": type(config).__name__}
    # (a private key repeats a public one; an object, such as torchao's quant_type, would not be JSON)
    plain = {key: value.value if isinstance(value, enum.Enum) else value for key, value in settings.items()
             if isinstance(key, str) and not key.startswith("_")}
    return {key: value for key, value in plain.items() if value is None or isinstance(value, (str, int, float, bool))}


def weights_materialized(module: nn.Module):
    """Offloaded weights sit on ``meta`` outside their forward; this brings them in for a direct read."""
    if not hasattr(module, "_hf_hook"):
        return contextlib.nullcontext()
    from accelerate.utils import align_module_device

    return align_module_device(module)


#: accelerate's hook attributes, and the ``forward`` that it and transformers' tensor parallelism put on a module
_ACCELERATE_ATTRIBUTES = ("_hf_hook", "_old_forward", "forward")


def replica(module: nn.Module, device: torch.device) -> nn.Module:
    """A hook-free copy of a small plain module (a final norm) on ``device``, or whole on every rank of one that
    tensor parallelism shards (a collective: every rank must make it at the same point).

    accelerate's hook attributes are set aside during the copy: deep-copying them would copy the offload map
    (the whole offloaded state dict); offloaded weights are read under :func:`weights_materialized`.
    """
    saved = [(sub, {key: sub.__dict__.pop(key) for key in _ACCELERATE_ATTRIBUTES if key in sub.__dict__})
             for sub in module.modules()]
    # the weights are loaded below, not deep-copied (a DTensor cannot be): placeholders of their shape until then
    memo = {id(param): nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                     requires_grad=param.requires_grad)
            for param in module.parameters()}
    try:
        clone = copy.deepcopy(module, memo)
    finally:
        for sub, attributes in saved:
            sub.__dict__.update(attributes)
    with weights_materialized(module):
        state = {name: full(tensor.detach()).to(device, copy=True) for name, tensor in module.state_dict().items()}
    clone.load_state_dict(state, assign=True)
    return clone.to(device).eval()
