"""Forward hooks on a live model: capture each selected block's output, turn it into HoT features at once,
and assemble the attribution when the backbone's forward returns.

One probe per model at a time. Hooks sit on the backbone (``model.base_model``), its blocks and, for
``embedding="word"``, the input embedding; nothing else on the model is touched, and :meth:`Probe.detach`
removes every handle (the ``with`` block does it also when the user's forward raised).
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, Union

import torch
from torch import nn

from .attribution import Attribution
from .head import Head
from .generation import _Generation
from .registry import _get_path, resolve
from .stream import GenerationCall, Sink, Step, _Hub, _Subscription

__all__ = ["attach", "Probe", "Target"]

Target = Union[str, int, Sequence[Union[str, int]], torch.Tensor]

_ATTACHED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside a PeftModel (the same object PEFT forwards through)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _hidden(output: Any) -> torch.Tensor:
    # Most transformers v5 blocks return a tensor; Falcon, Bloom, MPT, GPT-J, DeBERTa-v2 return tuples.
    return output[0] if isinstance(output, (tuple, list)) else output


def resolve_layers(layers: str | int | Sequence[int], n_blocks: int) -> list[int]:
    """``"all"`` -> 0..L, ``"last"`` -> [L], ints (negative from the end) -> sorted unique layer indices."""
    if layers == "all":
        return list(range(n_blocks + 1))
    if layers == "last":
        return [n_blocks]
    if isinstance(layers, str):
        raise ValueError(f"layers={layers!r}: use 'all', 'last' or a list of ints in 0..{n_blocks}")
    wanted = [layers] if isinstance(layers, int) else list(layers)
    if not wanted:
        raise ValueError("layers is empty: use 'all', 'last' or a list of ints")
    out = []
    for layer in wanted:
        index = layer + n_blocks + 1 if layer < 0 else layer
        if not 0 <= index <= n_blocks:
            raise ValueError(
                f"layer {layer} is out of range: this model has {n_blocks} blocks, so layers are 0..{n_blocks} "
                f"(0 = input of block 1, {n_blocks} = output of the last block) or -{n_blocks + 1}..-1"
            )
        out.append(index)
    return sorted(set(out))


@dataclass
class _Pass:
    """What one backbone forward has captured so far."""

    input_ids: torch.Tensor | None
    attention_mask: torch.Tensor | None
    embed_norm: torch.Tensor | None = None
    features: dict[int, torch.Tensor] = field(default_factory=dict)


def _check_range(ids: torch.Tensor, n_outputs: int) -> None:
    bad = ids[(ids < 0) | (ids >= n_outputs)]
    if bad.numel():
        raise ValueError(f"target {int(bad[0])} is out of range: the head has {n_outputs} outputs (0..{n_outputs - 1})")


def resolve_target_id(model: nn.Module, kind: str, tokenizer: Any, item: str | int, n_outputs: int) -> int:
    """One target or label -> an output id of the head: an int id (range-checked), a label name
    (classification), or one token (LM; a vocabulary entry like "Ġis" first, else text that encodes to
    one known token). ``resolve_target_id(model, "causal_lm", tok, " Paris", len(tok))``; ValueError if bad.
    """
    if isinstance(item, bool) or not isinstance(item, (int, str)):
        raise ValueError(f"target/label {item!r} must be an int id or a string, got {type(item).__name__}")
    if isinstance(item, int):
        _check_range(torch.tensor([item]), n_outputs)
        return item
    label2id = getattr(model.config, "label2id", None) or {}
    if kind in ("sequence_classification", "regression") and item in label2id:
        return int(label2id[item])
    if kind in ("sequence_classification", "regression"):
        raise ValueError(f"label {item!r} is not one of the model's labels {sorted(label2id)}; or pass an int id")
    if tokenizer is None:
        raise ValueError(f"target {item!r} is a string: pass attach(..., tokenizer=tok) to resolve it, or an int id")
    vocab = tokenizer.get_vocab()
    if item in vocab:
        return int(vocab[item])
    ids = tokenizer.encode(item, add_special_tokens=False)
    if len(ids) != 1 or ids[0] == tokenizer.unk_token_id:
        raise ValueError(
            f"target {item!r} is not a single token in the vocabulary (it encodes to {len(ids)} id(s) {ids}); "
            "pass one token (see tokenizer.tokenize(text)) or its int id"
        )
    return int(ids[0])


class Probe:
    """Hooks of one :func:`attach` call. ``with nxl.attach(model) as probe: model(**enc)``, then ``probe.result()``."""

    def __init__(
        self,
        model: nn.Module,
        *,
        layers: str | int | Sequence[int] = "all",
        target: Target = "predicted",
        tokenizer: Any = None,
        embedding: str = "layer_input",
        on_step: Callable[[Step], Any] | None = None,
        sink: str | Path | Sink | None = None,
        keep_steps: bool = True,
        cache_dtype: torch.dtype | None = None,
        cache_device: str | torch.device | None = None,
    ) -> None:
        self.model = _unwrap(model)
        self.spec, self.kind = resolve(self.model)
        self.head = Head(self.model, self.spec, self.kind)
        self.blocks: nn.ModuleList = _get_path(self.model, self.spec.blocks)
        self.n_blocks = len(self.blocks)
        self.layers = resolve_layers(layers, self.n_blocks)
        if embedding not in ("layer_input", "word"):
            raise ValueError(f"embedding={embedding!r}: use 'layer_input' (default) or 'word'")
        self.embedding = embedding
        self.tokenizer = tokenizer
        if self.kind == "masked_lm" and getattr(tokenizer, "mask_token_id", None) is None:
            raise ValueError("masked-LM attribution needs attach(..., tokenizer=tok) with a mask token, to find the "
                             "[MASK] positions it explains")
        self._check_tokenizer()
        self.target = target
        self._fixed_targets = None if self._is_predicted(target) else self._target_ids(target)
        self._backbone = _get_path(self.model, self.spec.backbone) if self.spec.backbone else self.model.base_model
        self._signature = inspect.signature(self._backbone.forward)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._pass: _Pass | None = None
        self._last: Attribution | None = None
        self._generation: _Generation | None = None
        self._attach()
        try:  # after _attach's double-attach check, so a refused probe never truncates a sink file
            self._generation = _Generation(self, _Hub(on_step=on_step, sink=sink, keep_steps=keep_steps),
                                           cache_dtype=cache_dtype, cache_device=cache_device)
        except BaseException:
            self.detach()
            raise

    # -- attach / detach ---------------------------------------------------------------------------------

    def _attach(self) -> None:
        if self._backbone in _ATTACHED:
            raise RuntimeError(
                "a probe is already attached to this model: leave the first `with nxl.attach(...)` block "
                "(or call probe.detach()) before attaching again"
            )
        _ATTACHED.add(self._backbone)
        try:
            self._handles.append(self._backbone.register_forward_pre_hook(self._on_backbone_start, with_kwargs=True))
            self._handles.append(self._backbone.register_forward_hook(self._on_backbone_end))
            self._handles.append(self.blocks[0].register_forward_pre_hook(self._on_block_input, with_kwargs=True))
            for index, block in enumerate(self.blocks, start=1):
                if index in self.layers or index == self.n_blocks:
                    self._handles.append(block.register_forward_hook(self._block_hook(index)))
            if self.embedding == "word":
                embed = self.model.get_input_embeddings()
                self._handles.append(embed.register_forward_hook(self._on_word_embedding))
        except BaseException:
            self.detach()
            raise

    def detach(self) -> None:
        """Remove every hook of this probe; the model is as it was before :func:`attach`."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._pass = None
        try:
            if self._generation is not None:
                self._generation.close()  # may raise (a sink on a full disk): the model is free all the same
        finally:
            _ATTACHED.discard(self._backbone)

    @property
    def attached(self) -> bool:
        """True until :meth:`detach` (or the end of the ``with`` block)."""
        return bool(self._handles)

    def __enter__(self) -> "Probe":
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # -- hooks -------------------------------------------------------------------------------------------

    def _on_backbone_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        bound = self._signature.bind_partial(*args, **kwargs).arguments
        input_ids = bound.get("input_ids")
        reference = input_ids if input_ids is not None else bound.get("inputs_embeds")
        if reference is None or reference.shape[1] == 0 or reference.shape[0] == 0:
            raise ValueError("empty input: nxl_hooks needs at least one token per row (got a zero-length batch)")
        self._pass = _Pass(input_ids=input_ids, attention_mask=bound.get("attention_mask"))
        if self._generating:
            self._generation.before_forward(bound)

    def _on_block_input(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._pass is None:
            raise RuntimeError(
                f"{type(self.model).__name__} ran its blocks without calling {type(self._backbone).__name__}.forward, "
                "so nxl_hooks saw no input_ids: set `backbone` (the module that takes input_ids and runs the blocks) "
                f"in the registry entry for {self.model.config.model_type!r}"
            )
        hidden = args[0] if args else kwargs["hidden_states"]
        with torch.no_grad():
            if self.embedding == "layer_input":
                self._pass.embed_norm = hidden.detach().float().norm(dim=-1)
            if 0 in self.layers:
                self._pass.features[0] = self._to_features(hidden.detach())

    def _to_features(self, hidden: torch.Tensor) -> torch.Tensor:
        # While generating, block outputs stay raw and become features in one call per forward, all layers
        # stacked (nxl_hooks/generation.py): one-token decoding steps would pay the head's overhead per layer.
        return hidden if self._generating else self.head.features(hidden)

    def _on_word_embedding(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if self._pass is None:  # the embedding called on its own, outside a forward of the model
            return
        # Gemma-style scaled embeddings multiply inside the module; the paper's norm is of the raw row.
        scale = getattr(module, "embed_scale", None)
        rows = output.detach().float()
        if scale is not None:
            rows = rows / scale.to(rows.device).float()
        self._pass.embed_norm = rows.norm(dim=-1)

    def _block_hook(self, index: int):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            with torch.no_grad():
                self._pass.features[index] = self._to_features(_hidden(output).detach())

        return hook

    def _on_backbone_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._pass.embed_norm is None:
            raise ValueError("embedding='word' needs input_ids: the word-embedding module did not run "
                             "(inputs_embeds given); use embedding='layer_input'")
        with torch.no_grad():
            if self._generating:  # features only: the readout is read when the step's token is known
                self._generation.after_forward(self._pass)
            else:
                with self.head.reading():  # an offloaded head is loaded once, not once per layer
                    self._last = self._assemble(self._pass)
        self._pass = None

    # -- generation (see nxl_hooks/generation.py) ---------------------------------------------------------

    @property
    def _generating(self) -> bool:
        return self._generation is not None and self._generation.active

    @property
    def calls(self) -> list[GenerationCall]:
        """One entry per ``generate`` call run while attached, in order, each with its step records."""
        return self._generation.hub.calls if self._generation is not None else []

    @property
    def steps(self) -> list[Step]:
        """The step records of the last ``generate`` call (one per emitted token); earlier calls: :attr:`calls`."""
        if not self.calls:
            raise RuntimeError(
                "no generate() call has run under this probe: call model.generate(...) inside the `with` block "
                "(for a plain forward, use probe.result())"
            )
        return self.calls[-1].steps

    def stream(self) -> _Subscription:
        """Iterate over step records as they are made, from another thread than the one running ``generate``.

        Yields the records of the ``generate`` call running now (from its first step; with ``keep_steps=False``
        from the next step) or, if none is, of the next one, and stops when that call returns or raises, or when
        the probe detaches. Subscribe before starting the generation, so the stream cannot miss it::

            steps = probe.stream()
            threading.Thread(target=model.generate, kwargs=enc).start()
            for step in steps: print(step.step, step.token)
        """
        if self._generation is None or not self.attached:
            raise RuntimeError("this probe is detached: call probe.stream() inside the `with nxl.attach(...)` block")
        return self._generation.hub.subscribe()

    # -- assembling --------------------------------------------------------------------------------------

    def result(self) -> Attribution:
        """The attribution of the last forward run while attached."""
        if self._last is None:
            raise RuntimeError("no forward has run under this probe yet: call the model inside the `with` block")
        return self._last

    def _rows(self, p: _Pass, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(example, position) of every explained row."""
        device = p.embed_norm.device
        batch = p.embed_norm.shape[0]
        examples = torch.arange(batch, device=device)
        if self.kind == "masked_lm":
            mask_id = getattr(self.tokenizer, "mask_token_id", None)
            if mask_id is None or p.input_ids is None:
                raise ValueError("masked-LM attribution needs input_ids and attach(..., tokenizer=tok) with a mask token")
            examples, positions = (p.input_ids == mask_id).nonzero(as_tuple=True)
            if examples.numel() == 0:
                raise ValueError(f"no mask token ({self.tokenizer.mask_token!r}) in the input: nothing to explain")
            return examples.to(device), positions.to(device)
        if self.kind == "causal_lm" or self.spec.pooling == "last_non_pad":
            pad_id = self.model.config.get_text_config().pad_token_id
            if self.kind == "causal_lm" and p.attention_mask is not None:
                real = p.attention_mask.to(device).bool()
            elif self.kind != "causal_lm" and pad_id is not None and p.input_ids is not None:
                real = p.input_ids.to(device) != pad_id  # as transformers pools decoder classifiers
            else:
                return examples, torch.full((batch,), seq - 1, device=device)
            index = torch.arange(seq, device=device)
            return examples, (index * real).argmax(-1)
        return examples, torch.zeros(batch, dtype=torch.long, device=device)

    @property
    def _label_axis(self) -> bool:
        """Whether scores get a trailing axis of k labels (a list target, or a (rows, k) id tensor)."""
        return isinstance(self.target, (list, tuple)) or (isinstance(self.target, torch.Tensor) and self.target.dim() == 2)

    @staticmethod
    def _is_predicted(target: Target) -> bool:
        return isinstance(target, str) and target == "predicted"

    def _explained(self, predicted: torch.Tensor) -> torch.Tensor:
        """The (rows, k) ids a forward or generation step explains: the fixed targets, else ``predicted`` (rows, 1)."""
        if self._fixed_targets is None:
            return predicted
        rows = predicted.shape[0]
        if self._fixed_targets.shape[0] not in (1, rows):
            raise ValueError(
                f"the target tensor has {self._fixed_targets.shape[0]} rows but this forward explains {rows} rows "
                "(one per example, per [MASK], or per generate row including num_return_sequences)"
            )
        return self._fixed_targets.to(predicted.device).expand(rows, -1)

    def _scores(self, logat: torch.Tensor, embed_norm: torch.Tensor, targets: torch.Tensor):
        """(logat, normxlogit, targets) from LogAt (layers, rows, seq, k) and the embedding norms (rows, seq);
        the label axis is dropped unless several labels were asked for."""
        normxlogit = embed_norm.to(logat.device)[None, :, :, None] * logat
        if self._label_axis:
            return logat, normxlogit, targets
        return logat[..., 0], normxlogit[..., 0], targets[:, 0]

    def _target_ids(self, target: Target) -> torch.Tensor:
        """Explicit targets as a (1, k) or (rows, k) id tensor, checked against the head's outputs."""
        if isinstance(target, torch.Tensor):
            if target.dim() > 2:
                raise ValueError(f"a target tensor is (rows,) or (rows, k) label ids, got shape {tuple(target.shape)}")
            ids = target.long().reshape(1, 1) if target.dim() == 0 else target.long()
            ids = ids[:, None] if ids.dim() == 1 else ids
        else:
            items = [target] if isinstance(target, (str, int)) else list(target)
            if not items:
                raise ValueError("target list is empty: give at least one label or token")
            n = self.head.n_outputs
            ids = torch.tensor([[resolve_target_id(self.model, self.kind, self.tokenizer, item, n) for item in items]])
        _check_range(ids, self.head.n_outputs)
        return ids

    def _check_tokenizer(self) -> None:
        if self.tokenizer is None:
            return
        rows = self.model.get_input_embeddings().num_embeddings
        if len(self.tokenizer) > rows:
            raise ValueError(
                f"the tokenizer does not match the model: it has {len(self.tokenizer)} tokens but the model's "
                f"embedding has {rows} rows; pass the tokenizer saved with this model"
            )

    def _assemble(self, p: _Pass) -> Attribution:
        seq = p.embed_norm.shape[1]
        examples, positions = self._rows(p, seq)
        last = p.features[self.n_blocks]  # under a device_map each layer's features stay on its block's device
        final = self.head.logits(last[examples.to(last.device), positions.to(last.device)])  # (rows, outputs)

        def by_row(values: torch.Tensor) -> torch.Tensor:
            # Masked LMs explain an example once per [MASK]; every other head explains each example once, and
            # indexing would copy every layer's features for nothing.
            return values[examples.to(values.device)] if self.kind == "masked_lm" else values

        if self.kind == "regression":
            targets = torch.zeros(len(examples), 1, dtype=torch.long, device=final.device)
        else:
            targets = self._explained(final.argmax(-1, keepdim=True))
        logat = torch.stack(
            [self.head.target_logits(by_row(p.features[layer]), targets).to(final.device) for layer in self.layers]
        )  # (layers, rows, seq, k)
        if self.kind == "regression":
            logat = (logat - final[:, 0][None, :, None, None]).abs()
        embed_norm = by_row(p.embed_norm).to(final.device)
        logat, normxlogit, targets = self._scores(logat, embed_norm, targets)
        mask = (
            by_row(p.attention_mask).to(final.device).bool()
            if p.attention_mask is not None
            else torch.ones_like(embed_norm, dtype=torch.bool)
        )
        tokens = None
        if self.tokenizer is not None and p.input_ids is not None:
            tokens = [self.tokenizer.convert_ids_to_tokens(row.tolist()) for row in by_row(p.input_ids).cpu()]
        return Attribution(
            normxlogit=normxlogit.cpu(),
            logat=logat.cpu(),
            embed_norm=embed_norm.cpu(),
            layers=list(self.layers),
            target=targets.cpu(),
            mask=mask.cpu(),
            position=positions.cpu(),
            example=examples.cpu(),
            tokens=tokens,
            meta={**self.describe(), "prediction": final.cpu().tolist() if self.kind == "regression" else None},
        )

    def describe(self) -> dict[str, Any]:
        """What a saved result records about the model and the probe: ``probe.describe()["head_kind"]``."""
        return {
            "model_type": self.model.config.model_type,
            "model_class": type(self.model).__name__,
            "head_kind": self.kind,
            "embedding": self.embedding,
            "n_blocks": self.n_blocks,
            "spec": self.spec.name,
        }


def attach(
    model: nn.Module,
    layers: str | int | Sequence[int] = "all",
    target: Target = "predicted",
    *,
    tokenizer: Any = None,
    embedding: str = "layer_input",
    on_step: Callable[[Step], Any] | None = None,
    sink: str | Path | Sink | None = None,
    keep_steps: bool = True,
    cache_dtype: torch.dtype | None = None,
    cache_device: str | torch.device | None = None,
) -> Probe:
    """Hook NormXLogit onto ``model`` (a transformers task model or a PeftModel) until the probe detaches.

    ``with nxl.attach(model, layers="all") as probe: model(**enc)`` then ``probe.result().normxlogit``;
    ``with nxl.attach(model) as probe: model.generate(**enc)`` then ``probe.steps`` (one record per new token).

    - ``layers``: "all" (0..L), "last" (L), or ints; negative ints count from the end.
    - ``target``: "predicted" (the model's own argmax at the prediction position), an int id, a token or
      label string, a list of them (adds a trailing axis of size k), or a (rows,) / (rows, k) id tensor.
    - ``tokenizer``: needed for token-string targets, masked LMs and token strings in the result.
    - ``embedding``: "layer_input" (input of block 1, default) or "word" (the raw word-embedding row).

    While ``generate`` runs (causal LMs; see :mod:`nxl_hooks.generation` and :mod:`nxl_hooks.stream`):

    - ``on_step``: called with each :class:`~nxl_hooks.stream.Step` as soon as it is complete;
    - ``sink``: a file path (or :class:`~nxl_hooks.stream.Sink`) the records are appended to, crash-safe;
      read it with ``nxl.read_stream(path)``;
    - ``keep_steps``: keep the records in ``probe.calls`` / ``probe.steps`` (set False to stream them only);
    - ``cache_dtype`` / ``cache_device``: where the per-layer feature cache lives (batch × d values per token
      per selected layer; e.g. ``torch.bfloat16``, ``"cpu"``).
    """
    return Probe(model, layers=layers, target=target, tokenizer=tokenizer, embedding=embedding, on_step=on_step,
                 sink=sink, keep_steps=keep_steps, cache_dtype=cache_dtype, cache_device=cache_device)
