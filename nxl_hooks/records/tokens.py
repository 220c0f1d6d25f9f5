"""Tokens as people read them: the one place that turns a token id into the text every output shows.

    readable(tok, 7042)                 # '␣Paris'   (SmolLM2: the piece is 'ĠParis', the text ' Paris')
    readable_ids(tok, [504, 198])       # ['The', '↵']
    visible(" a\\tb\\n")                  # '␣a⇥b↵'

A token's text is what it adds to a decoded string (``tokenizer.decode`` of the single id), not its vocabulary
piece ('ĠParis', '▁Paris', 'Ċ'). Whitespace and invisible characters are shown the same way everywhere (terminal,
HTML, JSON records, saved files, stream frames):

========================  =====================================================================
``␣`` (U+2423)            a space at the start or end of a token (' Paris' -> '␣Paris'; '  ' -> '␣␣');
                          spaces inside a token stay spaces
``↵`` (U+21B5)            a newline ('\\n\\n' -> '↵↵')
``⇥`` (U+21E5)            a tab
``␍`` (U+240D)            a carriage return
``\\x1b``, ``\\u202e``      any other control or format character (ANSI escape codes, bidi overrides,
                          zero-width characters): never sent raw to a terminal; one of U+0080..U+00FF
                          (NEL, a soft hyphen) as ``\\u0085``, since ``\\x85`` is a byte (next row)
``\\xf0\\x9f``              a byte-level token holding part of a UTF-8 character (it decodes to '�')
``\\\\``                    a backslash, so that a token whose text is ``\\x41`` (source code) reads
                          ``\\\\x41``, never the escape of 'A'
``∅``                     a token that decodes to nothing
========================  =====================================================================

Texts written before backslashes were escaped (older files) still read and show as they are; only :func:`plain_text`
and :func:`whole_characters` read such a text's ``\\\\`` as one backslash and its ``\\xNN`` as the escape, as
before. :func:`printable` makes any other line safe for a terminal (a message, a line that quotes readable texts)
without escaping its backslashes again.

The raw pieces (``Attribution.tokens``) and ids (``Attribution.input_ids``) stay available; these strings are
for reading. A text that happens to contain these glyphs itself reads the same as their meaning.

Back to text: :func:`plain_text` joins readable texts into the text they stand for (a call's ``.text``), and
:func:`whole_characters` shows tokens that each hold part of one character (an emoji a byte-level tokenizer splits:
``'\\x20\\xf0\\x9f\\x98'``, ``'\\x80'``: a space in such a piece is a byte too) as the character they make
together, on every token of the run (``'␣😀'``, ``'␣😀'``); a run whose character is not complete yet (the last
token of a live generation) shows what it has, then ``…``.
"""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache
from typing import Any, Sequence

from ..arch.registry import HeadKind
from ..arch.text import escaped, record_text
from ..method.chat import chat_prompt
from ..method.select import ResolvedTarget

__all__ = ["EMPTY", "describe_target", "NEWLINE", "SPACE", "TAB", "chat_text", "is_readable", "label_text",
           "clean_up_spaces", "continuation", "plain_text", "printable", "readable", "readable_ids", "record_text",
           "separator", "target_texts", "unseen", "untexted", "visible", "whole_characters"]

SPACE = "␣"
NEWLINE = "↵"
TAB = "⇥"
EMPTY = "∅"
_GLYPHS = {"\n": NEWLINE, "\t": TAB, "\r": "␍"}
#: what visible() shows escaped: control and format characters, line and paragraph separators, lone surrogates
_INVISIBLE = frozenset(("Cc", "Cf", "Zl", "Zp", "Cs"))
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


@lru_cache(maxsize=1)
def _byte_of() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed (piece character -> byte), as every byte-level BPE tokenizer uses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def _shown(char: str) -> str:
    return _GLYPHS.get(char) or (escaped(char) if unicodedata.category(char) in _INVISIBLE else char)


def _character(char: str) -> str:
    """``char`` in a readable text: a backslash doubled, the rest as :func:`printable` shows it, but an escaped
    character of U+0080..U+00FF (C1 controls such as NEL, the soft hyphen) as ``\\u0085``: a readable text of
    ``\\xNN`` alone is a byte-level piece's bytes (:func:`_raw`), where ``\\x85`` read back as the byte 0x85 ('�')."""
    if char == "\\":
        return "\\\\"
    shown = _shown(char)
    return f"\\u{ord(char):04x}" if shown != char and 0x80 <= ord(char) <= 0xFF else shown


def visible(text: str) -> str:
    """``text`` as a readable text: edge spaces, newlines, tabs, invisible characters and backslashes shown (the
    table in the module doc).

    ``visible(" Paris") == "␣Paris"``, ``visible("\\x1b[31m") == "\\\\x1b[31m"``, ``visible("\\\\n") == "\\\\\\\\n"``.
    """
    if not text:
        return EMPTY
    core = text.strip(" ")
    if not core:
        return SPACE * len(text)
    start = len(text) - len(text.lstrip(" "))
    end = len(text) - len(text.rstrip(" "))
    return SPACE * start + "".join(map(_character, core)) + SPACE * end


def printable(line: str) -> str:
    """``line`` safe for a terminal: newlines, tabs and invisible characters shown as :func:`visible` shows them,
    nothing else changed (a line quoting readable texts keeps their backslashes single).
    ``printable("req\\x1b[2J: '\\\\xf0'") == "req\\\\x1b[2J: '\\\\xf0'"``"""
    return "".join(map(_shown, line))


def untexted(token_id: int) -> str:
    """The text of a token whose id the records hold but not its text (recorded without a tokenizer):
    ``untexted(306) == "#306"``."""
    return f"#{int(token_id)}"


def unseen(position: int) -> str:
    """The text of a context position whose token the records do not hold, not even its id (the step that made it
    is not in them: a rotating sink deleted its file): ``unseen(22) == "@22"``."""
    return f"@{position}"


def is_readable(text: str) -> bool:
    """Whether ``text`` holds none of the characters :func:`visible` shows escaped (a readable text never does: one
    that does, read from a file, would reach a terminal raw). ``is_readable("\\\\x1b[31m")``, not
    ``is_readable("\\x1b[31m")``"""
    return not any(unicodedata.category(char) in _INVISIBLE for char in text)


_MEANING = {SPACE: " ", NEWLINE: "\n", TAB: "\t", "␍": "\r", EMPTY: ""}
_ESCAPED = re.compile(r"\\(\\)|\\x([0-9a-f]{2})|\\u([0-9a-f]{4})|\\U([0-9a-f]{8})")
_BYTES = re.compile(r"(?:\\x[0-9a-f]{2})+")


def _raw(name: str) -> bytes:
    """The UTF-8 bytes a readable text stands for. A text made only of ``\\xNN`` escapes, one of them 0x80 or
    above, is a byte-level piece (:func:`readable_ids`): those bytes; otherwise glyphs are their characters,
    ``\\\\`` a backslash and escapes the characters they name (read left to right: ``\\\\x41`` is ``\\x41``)."""
    if _BYTES.fullmatch(name) and any(int(name[i + 2:i + 4], 16) >= 0x80 for i in range(0, len(name), 4)):
        return bytes(int(name[i + 2:i + 4], 16) for i in range(0, len(name), 4))
    text = "".join(_MEANING.get(char, char) for char in name)
    return _ESCAPED.sub(lambda m: m[1] or chr(int(next(g for g in m.groups()[1:] if g), 16)),
                        text).encode("utf-8", "surrogatepass")


#: What a WordPiece decoder's cleanup rewrites in each token's text, in its order (tokenizers' ``wordpiece.rs``)
_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
            (" do not", " don't"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))
#: What transformers' ``clean_up_tokenization`` rewrites in a decoded text, in its order: the same but "do not"
_CLEAN_UP_SPACES = tuple(pair for pair in _CLEANUP if pair[0] != " do not")


def _rewritten(text: str, table: Sequence[tuple[str, str]]) -> str:
    """``text`` with each (dirty, clean) pair of ``table`` replaced in turn."""
    for dirty, clean in table:
        text = text.replace(dirty, clean)
    return text


def plain_text(names: Sequence[str], separator: str = "", continuation: str = "", cleanup: bool = False,
               clean_up_spaces: bool = False) -> str:
    """The text that readable token texts stand for, joined (a byte-level emoji's pieces make the emoji again; bytes
    that never complete a character read ``�``), with ``separator`` between tokens (:func:`separator`).
    ``plain_text(["Hello", "␣world", "↵"]) == "Hello world\\n"``. With a WordPiece ``continuation`` prefix
    (:func:`continuation`) they are joined as its decoder joins them: a token after the first that starts with it
    loses it and joins the one before, any other takes ``separator`` first; ``cleanup``: each token's text then
    rewritten as the decoder's cleanup does (``" ."`` to ``"."``). ``plain_text(["the", "##ing", "."], " ", "##",
    True) == "theing."``. ``clean_up_spaces``: the joined text then rewritten as transformers' decode does where the
    tokenizer's ``clean_up_tokenization_spaces`` is set (:func:`clean_up_spaces`: ``"it ' s"`` to ``"it's"``)."""
    if not continuation:
        text = separator.encode("utf-8").join(_raw(name) for name in names).decode("utf-8", "replace")
        return _rewritten(text, _CLEAN_UP_SPACES if clean_up_spaces else ())
    out = []
    for index, name in enumerate(names):
        text = _raw(name).decode("utf-8", "replace")
        if index:
            text = text[len(continuation):] if text.startswith(continuation) else separator + text
        out.append(_rewritten(text, _CLEANUP if cleanup else ()))
    return _rewritten("".join(out), _CLEAN_UP_SPACES if clean_up_spaces else ())


def _wordpiece(tokenizer: Any) -> Any:
    """The WordPiece decoder of a fast tokenizer, or None."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return decoder if type(decoder).__name__ == "WordPiece" else None


def separator(tokenizer: Any) -> str:
    """What ``tokenizer.decode`` puts between tokens besides their own texts: a space for a fast tokenizer without a
    decoder (a word-level one: tokenizers joins the pieces with one, and each decodes alone to its bare word) or with
    a WordPiece decoder (before each token that does not continue a word: :func:`continuation`), else nothing (its
    decoder's own pieces carry their spaces, which the readable texts keep)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return " " if backend is not None and (backend.decoder is None or _wordpiece(tokenizer) is not None) else ""


#: transformers' own switch (5.x) that cleans up a BPE tokenizer's text too, which it otherwise leaves as it is
_FORCED_FOR_BPE = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"


def clean_up_spaces(tokenizer: Any) -> bool:
    """Whether the tokenizer's decode cleans up the spaces before punctuation and contractions of the text it joined:
    its ``clean_up_tokenization_spaces`` (which a tokenizer saved by transformers 4 often sets), but not for a BPE
    model where transformers skips it (5.x, unless forced)."""
    if getattr(tokenizer, "clean_up_tokenization_spaces", False) is not True:
        return False
    model = type(getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)).__name__
    return not (model == "BPE" and hasattr(tokenizer, _FORCED_FOR_BPE) and not getattr(tokenizer, _FORCED_FOR_BPE))


def continuation(tokenizer: Any) -> tuple[str, bool]:
    """(prefix, cleanup) of a WordPiece decoder: a token starting with the prefix (``##ing``) continues the word
    before it, and cleanup rewrites each token's text (``" ."`` to ``"."``); ("", False) for any other tokenizer.
    The readable text of such a token keeps its prefix (``##ing``: decoded alone, it is first)."""
    decoder = _wordpiece(tokenizer)
    return (decoder.prefix, bool(decoder.cleanup)) if decoder is not None else ("", False)


def _complete(data: bytes) -> int:
    """How many leading bytes of ``data`` end on a character boundary (an incomplete UTF-8 tail left out)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # a lead byte (or ASCII): does its character fit in what is there?
            need = 1 if byte < 0x80 else 2 if byte >> 5 == 6 else 3 if byte >> 4 == 14 else 4 if byte >> 3 == 30 else 1
            return len(data) - back if need > back else len(data)
    return len(data)


def whole_characters(names: Sequence[str]) -> list[str]:
    """Readable token texts with each run of tokens that share a character (module doc) shown as that run's text,
    on every token of it; a run left incomplete at the end shows what it has, then ``…``. Other tokens are kept as
    they are. ``whole_characters(["a", "\\x20\\xf0\\x9f\\x98", "\\x80"]) == ["a", "␣😀", "␣😀"]``"""
    out, run, data = list(names), [], b""

    def close(text: str) -> None:
        for member in run:
            out[member] = text

    for index, name in enumerate(names):
        raw = _raw(name)
        if run and not (raw and raw[0] & 0xC0 == 0x80):  # the character never completes: its bytes read '�'
            close(visible(data.decode("utf-8", "replace")))
            run, data = [], b""
        if not run and _complete(raw) == len(raw):
            continue  # a token of whole characters: shown as it is
        run.append(index)
        data += raw
        if _complete(data) == len(data):
            close(visible(data.decode("utf-8", "replace")))
            run, data = [], b""
    if run:
        whole = data[:_complete(data)].decode("utf-8", "replace")
        close((visible(whole) if whole else "") + "…")
    return out


def _piece_bytes(piece: str) -> bytes | None:
    """The bytes a byte-level or byte-fallback piece stands for; None for any other piece."""
    byte = _BYTE_PIECE.fullmatch(piece)
    if byte:
        return bytes([int(byte.group(1), 16)])
    table = _byte_of()
    if piece and all(char in table for char in piece):
        return bytes(table[char] for char in piece)
    return None


def _whole(data: bytes) -> bool:
    """Whether ``data`` is whole UTF-8 characters (no part of one at either end, no byte that is never UTF-8)."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _texts(tokenizer: Any, ids: Sequence[int]) -> list[tuple[str, str | None]]:
    """(decoded text, piece) of each id; one call into the tokenizer for all of them."""
    ids = [int(i) for i in ids]
    texts = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    pieces = tokenizer.convert_ids_to_tokens(ids)
    out = []
    for text, piece in zip(texts, pieces):
        # SentencePiece decoders drop the first space of a sequence, and one token is always first: a piece of n
        # '▁' ('▁▁▁▁', code's indent) decodes alone to n - 1 spaces.
        if isinstance(piece, str) and len(piece) - len(piece.lstrip("▁")) > len(text) - len(text.lstrip(" ")):
            text = " " + text
        out.append((text, piece if isinstance(piece, str) else None))
    return out


def readable_ids(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """The readable text of each token id (see the module doc):
    ``readable_ids(tok, [504, 7042]) == ["The", "␣Paris"]``."""
    out = []
    for text, piece in _texts(tokenizer, ids):
        if "\ufffd" not in text or piece is None or "\ufffd" in piece:
            out.append(visible(text))
            continue
        # a '�' its piece does not hold: a byte-level or byte-fallback piece holding part of a character, unless its
        # bytes are whole characters, the '�' the text's own (mojibake in the data: GPT-2's piece 'ï¿½')
        data = _piece_bytes(piece)
        if data is None:
            out.append(visible(piece))
        elif _whole(data):
            out.append(visible(text))
        else:
            out.append("".join(f"\\x{byte:02x}" for byte in data))
    return out


def readable(tokenizer: Any, token: int) -> str:
    """The readable text of one token id, as every output shows it: ``readable(tok, 198) == "↵"``."""
    return readable_ids(tokenizer, [token])[0]


def label_text(tokenizer: Any, id2label: dict | None, kind: HeadKind | str, label: int) -> str:
    """A target id as people read it: a classifier's label name, an LM's readable token (else the id)."""
    if HeadKind(kind).pooled:
        return visible(str((id2label or {}).get(label, label)))
    return readable(tokenizer, label) if tokenizer is not None else str(label)


def target_texts(tokenizer: Any, config: Any, kind: HeadKind | str, targets: Any) -> list[list[str]] | None:
    """:func:`label_text` of each explained id, (rows,) or (rows, k) ids -> rows x k strings; None for regression and
    for an LM without a tokenizer."""
    kind = HeadKind(kind)
    if kind is HeadKind.REGRESSION or (tokenizer is None and not kind.pooled):
        return None
    id2label = getattr(config, "id2label", None)
    return [[label_text(tokenizer, id2label, kind, label) for label in row]
            for row in targets.reshape(targets.shape[0], -1).tolist()]


def describe_target(tokenizer: Any, config: Any, kind: str, resolved: ResolvedTarget) -> dict[str, Any]:
    """How a requested target was read, JSON-able (``Attribution.meta["targets"]``): request, id, text, how, the
    request's tokens and their texts, and a note when only the first of several tokens is explained, or when a
    classifier's label name read as such is also another output's id."""
    id2label = getattr(config, "id2label", None)
    texts = [label_text(tokenizer, id2label, kind, token) for token in resolved.tokens]
    note = None
    if resolved.partial:
        note = (f"{resolved.request!r} is {len(texts)} tokens here ({' '.join(texts)}): only the first, {texts[0]}, "
                "is explained")
    elif resolved.other is not None:
        other = resolved.other
        note = (f"{resolved.request!r} is read as the label named {texts[0]!r} (id {resolved.id}), not as id {other} "
                f"({label_text(tokenizer, id2label, kind, other)!r}): to mean id {other}, give the number {other} "
                "(an int; in a dataset, a JSONL number: a CSV cell is always text)")
    return {"request": resolved.request, "id": resolved.id, "text": texts[0], "how": resolved.how,
            "tokens": list(resolved.tokens), "texts": texts, "note": note}


def chat_text(tokenizer: Any, text: str) -> str:
    """``text`` as the one user message of the tokenizer's chat template, followed by the assistant's turn, ready to
    tokenize as usual (:func:`nxl_hooks.method.chat.chat_prompt`). ValueError without a template.

    ``chat_text(tok, "What is the capital of France?")``
    """
    return chat_prompt(tokenizer, text).text
