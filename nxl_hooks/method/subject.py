"""The model an attach explains, resolved once: the transformers task model inside its wrappers, its registry
entry, its head and the head's kind. Built once per :func:`~nxl_hooks.attach` (or :func:`~nxl_hooks.explain`)
and passed on to everything that needs one of them, so nothing resolves the model a second time.

    subject = Subject.of(torch.compile(peft_model))
    subject.model is peft_model.get_base_model(); subject.kind is HeadKind.CAUSAL_LM; subject.head.n_outputs

Unwrapping lives here, not in ``arch``: which wrappers a model can come in (``torch.compile``'s OptimizedModule,
PEFT's PeftModel) is a fact about how a model is run, not about where an architecture keeps its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..arch.registry import (ArchSpec, HeadKind, UnknownArchitectureError, blocks, get_path, head_kind,
                             layer_modules, resolve)
from .head import Head
from .verify import check_numbers

__all__ = ["PROMPT_LEARNING", "Subject", "compiled_original", "unwrap"]

#: The PEFT adapter kinds (``peft_type``) that prepend virtual tokens to the input embeddings of every forward.
PROMPT_LEARNING = ("PROMPT_TUNING", "P_TUNING", "MULTITASK_PROMPT_TUNING")


def compiled_original(model: nn.Module) -> nn.Module | None:
    """The module ``torch.compile(module)`` wrapped (its ``_orig_mod``), when ``model`` is such a wrapper; else None."""
    inner = model._modules.get("_orig_mod") if type(model).__name__ == "OptimizedModule" else None
    return inner if isinstance(inner, nn.Module) else None


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside a ``torch.compile`` wrapper and/or a PeftModel (the object PEFT forwards
    through); any other model as is. ``unwrap(torch.compile(peft_model)) is peft_model.get_base_model()``"""
    model = compiled_original(model) or model
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


@dataclass(frozen=True, eq=False)
class Subject:
    """A model resolved once (:meth:`of`); read-only, shared by every call an attach records, in any thread."""

    given: nn.Module  #: the model as the user gave it (a torch.compile wrapper, a PeftModel, or the model itself)
    model: nn.Module  #: the transformers task model inside it (:func:`unwrap`)
    spec: ArchSpec
    kind: HeadKind
    head: Head
    blocks: nn.ModuleList

    def _peft_virtual(self, kinds: tuple[str, ...]) -> int:
        """The virtual tokens of the model as given's active PEFT adapter when its kind is one of ``kinds``, else 0."""
        config = getattr(compiled_original(self.given) or self.given, "active_peft_config", None)
        if getattr(config, "peft_type", None) not in kinds:  # (PeftType is a str enum)
            return 0
        return int(getattr(config, "num_virtual_tokens", 0) or 0)

    @property
    def virtual_tokens(self) -> int:
        """Positions a KV cache holds before the tokens of a plain forward of the model as given that are no input
        tokens: the virtual tokens of PEFT prefix tuning (its active adapter's), else 0."""
        return self._peft_virtual(("PREFIX_TUNING",))

    @property
    def prompt_tokens(self) -> int:
        """Positions a plain forward of the model as given runs before its input tokens, as embeddings of their own
        (no token ids): the virtual tokens PEFT prompt tuning and P-tuning (its active adapter's) prepend to the
        input embeddings, else 0."""
        return self._peft_virtual(PROMPT_LEARNING)

    @property
    def layer_modules(self) -> list[nn.Module]:
        """The module whose output is h[l], for l = 1..L (:func:`~nxl_hooks.arch.registry.layer_modules`): what the
        probe's hooks read the residual stream from."""
        return layer_modules(self.model, self.spec)

    @property
    def backbone(self) -> nn.Module:
        """The module whose forward runs the blocks: the spec's ``backbone``, else ``model.base_model``."""
        return get_path(self.model, self.spec.backbone) if self.spec.backbone else self.model.base_model

    @classmethod
    def of(cls, model: nn.Module | Subject) -> Subject:
        """Resolve ``model`` (a Subject is returned as it is): unwrap it, find its registry entry and head kind,
        build its head, and check its registry entry against the model's own numbers, once, unless it is a shipped
        entry on a class it is tested for (:func:`~nxl_hooks.arch.registry.is_tested`). Raises
        UnknownArchitectureError / RegistryError / ValueError as :func:`~nxl_hooks.arch.registry.resolve`."""
        if isinstance(model, Subject):
            return model
        inner = unwrap(model)
        head_kind(inner)  # what is no task model at all is refused as such first
        # a torch module of one's own named like a task model: what a probe reads of every model would otherwise be
        # an AttributeError deep inside attach
        lacks = [member for member in ("get_input_embeddings", "base_model") if not hasattr(inner, member)]
        if lacks:
            raise UnknownArchitectureError(
                f"{type(inner).__name__} lacks {' and '.join(lacks)}, which every transformers model has: nxl_hooks "
                "explains transformers models; subclass transformers.PreTrainedModel (its base_model_prefix naming "
                "the backbone, get_input_embeddings returning the word embedding)")
        spec, kind = resolve(inner)
        head = Head(inner, spec, kind)
        block_list = blocks(inner, spec)
        check_numbers(inner, spec, kind, head, block_list)  # an entry untested on this class: refused if off
        return cls(given=model, model=inner, spec=spec, kind=kind, head=head, blocks=block_list)
