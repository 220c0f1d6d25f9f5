"""Attribution while ``model.generate`` runs: one :class:`~nxl_hooks.stream.Step` per emitted token, KV cache kept.

    with nxl.attach(model, tokenizer=tok) as probe:
        out = model.generate(**enc, max_new_tokens=32)
    probe.steps[-1].normxlogit    # (len(layers), batch, context_len)

How. :func:`~nxl_hooks.attach` sets a thin wrapper as the model instance's ``generate`` (removed at detach; a
text-generation pipeline and ``PeftModel.generate`` both end up in it). The wrapper only marks where a call starts
and ends and reads generate's return value; the user's call is unchanged. Inside it the probe's hooks see one
prefill forward with the whole prompt (or several, with ``prefill_chunk_size``), then one forward per new token
with one position and a KV cache holding everything before it. Each forward's block outputs (all selected layers
stacked, one head call) become head features and are appended to the feature cache, so the prefix is never re-run.
The prediction read at the last position explains the token generate emits next. That token is known only at the
next forward (its ``input_ids``) or, for the last one, which never passes through the blocks, from generate's
return value; so step t's record is completed when forward t+1 starts (or when generate returns). It explains the
token actually emitted, whatever chose it: greedy, sampling, logits processors, a streamer or not.

Memory. The feature cache is the only thing that grows with the context: per selected layer and token, batch × d
values of ``cache_dtype`` (d: the head's feature size, the hidden size for most decoders; default dtype: the
model's), e.g. 512 × 4 B = 2 KiB per token per layer for a float32 model with d = 512 at batch 1; plus, per
token, batch × (4 B embedding norm + 1 B mask). Its capacity doubles as it grows, so at most twice that is
allocated. It lives on ``cache_device`` (default: the last selected block's device, where the layers meet under a
device_map); ``cache_device="cpu"`` keeps it off the accelerator, and the per-step dot products then run on the
CPU. Nothing vocabulary-sized is kept: per step only the emitted token's row of the readout is read, once for all
layers (a quantized or adapter-wrapped readout is called instead, which is vocabulary-sized while it runs).
The records themselves are the caller's: 2 × 4 B × layers × batch × context per step (normxlogit and logat);
``keep_steps=False`` with ``on_step`` / ``sink`` streams them out without keeping them.

Not supported while attached, with a clear error: beam search (beams are reordered and pruned between steps, so a
row is not one sequence), assisted / speculative decoding and generate resuming from a filled ``past_key_values``
(positions the probe never saw). ``num_return_sequences`` with sampling works: its rows are independent sequences.
"""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING, Any, Callable

import torch

from .stream import GenerationCall, Step, _Hub

if TYPE_CHECKING:
    from .capture import Probe, _Pass


#: Positions per call of a readout that cannot be gathered row by row: (batch, this, vocabulary) floats at once.
_CALLED_READOUT_CHUNK = 256


class _Growing:
    """A (batch, n, ...) tensor growing along dim 1; capacity doubles so appends cost amortized O(new)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self.n = 0

    def truncate(self, n: int) -> None:
        self.n = min(self.n, n)

    def append(self, values: torch.Tensor) -> None:
        need = self.n + values.shape[1]
        buffer = self._buffer
        if buffer is None or need > buffer.shape[1]:
            capacity = max(need, 2 * (buffer.shape[1] if buffer is not None else 0), 16)
            grown = values.new_empty((values.shape[0], capacity, *values.shape[2:]))
            if buffer is not None:
                grown[:, : self.n] = buffer[:, : self.n]
            self._buffer = buffer = grown
        buffer[:, self.n: need] = values
        self.n = need

    def view(self) -> torch.Tensor:
        return self._buffer[:, : self.n]


def _cached_length(past: Any) -> int:
    get = getattr(past, "get_seq_length", None)
    return int(get()) if callable(get) else 0


class _Generation:
    """Per-call state of the probe while ``generate`` runs; the probe's hooks call :meth:`before_forward` and
    :meth:`after_forward` when :attr:`active`."""

    def __init__(self, probe: "Probe", hub: _Hub, *, cache_dtype: torch.dtype | None,
                 cache_device: str | torch.device | None) -> None:
        self._probe = probe
        self.hub = hub
        self._cache_dtype = cache_dtype
        self._cache_device = torch.device(cache_device) if cache_device is not None else None
        self._restore: tuple[bool, Callable] | None = None
        self._call: GenerationCall | None = None
        self._owner: int | None = None  # the thread running the tracked generate call
        if probe.kind == "causal_lm" and callable(getattr(probe.model, "generate", None)):
            self._install()

    @property
    def active(self) -> bool:
        return self._call is not None

    # -- the generate wrapper ----------------------------------------------------------------------------

    def _install(self) -> None:
        model = self._probe.model
        original = model.generate
        own = "generate" in vars(model)

        @functools.wraps(original)
        def generate(*args: Any, **kwargs: Any) -> Any:
            return self._run(original, args, kwargs)

        model.generate = generate
        self._restore = (own, original)

    def close(self) -> None:
        """Give the model its own ``generate`` back and end the streams (the probe detaches)."""
        if self._restore is not None:
            own, original = self._restore
            if own:
                self._probe.model.generate = original
            else:
                vars(self._probe.model).pop("generate", None)
            self._restore = None
        self.hub.close()

    def _run(self, original: Callable, args: tuple, kwargs: dict) -> Any:
        if self.active and threading.get_ident() != self._owner:
            raise RuntimeError("another generate() is running under this probe in another thread: the hooks keep one "
                               "call's state, so run one generate at a time, or attach a probe per model copy")
        if self.active:  # generate calling generate (custom decoding): the outer call is already tracked
            return original(*args, **kwargs)
        self._owner = threading.get_ident()
        self._start(args, kwargs)
        try:
            out = original(*args, **kwargs)
        except BaseException:
            self._stop(None)
            raise
        self._stop(out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None))
        return out

    def _setting(self, kwargs: dict, name: str) -> Any:
        config = kwargs.get("generation_config") or getattr(self._probe.model, "generation_config", None)
        value = kwargs.get(name)
        return value if value is not None else getattr(config, name, None)

    def _start(self, args: tuple, kwargs: dict) -> None:
        if (self._setting(kwargs, "num_beams") or 1) > 1:
            raise ValueError(
                "beam search (num_beams > 1) cannot be attributed step by step: beams are reordered and pruned "
                "between steps, so a row is not one sequence. Use num_beams=1 (greedy, or do_sample=True; "
                "num_return_sequences works with sampling), or generate outside the `with nxl.attach(...)` block."
            )
        if kwargs.get("assistant_model") is not None or self._setting(kwargs, "prompt_lookup_num_tokens"):
            raise ValueError(
                "assisted / speculative decoding feeds several candidate tokens per forward and drops some: not "
                "supported while attached. Generate without assistant_model / prompt_lookup_num_tokens."
            )
        prompt = args[0] if args else next(
            (kwargs[k] for k in ("inputs", "input_ids", "inputs_embeds") if kwargs.get(k) is not None), None)
        self._prompt_len: int | None = prompt.shape[1] if isinstance(prompt, torch.Tensor) and prompt.dim() > 1 else None
        eos = self._setting(kwargs, "eos_token_id")
        self._eos = torch.tensor([eos] if isinstance(eos, int) else list(eos or []), dtype=torch.long)
        self._features = _Growing()  # (batch, n, len(layers), d): all layers in one tensor, one head call per step
        self._embed, self._mask = _Growing(), _Growing()
        self._real: list[torch.Tensor] = []  # per generated position: is its token real (row not finished)?
        self._prompt_ids: list[torch.Tensor] = []
        self._finished: torch.Tensor | None = None
        self._compute_dtype: torch.dtype | None = None
        self._n = self._past = 0
        self._pending = False
        self._call = self.hub.begin(self._probe.layers)

    def _stop(self, sequences: torch.Tensor | None) -> None:
        call, self._call = self._call, None
        try:
            if sequences is not None and self._pending:
                emitted = self._n + 1 - self._prompt_len  # the pending token included
                # A deferred stop check (mps) may run one forward whose token generate then undoes.
                if sequences.shape[1] in (self._n + 1, emitted):
                    self._emit(sequences[:, -1], call)
        finally:
            self._features = self._embed = self._mask = None
            self.hub.end(call, sequences.cpu() if sequences is not None else None)

    # -- hooks -------------------------------------------------------------------------------------------

    def before_forward(self, bound: dict) -> None:
        """Check the forward continues what the probe holds; complete the pending step with its first token."""
        reference = bound.get("input_ids")
        reference = reference if reference is not None else bound.get("inputs_embeds")
        past, new, n = _cached_length(bound.get("past_key_values")), reference.shape[1], self._n
        decoding = self._prompt_len is not None and n >= self._prompt_len
        continues = past == n and (new == 1 or not decoding)
        recomputes = past == 0 and (n == 0 or (decoding and new == n + 1))  # first forward, or use_cache=False
        if not (continues or recomputes):
            raise RuntimeError(
                f"generate ran a forward on positions {past}..{past + new - 1} while the probe holds {n} positions: "
                "resuming from a filled past_key_values, assisted decoding or cache cropping is not supported "
                "while attached. Generate from the full prompt with a fresh cache."
            )
        if self._pending:
            ids = bound.get("input_ids")
            if ids is None:
                raise RuntimeError("generate fed embeddings instead of token ids while decoding: cannot tell the "
                                   "emitted token; pass input_ids to generate")
            self._emit(ids[:, n - past], self._call)
        self._past = past

    def after_forward(self, p: "_Pass") -> None:
        """Append this forward's features; its last position's prediction is the next pending step."""
        new = p.embed_norm.shape[1]
        for cache in (self._features, self._embed, self._mask):
            cache.truncate(self._past)
        layers = self._probe.layers
        # The hooks kept block outputs raw (Probe._to_features): one head call turns every layer into features.
        # Under a device_map they meet on the last selected block's device (one position per step moves).
        device = p.features[layers[-1]].device
        features = self._probe.head.features(torch.stack([p.features[layer].to(device) for layer in layers], dim=2))
        self._compute_dtype = features.dtype
        self._features.append(features.to(device=self._cache_device or features.device,
                                          dtype=self._cache_dtype or features.dtype))
        self._embed.append(p.embed_norm)
        self._mask.append(self._new_mask(p, new))
        if self._prompt_len is None:  # generate started from its bos token, not a prompt we were shown
            self._prompt_len = new
        self._n = self._past + new
        if self._call.prompt_mask is None:  # still in the prefill (which may come in chunks)
            if p.input_ids is not None:
                self._prompt_ids.append(p.input_ids[:, : self._prompt_len - self._past])
            if self._n >= self._prompt_len:
                ids = torch.cat(self._prompt_ids, dim=1).cpu() if self._prompt_ids else None
                self.hub.prompt(self._call, ids, self._mask.view()[:, : self._prompt_len].cpu(), self._probe.describe())
        self._pending = self._n >= self._prompt_len

    def _new_mask(self, p: "_Pass", new: int) -> torch.Tensor:
        attention = p.attention_mask
        if attention is not None and attention.dim() == 2:
            mask = attention[:, -new:].bool()
        else:  # generate drops an all-ones mask
            mask = torch.ones(p.embed_norm.shape[0], new, dtype=torch.bool, device=p.embed_norm.device)
        first_generated = max(self._prompt_len or new, self._past)
        if first_generated < self._past + new and self._real:
            real = torch.stack(self._real[first_generated - self._prompt_len:], dim=1).to(mask.device)
            mask = mask.clone()
            mask[:, first_generated - self._past:] &= real
        return mask

    # -- one record --------------------------------------------------------------------------------------

    def _emit(self, token: torch.Tensor, call: GenerationCall) -> None:
        probe, position = self._probe, self._n
        token = token.long()
        batch = token.shape[0]
        targets = probe._explained(token[:, None])
        with torch.no_grad():
            features = self._features.view().to(self._compute_dtype)  # (batch, position, layers, d)
            flat = features.reshape(batch, -1, features.shape[-1])  # every layer in one gather of target rows
            # A readout that must be called (quantized, adapter) returns every logit: bound that in chunks.
            chunk = flat.shape[1] if probe.head._gatherable() else _CALLED_READOUT_CHUNK
            logat = torch.cat([probe.head.target_logits(part, targets) for part in flat.split(chunk, dim=1)], dim=1)
            logat = logat.view(*features.shape[:3], -1).permute(2, 0, 1, 3)
            embed = self._embed.view()
            logat, normxlogit, targets = probe._scores(logat, embed, targets)
        if self._finished is None:
            self._finished = torch.zeros(batch, dtype=torch.bool, device=token.device)
        active = ~self._finished
        # copies, not views of the growing buffers, which a use_cache=False forward rewrites in place
        step = Step(call=call.index, step=position - self._prompt_len, position=position, token=token.cpu(),
                    target=targets.cpu(), normxlogit=normxlogit.cpu(), logat=logat.cpu(),
                    embed_norm=embed.to("cpu", copy=True), mask=self._mask.view().to("cpu", copy=True),
                    active=active.cpu(), layers=list(probe.layers), n_blocks=probe.n_blocks)
        self._real.append(active)
        self._finished = self._finished | torch.isin(token, self._eos.to(token.device))
        self._pending = False
        self.hub.publish(step)
