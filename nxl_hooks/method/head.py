"""The head-on-top (HoT) applied per token: ``features`` (final norm and any pre-head transform), then a
readout that gathers only the target rows of the last linear map, then elementwise logit post-processing.

    head = Head(model, spec, kind)
    with head.reading() as readout:                       # one per forward or generation step
        readout.explain(hidden, targets)                  # (rows, seq, k) float32, from a layer's hidden states
        feats = head.features(hidden)                     # (rows, seq, d'): final norm, pooler...
        readout.target_logits(feats, targets)             # the same, from features already made
        readout.logits(feats[:, -1])                      # every output, for a few positions

Where the final norm is an RMS norm straight before the readout (Llama, Mistral, Qwen, Gemma, Granite...),
:meth:`Readout.explain` folds it into the gathered rows: HoT(h)[y] = rsqrt(mean(h²) + eps) · (h · (g ⊙ W[y])), so no
normalized copy of a whole layer is made. The fold is taken only for float32 norms whose output it reproduces on
test vectors when the head is built, and not under autocast; every other head calls its own modules.

A head module tensor parallelism shards (``tp_plan``: DTensor weights, lm_head) is read from a full copy on every
rank, made when the head is built and again by :meth:`Head.refresh` when its weights change: calling the sharded
module is a collective, and each rank scores its records when it chooses (a callback on one rank, a slow streamer),
so a rank waiting in it while the others ran on into the next forward would hang them all.

Kept apart from the hooks: everything here is a function of hidden states and the model's own modules. A
Head holds no per-call state, so calls from several threads can share one.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..arch.registry import (FUNCTION_STEPS, POST_STEPS, ArchSpec, UnknownArchitectureError, get_path,
                             readout_outputs, spec_head, split_post_steps)
from .placement import (DeviceOf, full, indexed, module_device, offloaded, plain, readable, replica, sharded,
                        weights_materialized)
from .scores import row_norms

__all__ = ["CALLED_READOUT_BYTES", "CALLED_READOUT_CHUNK", "Head", "Readout", "replaced", "same_weights",
           "weights_state"]

#: Positions per call of a readout that cannot be gathered row by row: (rows, this, vocabulary) floats at once, fewer
#: where those would pass CALLED_READOUT_BYTES (many rows: a batch's every position and layer at one step).
CALLED_READOUT_CHUNK = 256
CALLED_READOUT_BYTES = 64 << 20


def _own_hooks(module: nn.Module, hooks: dict) -> list[tuple[Callable, bool]]:
    """(hook, takes kwargs) of the hooks in ``hooks`` (one of ``module``'s hook dicts) that are ``module``'s own
    bound methods: a quantizer puts those there as part of what the module computes (optimum-quanto's QLinear and
    QLayerNorm quantize their input and output activations in them), not a user watching its calls."""
    with_kwargs = {**module._forward_pre_hooks_with_kwargs, **module._forward_hooks_with_kwargs}
    return [(hook, key in with_kwargs) for key, hook in hooks.items() if getattr(hook, "__self__", None) is module]


def _unhooked(step: nn.Module | Callable, hidden: torch.Tensor) -> torch.Tensor:
    """``step`` applied to ``hidden`` without its torch hooks, when it is a module, but for its own
    (:func:`_own_hooks`): the others on the model's modules are the user's (collecting the final norm's outputs,
    say) and must see the model's own calls only, not the probe's on every layer. Its ``forward`` attribute, not
    the class's: accelerate patches offloading in there."""
    if not isinstance(step, nn.Module):
        return step(hidden)
    args, kwargs = (hidden,), {}
    for hook, keywords in _own_hooks(step, step._forward_pre_hooks):
        result = hook(step, args, kwargs) if keywords else hook(step, args)
        if result is not None:
            if keywords:
                args, kwargs = result
            else:
                args = result if isinstance(result, tuple) else (result,)
    output = step.forward(*args, **kwargs)
    for hook, keywords in _own_hooks(step, step._forward_hooks):
        result = hook(step, args, kwargs, output) if keywords else hook(step, args, output)
        if result is not None:
            output = result
    return output


def _activation(config, attribute: str) -> Callable[[torch.Tensor], torch.Tensor]:
    from transformers.activations import ACT2FN

    return ACT2FN[getattr(config, attribute)]


@dataclass(frozen=True)
class _RmsFold:
    """An RMS norm ``g ⊙ h · rsqrt(mean(h²) + eps)`` (float32), to be folded into the readout's rows; ``g`` is its
    weight plus ``offset`` (Gemma's 1 + w), read from the weight at each use (a weight trained or loaded while
    attached is the one applied)."""

    module: nn.Module  #: the norm, whose ``weight`` (d,) float32 is read at each use
    offset: float  #: 0, or 1 for a norm that scales by 1 + w
    eps: float

    @classmethod
    def of(cls, module: nn.Module) -> "_RmsFold | None":
        """The fold of ``module`` when it is such a norm, checked against its own output; else None."""
        eps = next((getattr(module, name) for name in ("variance_epsilon", "eps", "epsilon")
                    if isinstance(getattr(module, name, None), (int, float))), None)
        weight = getattr(module, "weight", None)
        if eps is None or not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.dtype != torch.float32 \
                or not plain(module) or offloaded(module):
            return None
        d, device = weight.shape[0], weight.device
        with torch.no_grad():
            gain = _unhooked(module, torch.ones(1, d, device=device))[0] * math.sqrt(1.0 + eps)  # mean(1²) = 1
            offset = next((offset for offset in (0.0, 1.0)
                           if torch.allclose(gain, weight + offset, rtol=1e-5, atol=1e-6)), None)
            if offset is None:
                return None
            fold = cls(module=module, offset=offset, eps=float(eps))
            probe = torch.randn(8, d, generator=torch.Generator().manual_seed(0)).to(device) * 3.0
            folded = probe * torch.rsqrt(probe.pow(2).mean(-1, keepdim=True) + eps) * fold.gain
            if not torch.allclose(_unhooked(module, probe), folded, rtol=1e-5, atol=1e-6):
                return None
        return fold

    @property
    def gain(self) -> torch.Tensor:
        """The effective weight ``g`` (d,), as the norm's weight holds it now."""
        weight = self.module.weight.detach()
        return weight + self.offset if self.offset else weight

    def holds(self, hidden: torch.Tensor) -> bool:
        """Whether folding still computes what the norm does for ``hidden``: checked (:meth:`of`) in float32, it
        stops holding once the model is cast to 16 bits while attached, where the norm rounds its output before the
        head multiplies and the fold would multiply in 16 bits first and apply the float32 scale after; nor once the
        norm is offloaded while attached (``cpu_offload(model)``), whose weight then waits on ``meta``: it is called."""
        return hidden.dtype == torch.float32 and self.module.weight.dtype == torch.float32 \
            and not offloaded(self.module)

    def scale(self, hidden: torch.Tensor) -> torch.Tensor:
        """rsqrt(mean(h²) + eps) per position: (..., 1)."""
        norm = row_norms(hidden, keepdim=True)
        return torch.rsqrt(norm.square() / hidden.shape[-1] + self.eps)


def weights_state(module: nn.Module) -> tuple[tuple[weakref.ref, int | None], ...]:
    """What changes when ``module``'s weights do (trained, loaded while attached): each one, by a weak reference, and
    its version (inference tensors keep no version: the tensor alone). Not by id(): a weight replaced twice may be
    given the address, so the id, of the first, at the same version; weakly, so that a replaced weight (a large
    shard) is not kept alive by the state. Compare with :func:`same_weights`."""
    state = []
    for parameter in module.parameters():
        try:
            state.append((weakref.ref(parameter), parameter._version))
        except RuntimeError:
            state.append((weakref.ref(parameter), None))
    return tuple(state)


def same_weights(state: tuple, now: tuple) -> bool:
    """Whether two :func:`weights_state` of a module hold the same weights at the same versions."""
    return len(state) == len(now) and all(kept() is not None and kept() is weight() and version == current
                                          for (kept, version), (weight, current) in zip(state, now))


#: The name of the pre-hook PEFT puts on its modules for a call given ``adapter_names`` (``peft.tuners.lora.model``).
_PEFT_ROW_ADAPTERS = "_adapter_names_pre_forward_hook"


def replaced(path: str) -> RuntimeError:
    """Why a forward is not recorded where the model's module at ``path``, one the probe reads or hooks, is another
    module than when the probe attached: the one it knows no longer runs."""
    return RuntimeError(f"the model's {path} is another module than when the probe attached (an adapter put on it or "
                        "unloaded, resize_token_embeddings, a module assigned in its place): detach and attach again")


def _handed_on(module: nn.Module, name: str) -> bool:
    """Whether ``module`` gives its attribute ``name`` from a module it picks at each access, not as its own: PEFT's
    ModulesToSaveWrapper hands on the active adapter's copy's, or the original's under ``disable_adapter()``."""
    return not (name in module._modules or name in module._parameters or name in module._buffers
                or name in vars(module) or hasattr(type(module), name))


def _as_readout_reads(readout: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``hidden`` in the dtype a plain 16-bit Linear readout computes in: where the steps before it give float32
    (Mamba's norm_f on its float32 residual stream), the model's own head casts to its weight's dtype, and a plain
    Linear computes in nothing else. Any other readout is handed ``hidden`` as it is: a quantized weight's dtype
    (bitsandbytes' 4-bit storage, fp8) is not what it computes in, and autocast picks the product's dtype itself."""
    weight = getattr(readout, "weight", None)  # (PEFT's wrappers hand on the base layer's)
    if (hidden.dtype == torch.float32 and type(weight) in (nn.Parameter, torch.Tensor)
            and weight.dtype in (torch.float16, torch.bfloat16) and not torch.is_autocast_enabled(hidden.device.type)):
        return hidden.to(weight.dtype)
    return hidden


class _Through(nn.Module):
    """A head step inside a module that hands its attributes on (:func:`_handed_on`), looked up through it at each
    call: the module the model runs now (that adapter's copy, or the original) is the one the records apply."""

    def __init__(self, holder: nn.Module, path: str) -> None:
        super().__init__()
        self.holder, self.path = holder, path

    @property
    def now(self) -> nn.Module:
        return get_path(self.holder, self.path)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return _unhooked(self.now, hidden)


def _head_step(model: nn.Module, path: str) -> tuple[nn.Module | None, str, nn.Module | None]:
    """(the step at ``path``, or a :class:`_Through` where the path runs into a module that hands it on; the path
    and the module that must stay the model's for the step to be the one attached: that holder, else the step)."""
    parts = path.split(".")
    for index in range(1, len(parts)):
        holder = get_path(model, ".".join(parts[:index]))
        if isinstance(holder, nn.Module) and _handed_on(holder, parts[index]):
            rest = ".".join(parts[index:])
            get_path(holder, rest)  # (AttributeError when it has none)
            return _Through(holder, rest), ".".join(parts[:index]), holder
    step = get_path(model, path)
    return step, path, step


class Head:
    """HoT of one task model, built from its :class:`~nxl_hooks.arch.ArchSpec`."""

    def __init__(self, model: nn.Module, spec: ArchSpec, kind: str) -> None:
        spec_kind = spec_head(kind)
        names, post = split_post_steps(spec.heads[spec_kind])
        #: (op, config attribute) of each logit post-processing step, its value read at each reading (Gemma 2 and
        #: Granite read theirs from the config at each forward: a value changed while attached is the one applied);
        #: the config object is the one the model's modules hold
        self._post_steps = [(POST_STEPS[op], attribute) for op, _, attribute in (step.partition(":") for step in post)]
        self._config = model.config
        steps: list[nn.Module | Callable] = []
        self._model = weakref.ref(model)
        #: (path, module) of each module step as at attach, or of the module that hands it on (:class:`_Through`)
        self._modules: list[tuple[str, nn.Module]] = []
        for step in names:
            if step in FUNCTION_STEPS:
                steps.append(FUNCTION_STEPS[step])
            elif step.startswith("act:"):
                steps.append(_activation(model.config, step[4:]))
            else:
                try:
                    module, kept, holder = _head_step(model, step)
                except (AttributeError, IndexError):
                    raise UnknownArchitectureError(
                        f"{type(model).__name__} has no module {step!r}, which the {spec_kind!r} head of registry "
                        f"entry {spec.name!r} ({spec.source}) names: this model is a variant the entry does not "
                        "cover; register it with nxl.register_architecture(...) or fix the registry/*.toml entry"
                    ) from None
                if module is not None:
                    steps.append(module)
                    self._modules.append((kept, holder))
        #: (module, its full copy, the module's weights' state when copied) for each module tensor parallelism shards:
        #: the head computes with the copy (see the module docstring)
        self._copies: list[tuple[nn.Module, nn.Module, tuple]] = []
        for index, step in enumerate(steps):
            if isinstance(step, nn.Module) and sharded(step):
                steps[index] = replica(step, module_device(step))
                self._copies.append((step, steps[index], weights_state(step)))
        readout = steps.pop()
        if not isinstance(readout, nn.Module):
            raise ValueError(f"spec {spec.name!r}: the last head step must be a module (the readout), got {readout}")
        self._steps = steps
        self._where = {index: DeviceOf(step) for index, step in enumerate(steps) if isinstance(step, nn.Module)}
        self._replicas: dict[tuple[int, torch.device], tuple[nn.Module, tuple]] = {}
        self._lock = threading.Lock()  # replicas are made once per device; offloaded weights are loaded one at a time
        self.readout = readout
        self.n_outputs = self._count_outputs(readout.now if isinstance(readout, _Through) else readout)
        #: Only a plain Linear can be gathered row by row: bitsandbytes' Linear4bit/8bitLt subclass nn.Linear but
        #: store packed weights, torchao keeps nn.Linear with a quantized weight tensor, and PEFT wrappers route to
        #: the active adapter: those are called. Decided once: it is asked per forward and per generated token.
        self.gatherable = type(readout) is nn.Linear and plain(readout) and readable(readout)
        #: Whether a position's outputs are a function of that position alone: not where a quantized or adapter
        #: module is called, whose output for one position may depend on the others in its call (bitsandbytes'
        #: 8-bit layer picks its outlier columns over its whole input), so that the head on every position of a
        #: layer misses the model's own call on its prediction rows; there l = L is pinned to the model's logits
        self.per_position = self.gatherable and all(plain(step) for step in steps if isinstance(step, nn.Module))
        #: the final norm, when it can be folded into gathered rows (see the module docstring)
        self._fold = _RmsFold.of(steps[0]) if self.gatherable and len(steps) == 1 \
            and isinstance(steps[0], nn.Module) else None

    @staticmethod
    def _count_outputs(readout: nn.Module) -> int:
        outputs = readout_outputs(readout)
        if outputs is None:
            raise ValueError(f"cannot find the output size of the readout {type(readout).__name__}")
        return outputs

    @property
    def device(self) -> torch.device:
        """Where the readout computes."""
        return module_device(self.readout)

    @property
    def _offloaded(self) -> bool:
        """Whether the readout's weights wait on ``meta`` now: asked at each reading, not once, since a model
        offloaded with accelerate after attaching (``cpu_offload(model)``) has them there from then on."""
        return offloaded(self.readout)

    @property
    def readable_elsewhere(self) -> bool:
        """Whether the readout may be read in another thread while the model runs (the record pipeline scores
        generated tokens there): a plain Linear whose weights stay where they are, read row by row, never called.
        An offloaded readout's weights are loaded into the module for each call, the model's own included, and a
        quantized or adapter-wrapped one is called (bitsandbytes' 8-bit layer sets its state in its forward): those
        are read only between the model's forwards, in its thread."""
        return self.gatherable and not self._offloaded

    def _step_on(self, index: int, step: nn.Module, device: torch.device) -> nn.Module:
        """For a ``step`` that computes elsewhere than ``device``: a local copy when it is plain (a norm's weights
        cross devices once instead of every hidden state, and again when they change), else ``step`` (quantized,
        adapter: inputs go to it)."""
        if not (plain(step) and all(readable(sub) for sub in step.modules())):
            return step
        key = (index, device)
        state = weights_state(step)
        made = self._replicas.get(key)
        if made is None or not same_weights(made[1], state):
            with self._lock:
                made = self._replicas.get(key)
                if made is None or not same_weights(made[1], state):
                    made = self._replicas[key] = (replica(step, device), state)
        return made[0]

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """Everything before the readout (final norm, pooler transform...), applied to every position.

        Computed on ``hidden``'s device (the block's own, under a device_map) wherever the steps allow.
        """
        for index, step in enumerate(self._steps):
            if isinstance(step, nn.Module):
                device = indexed(hidden.device)
                if self._where[index]() != device:
                    step = self._step_on(index, step, device)
                    hidden = hidden.to(module_device(step))
            hidden = _unhooked(step, hidden)
        return _as_readout_reads(self.readout.now if isinstance(self.readout, _Through) else self.readout, hidden)

    def _post_values(self) -> list[tuple[Callable[[torch.Tensor, float], torch.Tensor], float]]:
        """The logit post-processing steps with their config values as they are now (a step whose value is None is
        skipped, as transformers does): read once per reading, Python floats off the config, no tensor read.

        RuntimeError where the model also keeps a number of its own under the attribute's name that differs from
        the config's: Cohere copies ``logit_scale`` from the config when built and applies its copy, GraniteMoE
        copies ``logits_scaling`` and applies the config's; either way one of the two changed while attached, and
        which one the forward applies is not known here."""
        model, values = self._model(), []
        for op, attribute in self._post_steps:
            value = getattr(self._config, attribute, None)
            own = vars(model).get(attribute) if model is not None else None
            if isinstance(own, (int, float)) and not isinstance(own, bool) and own != value:
                raise RuntimeError(f"the model's config.{attribute} is {value!r} but its own {attribute} is {own!r} "
                                   f"({type(model).__name__} copied it from the config when built, and applies one "
                                   "of the two to its logits): set both to the value meant")
            if value is not None:
                values.append((op, float(value)))
        return values

    def refresh(self) -> None:
        """Gather again the sharded modules whose weights changed since copied (trained, loaded while attached). A
        collective: call it only where every rank is at the same point, the start of each of the model's forwards."""
        for index, (module, copy, state) in enumerate(self._copies):
            now = weights_state(module)
            if not same_weights(state, now):
                with torch.no_grad():
                    copy.load_state_dict({name: full(tensor.detach()) for name, tensor in module.state_dict().items()})
                self._copies[index] = (module, copy, now)

    def mixed_adapters(self) -> RuntimeError | None:
        """Why the forward running now cannot be scored, where PEFT runs it as a mixed-adapter batch
        (``adapter_names=[...]``: one adapter per row, or ``"__base__"``, handed to its modules by a pre-hook it puts
        on them for that call) and a module of the head is one of those: the records call the head on every layer
        after the model's own call, with the active adapter, not each row's. None otherwise: PEFT's modules in the
        blocks alone leave the head the same for every row."""
        if "peft" not in sys.modules:  # (no such pre-hook without PEFT: asked at every forward, a walk of the head)
            return None
        for path, module in self._modules:
            for sub in module.modules():
                if any(getattr(getattr(hook, "func", None), "__name__", None) == _PEFT_ROW_ADAPTERS
                       for hook in sub._forward_pre_hooks.values()):
                    return RuntimeError(
                        f"PEFT runs this forward with adapter_names (a mixed-adapter batch): the model's {path} "
                        "applies one adapter per row, which the records cannot apply row by row; call the PeftModel "
                        "once per adapter (set_adapter, or disable_adapter() for '__base__')")
        return None

    def _unchanged(self) -> None:
        """RuntimeError when a module of the head is no longer the model's (replaced while attached: an adapter put
        on the readout, ``resize_token_embeddings``, an adapter unloaded): the records would read the one before;
        or when a sharded module's weights changed since :meth:`refresh` last copied them."""
        model = self._model()
        for path, module in self._modules if model is not None else ():
            if get_path(model, path) is not module:
                raise replaced(path)
        for module, _, state in self._copies:
            if not same_weights(state, weights_state(module)):
                raise RuntimeError(f"the weights of the model's tensor-parallel {type(module).__name__} changed after "
                                   "the forward being scored began, so its record would read the old ones; change "
                                   "weights between calls, not while one is being recorded")

    @contextlib.contextmanager
    def reading(self) -> Iterator["Readout"]:
        """One call's view of the readout: an offloaded readout's weights are loaded once for the whole block
        (they load on every call or ``align_module_device`` otherwise), and only one thread at a time holds
        them, since loading swaps the module's parameters in place. RuntimeError when the model's head changed
        since (:meth:`_unchanged`) or its post-processing values disagree (:meth:`_post_values`)."""
        self._unchanged()
        post = self._post_values()
        if not self._offloaded:
            yield Readout(self, post, held=False, gathers=self.gatherable)
            return
        with self._lock:
            # (readable asked again: a readout offloaded once attached, cpu_offload(model.lm_head), may be one that
            # weights_materialized cannot load)
            if not (self.gatherable and readable(self.readout)):  # called: accelerate loads the weights in each call
                yield Readout(self, post, held=False, gathers=False)
                return
            with weights_materialized(self.readout):
                yield Readout(self, post, held=True, gathers=True)


class Readout:
    """The readout of a :class:`Head` inside one :meth:`Head.reading` block; gathered rows are kept per block, and
    the logit post-processing values are those read when the block began."""

    def __init__(self, head: Head, post: list[tuple[Callable[[torch.Tensor, float], torch.Tensor], float]], *,
                 held: bool, gathers: bool) -> None:
        self._head = head
        self._post_ops = post
        self._held = held
        self._gathers = gathers  #: the head's gatherable, unless its readout can only be called now
        self._rows: dict[bool, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}  # folded -> rows

    def post(self, logits: torch.Tensor) -> torch.Tensor:
        """The logit post-processing the task model applies after its readout (softcap, scale, divide)."""
        for op, value in self._post_ops:
            logits = op(logits, value)
        return logits

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """All outputs of HoT for ``features`` of shape (..., d), float32: use only on a few positions."""
        head, readout = self._head, self._head.readout
        if self._held:  # a plain Linear with its weights materialized: calling it would load them again
            weight = readout.weight
            return self.post(F.linear(features.to(weight.device), weight, readout.bias)).float()
        return self.post(_unhooked(readout, features.to(head.device))).float()

    def _target_rows(self, targets: torch.Tensor, *, folded: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The readout's weight rows (rows, k, d) and bias (rows, k) for ``targets`` (``folded``: times the folded
        norm's gain), read once per targets tensor, shared by every layer scored with it."""
        cached = self._rows.get(folded)
        if cached is None or cached[0] is not targets:
            readout = self._head.readout
            weight, bias = readout.weight, readout.bias
            index = targets.to(weight.device)
            rows = weight[index] * self._head._fold.gain.to(weight.device) if folded else weight[index]
            cached = self._rows[folded] = (targets, rows, None if bias is None else bias[index])
        return cached[1], cached[2]

    def _gathered(self, values: torch.Tensor, targets: torch.Tensor, *, folded: bool) -> torch.Tensor:
        rows, bias = self._target_rows(targets, folded=folded)
        rows = rows.to(values.device, values.dtype).transpose(1, 2)
        bias = None if bias is None else bias.to(values.device, values.dtype)[:, None, :]
        # bmm, not matmul: for these (rows, n, d) x (rows, d, k = 1) shapes (a generation step, over its whole
        # context) matmul takes an intra-op-parallel path that cost up to 10x more on 2 busy CPU cores; bmm was
        # never slower (equal on one thread)
        batched = values.dim() == 3 and rows.shape[0] == values.shape[0]
        if batched and bias is not None and not folded:
            # the bias added inside the product and rounded once, as nn.Linear's addmm does: added after it, a
            # bf16 / fp16 logit is rounded twice and misses the model's own by a step
            return self.post(torch.baddbmm(bias, values, rows)).float()
        out = torch.bmm(values, rows) if batched else torch.matmul(values, rows)
        if folded:
            out = out * self._head._fold.scale(values)
        if bias is not None:
            out = out + bias
        return self.post(out).float()

    def explain(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """HoT outputs for ``targets`` from a layer's hidden states (rows, seq, d): the folded norm where there is
        one (while it :meth:`~_RmsFold.holds`), else :meth:`target_logits` of the head's features. float32
        (rows, seq, k).

        Not folded under autocast: the model rounds its normed features to 16 bits and then multiplies, where the
        fold would multiply in 16 bits first and apply the float32 scale after, missing its logits by a rounding."""
        fold = self._head._fold
        if self._gathers and fold is not None and fold.holds(hidden) \
                and not torch.is_autocast_enabled(hidden.device.type):
            return self._gathered(hidden, targets, folded=True)
        return self.target_logits(self._head.features(hidden), targets)

    def target_logits(self, features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """HoT outputs for ``targets`` only.

        ``features``: (rows, seq, d); ``targets``: (rows, k) label ids. Returns float32 (rows, seq, k), on
        ``features``' device when the readout is a plain Linear: only its k target rows travel there, so
        under a device_map each layer is scored where its block ran and only scores cross devices. A readout
        that must be called (quantized, adapter) computes every output, CALLED_READOUT_CHUNK positions at a time
        (fewer: CALLED_READOUT_BYTES).
        """
        head = self._head
        if self._gathers:
            return self._gathered(features, targets, folded=False)
        parts = []
        rows = features.shape[0]
        chunk = max(1, min(CALLED_READOUT_CHUNK, CALLED_READOUT_BYTES // (4 * rows * head.n_outputs)))
        for part in features.split(chunk, dim=1):
            full = _unhooked(head.readout, part.to(head.device))
            parts.append(self.post(full.gather(-1, targets.to(full.device)[:, None, :].expand(-1, full.shape[1], -1)))
                         .float())
        return torch.cat(parts, dim=1)
