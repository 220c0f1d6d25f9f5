"""One forward explained, attach to detach: :func:`explain`.

    nxl.explain(model, tok, "The capital of France is", target="Paris").top(3)
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..arch.registry import HeadKind
from ..method.chat import chat_prompt, template_rows
from ..method.placement import input_device
from ..method.select import from_numpy, is_predicted, pad_token_id, prompt_targets
from ..method.subject import Subject
from ..records.attribution import Attribution
from ..records.tokens import describe_target
from .forward import check_tokens
from .guard import told_by_caller
from .plan import tokenizer_mismatch
from .probe import attach

__all__ = ["explain"]


def explain(model: nn.Module, tokenizer: Any, text: str | Sequence[str], *,
            text_pair: str | Sequence[str] | None = None, chat: bool = False, **options: Any) -> Attribution:
    """Attach, run one forward on ``text`` (a string or a batch of them, padded), detach: its attribution.

    ``nxl.explain(model, tok, "The capital of France is", layers="all", target="Paris").top(3)``; ``options`` go to
    :func:`attach`. Target words are read after the text (:func:`~nxl_hooks.method.select.prompt_targets`): "Paris"
    there explains ' Paris', the token the model would emit (a masked LM's: the token each mask would be filled with,
    a row per mask); ``res.meta["targets"]`` says how each was read (and when a word is several tokens, of which only
    the first is explained). ``chat``: each text becomes the user message of the tokenizer's chat template, followed
    by the assistant's turn. ``text_pair``: a classifier's second text for each text, encoded as the tokenizer
    encodes a sentence pair (``tokenizer(text, text_pair)``, its segment ids too): NLI's hypothesis, a question's
    passage (``nxl.explain(nli, tok, "A man plays a guitar.", text_pair="A man plays music.")``).
    """
    texts = [text] if isinstance(text, str) else list(text) if isinstance(text, Iterable) else []
    if not texts or not all(isinstance(one, str) for one in texts):
        raise ValueError(f"text is {text!r:.80}: give a string, or a non-empty list of strings (a batch)")
    subject = Subject.of(model)  # resolved once, for the targets and the attach
    if mismatch := tokenizer_mismatch(subject.model, tokenizer):  # (None too: the texts need one) before it is used
        raise ValueError(mismatch)
    pairs = _pairs(text_pair, texts, subject.kind, chat)
    prompts = [chat_prompt(tokenizer, one) for one in texts] if chat else []
    texts = [prompt.text for prompt in prompts] or texts
    target, resolved = from_numpy(options.pop("target", "predicted")), None  # (as attach takes a numpy array)
    if not is_predicted(target) and not isinstance(target, torch.Tensor):
        target, resolved = prompt_targets(subject.model, subject.kind, tokenizer, target, texts)
    # A batch is padded on the right whatever the tokenizer's side: each text keeps the positions it has alone (left
    # padding shifts a shorter text's on a model of absolute positions, GPT-2's: another forward than its own).
    encoding: dict[str, Any] = {"return_token_type_ids": False}
    # (a tokenizer without a pad token, as GPT-2's and Llama-2's ship, refuses padding=True: padded here instead)
    padded = len(texts) > 1 and getattr(tokenizer, "pad_token_id", None) is not None
    if padded:
        encoding.update(padding=True, padding_side="right", return_tensors="pt")
    single = isinstance(text, str)
    if pairs is not None:  # (segment ids as the tokenizer gives them for its model: BERT's, none for RoBERTa's)
        encoding.update(text_pair=pairs[0] if single else pairs, return_token_type_ids=None)
    if single:
        encoding["return_tensors"] = "pt"
    enc = tokenizer(texts[0] if single else texts, **encoding)
    if not single and not padded:
        # the model's own pad id first: a decoder classifier reads each row's prediction before the first of them
        filler = next((pad for pad in (pad_token_id(subject.model), getattr(tokenizer, "eos_token_id", None))
                       if pad is not None), 0)
        enc = _right_padded(enc, filler)
    enc = enc.to(input_device(model))
    check_tokens(enc["input_ids"])  # before the model's own error on no tokens (a reshape), not after it
    with _one_at_a_time(subject.backbone), torch.no_grad(), _evaluating(model), \
            attach(subject, tokenizer=tokenizer, target=target, **options) as probe:
        with told_by_caller():  # probe.result() raises why it is not recorded
            model(**enc)
    res = probe.result()
    if resolved is not None:
        res.meta["targets"] = [[describe_target(tokenizer, subject.model.config, subject.kind, one) for one in row]
                               for row in resolved]
    res.meta["chat"] = chat
    if chat:  # the template's markers and system prompt do not rank (method.select.rankable)
        template = template_rows(tokenizer, prompts, enc["input_ids"], enc.get("attention_mask"))
        if template is not None and template.shape[1] < res.mask.shape[1]:  # PEFT prompt tuning's virtual tokens
            template = torch.nn.functional.pad(template, (res.mask.shape[1] - template.shape[1], 0))  # come first
        res.template = None if template is None else template[res.example]
        res.meta["template"] = "located" if template is not None else "not located: every token ranks"
    return res


def _right_padded(encoded: Any, filler: int) -> Any:
    """A batch of encodings (lists of ids per text) as tensors, each row padded on the right to the longest: the ids
    with ``filler`` (an id the attention mask masks out), the mask and the other columns with 0."""
    longest = max(len(ids) for ids in encoded["input_ids"])
    for name, rows in encoded.items():
        fill = filler if name == "input_ids" else 0
        encoded[name] = torch.tensor([list(row) + [fill] * (longest - len(row)) for row in rows])
    return encoded


def _pairs(text_pair: Any, texts: list[str], kind: HeadKind, chat: bool) -> list[str] | None:
    """``text_pair`` as a list of one second text per text, None without it. ValueError for what a sentence pair's
    encoding cannot take: not strings, not one per text, a model that is not a classifier (a LM reads one text),
    a chat template's message."""
    if text_pair is None:
        return None
    pairs = [text_pair] if isinstance(text_pair, str) else list(text_pair) if isinstance(text_pair, Iterable) else []
    if not pairs or not all(isinstance(one, str) for one in pairs):
        raise ValueError(f"text_pair is {text_pair!r:.80}: give a string, or a list of strings, one per text")
    if len(pairs) != len(texts):
        raise ValueError(f"text_pair gives {len(pairs)} second texts for {len(texts)} texts: give one per text")
    if not kind.pooled:
        raise ValueError(f"text_pair is a classifier's second text, and this model is a {kind} model, which reads "
                         "one text: join the two into one text")
    if chat:
        raise ValueError("text_pair with chat=True: the chat template takes one message per text; give one of them")
    return pairs


def _fresh_locks() -> None:
    """No explain lock yet; in a forked child too, where a lock another thread of the parent held stays held."""
    global _LOCKS, _LOCKS_LOCK
    _LOCKS, _LOCKS_LOCK = weakref.WeakKeyDictionary(), threading.Lock()


_LOCKS: "weakref.WeakKeyDictionary[nn.Module, threading.RLock]"
_LOCKS_LOCK: threading.Lock
_fresh_locks()
os.register_at_fork(after_in_child=_fresh_locks)


@contextmanager
def _one_at_a_time(backbone: nn.Module) -> Iterator[None]:
    """Hold ``backbone``'s explain lock: one probe per model (attach refuses a second), so threads explaining one model
    at once (a server explaining each request) take turns instead of being refused, and one thread's eval mode is
    not given back under another's forward. Reentrant: an explain inside this thread's own (a hook of the user's)
    reaches attach, which says that a probe is attached."""
    with _LOCKS_LOCK:
        lock = _LOCKS.setdefault(backbone, threading.RLock())
    with lock:
        yield


@contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode for the one forward :func:`explain` runs, each module's own mode back after: a model
    left in training mode (just fine-tuned) ran its dropout there, and explained a random forward, not its
    prediction (scores and target changing from one call to the next)."""
    modes = [(module, module.training) for module in model.modules()]
    if not any(training for _, training in modes):
        yield
        return
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:  # parents first (modules() order): each child's call after its parent's
            module.train(training)
