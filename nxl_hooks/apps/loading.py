"""Load a task model and its tokenizer from a local folder or a hub id, picking the head from the config.

    model, tokenizer = load_model("./my-model")            # or "org/name" on the hub
    model, tokenizer = load_model("gpt2", head="causal_lm")

A local folder and a hub id both go through ``from_pretrained``; a path that does not exist is an error
here (not a hub lookup), so a typo in a path fails fast with a clear message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["HEAD_CLASSES", "head_from_architectures", "load_model"]

#: The Auto class per head kind the library explains (regression loads as sequence classification).
HEAD_CLASSES = {
    "causal_lm": "AutoModelForCausalLM",
    "sequence_classification": "AutoModelForSequenceClassification",
    "masked_lm": "AutoModelForMaskedLM",
}
_SUFFIXES = {
    "ForCausalLM": "causal_lm",
    "LMHeadModel": "causal_lm",
    "ForSequenceClassification": "sequence_classification",
    "ForMaskedLM": "masked_lm",
}


def head_from_architectures(architectures: list[str] | None) -> str | None:
    """The head kind named by ``config.architectures`` (``["BertForMaskedLM"]`` -> ``"masked_lm"``), or None."""
    for name in architectures or ():
        for suffix, kind in _SUFFIXES.items():
            if name.endswith(suffix):
                return kind
    return None


def _check_local(name: str) -> None:
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{name} has no config.json: pass a folder written by model.save_pretrained() (with its tokenizer)"
            )
        return
    # Hub ids are "name" or "org/name"; anything else that does not exist is a mistyped path.
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name:
        raise FileNotFoundError(f"no model folder at {name}: check the path (or pass a hub id like org/name)")


def load_model(name: str, head: str | None = None, **kwargs: Any) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for a local folder or hub id, in eval mode.

    ``head``: "causal_lm", "sequence_classification" or "masked_lm"; by default the one
    ``config.architectures`` names. ``kwargs`` go to the model's ``from_pretrained`` (dtype, device_map, ...).
    """
    import transformers

    _check_local(name)
    config = transformers.AutoConfig.from_pretrained(name)
    kind = head or head_from_architectures(getattr(config, "architectures", None))
    if kind is None:
        raise ValueError(
            f"{name}: config.architectures ({getattr(config, 'architectures', None)}) names no head that "
            f"NormXLogit explains; pass --head with one of {', '.join(HEAD_CLASSES)}"
        )
    if kind not in HEAD_CLASSES:
        raise ValueError(f"head {kind!r}: use one of {', '.join(HEAD_CLASSES)}")
    model = getattr(transformers, HEAD_CLASSES[kind]).from_pretrained(name, config=config, **kwargs)
    tokenizer = transformers.AutoTokenizer.from_pretrained(name)
    return model.eval(), tokenizer
