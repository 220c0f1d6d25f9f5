"""Which tokens of a chat-templated prompt the template put there: the role markers, the turn separators, the
system prompt (the template's default one included). What is left ranks: the messages' own text (the user's, and
earlier assistant turns), and what the model generates after the prompt (:func:`nxl_hooks.method.select.rankable`).

    prompt = chat_prompt(tok, "What is the capital of France?")    # .text to tokenize, .spans of the user's text
    template = template_rows(tok, [prompt], ids)                    # bool (rows, seq): True on template tokens
    template = locate_template(tok, ids)                            # from token ids alone (a served request)

How: the template is rendered with the messages, and again with a placeholder for each message's content: the
placeholders' places give the contents' (a message's text searched for could be found in the system prompt), and a
token is the template's when its character span (the fast tokenizer's offsets) overlaps no ranked message's
content. From ids alone, the template is rendered with placeholder contents for conversation shapes (a user
message; a system and a user message; then two more turns at a time, as long as the prompt holds them); the decoded
prompt is cut at the placeholders' surroundings and, to be sure, the found messages are rendered and tokenized again
and must give the same ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch

from ..arch.text import flag_and_keyword, typed

__all__ = ["ChatPrompt", "NOT_RANKED_ROLES", "chat_prompt", "locate_template", "template_rows"]

#: Messages of these roles are the template's as much as its markers are: they never rank.
NOT_RANKED_ROLES = ("system", "developer")
_PLACEHOLDER = "\x00nxl{}\x00"


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation rendered by the tokenizer's chat template. ``spans``: (start, end) characters of the text of
    each message that ranks (not system); None when a message's text is not in the rendered prompt as written (a
    template that rewrites it): then nothing is known to be the template's."""

    text: str
    spans: tuple[tuple[int, int], ...] | None


def _render(tokenizer: Any, messages: Sequence[Mapping[str, Any]], generation: bool) -> str:
    """The rendered conversation; a ValueError (one line) when the template fails: it is the model's text, run in
    jinja2's sandbox, which refuses unsafe attribute access (SecurityError) and huge ranges (OverflowError); a
    template may also raise, divide by zero, recurse or ask for more memory than there is."""
    try:
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation, tokenize=False)
    except Exception as err:  # noqa: BLE001 - whatever the template does is the template's fault, said in one line
        raise ValueError(f"the tokenizer's chat template failed ({typed(err)}): fix chat_template (in "
                         "tokenizer_config.json or chat_template.jinja), or drop "
                         f"{flag_and_keyword('chat', switch=True)}") from None


def _adds_bos(tokenizer: Any) -> bool:
    return tokenizer("", add_special_tokens=True)["input_ids"][:1] == [tokenizer.bos_token_id]


def chat_prompt(tokenizer: Any, messages: str | Sequence[Mapping[str, Any]], *,
                add_generation_prompt: bool = True) -> ChatPrompt:
    """``messages`` (or one text, as the user's message) through the tokenizer's chat template, followed by the
    assistant's turn, ready to tokenize as usual: when the tokenizer adds its BOS token itself, the template's own
    leading BOS is left out, so it is not there twice. ValueError without a template.

    ``chat_prompt(tok, "What is the capital of France?").text``
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this tokenizer has no chat template (tokenizer.chat_template is empty): drop "
                         f"{flag_and_keyword('chat', switch=True)}, or write the prompt in the model's own "
                         "format")
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    rendered = _render(tokenizer, messages, add_generation_prompt)
    bos = tokenizer.bos_token
    cut = len(bos) if bos and rendered.startswith(bos) and _adds_bos(tokenizer) else 0
    contents = [message.get("content") for message in messages]
    if not all(isinstance(content, str) for content in contents):  # multimodal parts: not told from the template's
        return ChatPrompt(rendered[cut:], None)
    # each message is where the template puts its placeholder, not where its text first occurs (it may also be in
    # the system prompt or a role's name)
    pieces = _pieces(tokenizer, messages, add_generation_prompt)
    if pieces is None or "".join(piece + content for piece, content in zip(pieces, [*contents, ""])) != rendered:
        return ChatPrompt(rendered[cut:], None)  # a template that rewrites the text, or writes it twice
    spans, cursor = [], -cut
    for piece, content, message in zip(pieces, contents, messages):
        cursor += len(piece)
        if message.get("role") not in NOT_RANKED_ROLES and content:
            spans.append((cursor, cursor + len(content)))
        cursor += len(content)
    return ChatPrompt(rendered[cut:], tuple(spans))


def _offsets(tokenizer: Any, text: str, special: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(ids (n,), offsets (n, 2)) of ``text`` tokenized with the tokenizer's own special tokens (its BOS: as
    :func:`nxl_hooks.explain` does) or without (as ``apply_chat_template(tokenize=True)`` does); None without offsets
    (a slow tokenizer)."""
    try:
        enc = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True, return_token_type_ids=False,
                        return_tensors="pt")
    except Exception:  # noqa: BLE001 - slow tokenizers refuse offsets; a hook must not raise into the host either
        return None
    return enc["input_ids"][0], enc["offset_mapping"][0]


def _placed(tokenizer: Any, text: str, row: torch.Tensor, real: torch.Tensor) -> tuple[int, torch.Tensor] | None:
    """(where ``row`` holds the encoding of ``text``, that encoding's offsets); None when it holds none of them, or
    holds more than it: every other token must be padding (not ``real``) or the one BOS the tokenizer adds just
    before it. Tokens the user wrote around the text would otherwise be taken for the template's and never rank."""
    for special in (True, False):
        found = _offsets(tokenizer, text, special)
        if found is None:
            return None
        ids, offsets = found
        # from the first position (padded on the right, as explain pads a batch) or up to the last (on the left): a
        # batch encoded here would be padded on the tokenizer's side, not necessarily the row's
        for start in (0, len(row) - len(ids)) if len(ids) <= len(row) else ():
            if torch.equal(row[start:start + len(ids)], ids):
                extra = real.clone()
                extra[start:start + len(ids)] = False
                if start and row[start - 1] == tokenizer.bos_token_id and _adds_bos(tokenizer):
                    extra[start - 1] = False
                if not extra.any():
                    return start, offsets
    return None


def template_rows(tokenizer: Any, prompts: Sequence[ChatPrompt], input_ids: torch.Tensor,
                  attention_mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """bool (rows, seq): True on the tokens of ``input_ids`` (the encoding of the prompts' texts, with or without the
    tokenizer's BOS, a batch padded on either side) that the chat template put there (markers, system prompt, the
    tokenizer's added BOS), False on the messages' text. A token that straddles a message's edge counts as the
    message's. None when it cannot be told: a prompt's spans are unknown, the tokenizer gives no offsets, or a row
    does not hold its text's encoding and padding alone (``attention_mask``'s zeros; without it, the tokenizer's
    pad token).

    ``template_rows(tok, [chat_prompt(tok, text)], enc["input_ids"], enc["attention_mask"])``
    """
    if not prompts or any(prompt.spans is None for prompt in prompts):
        return None
    ids = input_ids.cpu()
    pad = tokenizer.pad_token_id
    real = (attention_mask.cpu().bool() if attention_mask is not None else
            ids != pad if pad is not None else torch.ones(ids.shape, dtype=torch.bool))
    template = torch.ones(input_ids.shape, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        placed = _placed(tokenizer, prompt.text, ids[row], real[row])
        if placed is None:
            return None
        start, offsets = placed
        flags = template[row, start:start + len(offsets)]  # (a view: set in place)
        for low, high in prompt.spans:
            flags &= ~((offsets[:, 0] < high) & (offsets[:, 1] > low))
    return template


def _pieces(tokenizer: Any, messages: Sequence[Mapping[str, Any]], generation: bool) -> list[str] | None:
    """The template's own text of the conversation ``messages``: what it writes before each message's content, and
    after the last (a placeholder stands for each content); None when the template refuses the shape."""
    placeholders = [_PLACEHOLDER.format(i) for i in range(len(messages))]
    try:
        rest = _render(tokenizer, [{**message, "content": p} for message, p in zip(messages, placeholders)],
                       generation)
    except ValueError:  # templates raise their own errors for shapes they refuse
        return None
    pieces = []
    for placeholder in placeholders:
        before, found, rest = rest.partition(placeholder)
        if not found:
            return None
        pieces.append(before)
    return [*pieces, rest]


def _split(text: str, pieces: list[str]) -> list[str] | None:
    """The contents between ``pieces`` in ``text``, which starts with the first and ends with the last; each other
    piece is taken where it first comes (one pass over the text: a split tried every possible way costs
    exponential time in the messages); None when the text does not hold the pieces so."""
    if not text.startswith(pieces[0]) or not text.endswith(pieces[-1]):
        return None
    contents, cursor, end = [], len(pieces[0]), len(text) - len(pieces[-1])
    for piece in pieces[1:-1]:
        start = text.find(piece, cursor, end)
        if start < 0:
            return None
        contents.append(text[cursor:start])
        cursor = start + len(piece)
    return [*contents, text[cursor:end]] if cursor <= end else None


def _conversations(tokenizer: Any, text: str, generation: bool) -> Iterator[list[dict[str, str]]]:
    """Messages read from ``text`` for conversation shapes (user; user, assistant, user; ...; each also after a
    system message), each shape two turns longer than the last while the text holds the template's text of its
    turns: as many turns as the prompt has, no more."""
    markers = [special for special in getattr(tokenizer, "all_special_tokens", None) or () if special]
    for first in ([], ["system"]):
        turns, written = 1, -1
        while True:
            roles = [*first, *("user" if i % 2 == 0 else "assistant" for i in range(turns))]
            pieces = _pieces(tokenizer, [{"role": role} for role in roles], generation)
            contents = _split(text, pieces) if pieces is not None and len("".join(pieces)) > written else None
            if contents is None:  # a template that writes nothing between turns cannot tell them apart either
                break
            # a message never holds a special token's text: that is where a longer conversation's turns are
            if not any(marker in content for content in contents for marker in markers):
                yield [{"role": role, "content": content} for role, content in zip(roles, contents)]
            turns, written = turns + 2, len("".join(pieces))


def locate_template(tokenizer: Any, ids: Sequence[int],
                    messages: Sequence[Mapping[str, Any]] | None = None) -> torch.Tensor | None:
    """bool (len(ids),): True on the chat template's tokens of a prompt known only as token ids (a served request),
    False on its messages' text; None when no chat template is found that gives exactly these ids (a prompt that
    is not chat-templated, a tokenizer without template or offsets). ``messages``: the request's messages, when
    known; else conversations of growing length are read from the ids (:func:`_conversations`).

    ``locate_template(tok, request_ids)``
    """
    if not getattr(tokenizer, "chat_template", None) or not len(ids):
        return None
    ids = torch.as_tensor(list(ids), dtype=torch.long)[None]
    text = tokenizer.decode(ids[0].tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False)
    bos = tokenizer.bos_token
    # the text also without a leading BOS: one the tokenizer added that the template does not write (TinyLlama-Chat's)
    texts = [text, text[len(bos):]] if bos and text.startswith(bos) else [text]
    for generation in (True, False):
        candidates = [messages] if messages is not None else (
            conversation for one in texts for conversation in _conversations(tokenizer, one, generation))
        for candidate in candidates:
            try:
                prompt = chat_prompt(tokenizer, candidate, add_generation_prompt=generation)
            except Exception:  # noqa: BLE001 - the template refused these messages
                continue
            template = template_rows(tokenizer, [prompt], ids, torch.ones_like(ids))  # (unpadded: all the prompt's)
            if template is not None:
                return template[0]
    return None
