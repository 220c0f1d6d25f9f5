"""Fixed device tensors that hooks traced into compiled code write, step after step, for an engine to read after
the step: how a serving engine records a model it runs compiled (torch.compile, CUDA graphs).

    buffers = Buffers(slots=2, rows=max_tokens, width=(d,), dtype=torch.float32, device="cuda")
    buffers.tap(0, model.embed_tokens, lambda output: output)        # after each forward of the module
    buffers.tap_input(1, model.layers[0], lambda args, kwargs: args[0])  # before it
    model_step()                                                      # compiled, or a CUDA graph replaying
    buffers.values[1, :tokens]                                        # that step's rows, on the device
    buffers.remove()

Hooks added after torch.compile traced a module never run (dynamo does not guard on an empty hook dict), and a CUDA
graph replays only what it captured. Hooks put on before the trace or the capture are traced or captured with the
model: each write here is one ``copy_`` of the step's rows into a tensor whose address never changes, with no read
of the device, no Python branch on a tensor's values and no allocation, so it runs inside the compiled code or the
graph. The engine maps rows to requests after the step, on the host, with what its scheduler already holds. Used by
the vLLM engine (:mod:`.vllm`) and transformers' continuous batching (:mod:`.transformers_cb_step`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..guard import SHORT, Owned

__all__ = ["Buffers"]


class Buffers:
    """``values``: (slots, rows, *width) on the device; row t of slot s is what the hook of slot s read from the
    step's packed token t (its ``read`` gives a tensor of any leading shape, flattened to (tokens, *width)).

    ``when``: a check the hooks make before writing (a Python condition, constant for a trace: dynamo guards on
    it), e.g. that the forward is the engine's own; None: always. A forward with more tokens than ``rows`` writes
    nothing. The hooks stay until :meth:`remove`; code compiled with them recompiles when they go (dynamo guards on
    the number of hooks it traced), and a CUDA graph that captured them writes here for as long as it lives, so
    whoever holds such a graph keeps these tensors alive. Each is :class:`~..guard.Owned`, as every hook of the
    probe's: a copy of the model made while they are on (``copy.deepcopy``, ``torch.save``) gets hooks that do
    nothing, never ones writing here.
    """

    def __init__(self, slots: int, rows: int, width: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device | str, when: Callable[[], bool] | None = None) -> None:
        self.values = torch.zeros(slots, rows, *width, dtype=dtype, device=device)
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self._when = when

    @property
    def rows(self) -> int:
        return self.values.shape[1]

    def _write(self, slot: int) -> Callable[[torch.Tensor], None]:
        row, width = self.values[slot], self.values.shape[2:]

        def write(value: torch.Tensor) -> None:
            flat = value.detach().reshape(-1, *width)
            if flat.shape[0] <= row.shape[0]:  # static under compile and in a graph: a guard, not a device read
                row[: flat.shape[0]].copy_(flat)

        return write

    def tap(self, slot: int, module: nn.Module, read: Callable[[Any], torch.Tensor]) -> None:
        """After each forward of ``module``: ``read(output)`` into slot ``slot``."""
        write, when = self._write(slot), self._when

        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if when is None or when():  # checked first: an eager forward that is not the engine's computes nothing
                write(read(output))

        self.handles.append(module.register_forward_hook(Owned(hook)))

    def tap_input(self, slot: int, module: nn.Module, read: Callable[[tuple, dict], torch.Tensor]) -> None:
        """Before each forward of ``module``: ``read(args, kwargs)`` into slot ``slot``."""
        write, when = self._write(slot), self._when

        def hook(module: nn.Module, args: tuple, kwargs: dict = SHORT) -> None:
            if kwargs is not SHORT and (when is None or when()):  # (SHORT: called after its removal)
                write(read(args, kwargs))

        self.handles.append(module.register_forward_pre_hook(Owned(hook), with_kwargs=True))

    def remove(self) -> None:
        """The hooks off (the tensors stay, for whoever still reads or replays into them)."""
        while self.handles:
            self.handles.pop().remove()
