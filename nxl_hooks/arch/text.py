"""Texts kept from what the host or a plugin gave: the lowest layer, so every layer that reports foreign code's
failures (a plugin, a sink factory, an attribution method, a dataset example, a hook) says them by one rule.

    record_text("models/caf\\udce9")   # 'models/caf\\\\xe9': valid UTF-8, as records keep texts
    one_line(error)                    # its message on one line; '<unprintable ValueError>' if str() raises
    typed(KeyError("id"))              # "KeyError: 'id'"; typed(KeyError()) == 'KeyError'
    install_command("parquet")         # 'pip install "nxl_hooks[parquet]"'
    flag_and_keyword("head")           # '--head (head=)': an option both a flag and a keyword, as messages say it
"""

from __future__ import annotations

import re

__all__ = ["escaped", "flag_and_keyword", "install_command", "one_line", "record_text", "typed"]

_SURROGATE = re.compile("[\ud800-\udfff]")


def escaped(char: str) -> str:
    """``char`` as Python escapes it in a string's repr: ``escaped("\\x1b") == "\\\\x1b"``."""
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def record_text(text: str | None) -> str | None:
    """``text`` as a record keeps it (a model's name, a request id, a thread's name, an error): valid UTF-8, which
    Parquet, JSON and every other language read. A byte that was not UTF-8, which Python names with a lone surrogate
    (a folder name from ``os.listdir()`` or ``sys.argv``: ``'caf\\udce9'`` for Latin-1 'café'), reads as that byte,
    escaped as bytes print it (and as a byte-level token reads); any other lone surrogate as
    :func:`~nxl_hooks.records.tokens.visible` shows it; the rest stays as it is. None stays None.
    ``record_text("models/caf\\udce9") == "models/caf\\\\xe9"``"""
    return None if text is None else _SURROGATE.sub(lambda m: _kept_byte(m[0]), text)


def _kept_byte(char: str) -> str:
    code = ord(char)  # U+DC80..U+DCFF: the byte 0x80..0xFF that Python's surrogateescape kept
    return f"\\x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else escaped(char)


def one_line(error: object) -> str:
    """``error``'s message on one line (its type's name when it has none): the text kept with a call, as records
    keep texts (:func:`record_text`: a message may quote a path that is not UTF-8). Never raises: ``error`` is the
    host's, a plugin's or a sink's object, and a ``__str__`` that raises would end the thread or the user's call
    saying it, so such a message is ``<unprintable ValueError>``."""
    try:
        text = str(error)
    except Exception:  # noqa: BLE001 - whatever the foreign __str__ raises, the type still says what failed
        return f"<unprintable {type(error).__name__}>"
    return record_text(" ".join(text.split())) or type(error).__name__


def typed(error: object, limit: int | None = None, *, aside: bool = False) -> str:
    """``error`` as a report of foreign code's failure names it: its type's name, then its :func:`one_line` message
    (cut at ``limit`` characters), ``KeyError: 'id'`` (``aside``: ``KeyError ('id')``), or the type's name alone
    where the message adds nothing (none, or that name again): ``KeyError``, never ``KeyError: KeyError``."""
    kind, text = type(error).__name__, one_line(error)
    if text == kind:
        return kind
    if limit is not None and len(text) > limit:
        text = text[:limit - 1] + "…"
    return f"{kind} ({text})" if aside else f"{kind}: {text}"


def install_command(extra: str) -> str:
    """What to run for the optional extra ``extra`` (pyproject.toml), as every line that names one says it (and
    :mod:`nxl_hooks.apps.extras` reads it back from an error): ``pip install "nxl_hooks[parquet]"``."""
    return f'pip install "nxl_hooks[{extra}]"'


def flag_and_keyword(keyword: str, value: str = "", *, flags: str = "", switch: bool = False) -> str:
    """An option that is both a command-line flag and a Python keyword (a loading option: ``--head`` and
    ``load_model(head=)``, ``--chat`` and ``chat=True``), as every message that names one says it: the flag first,
    with ``value`` where one is given, then the keyword. ``flags``: the flags where they are not the keyword's
    (``--load-in-8bit/--load-in-4bit``); ``switch``: a yes/no option (``--tp (tp=True)``).
    ``flag_and_keyword("head")`` -> ``--head (head=)``; ``flag_and_keyword("offload_folder", "DIR")`` ->
    ``--offload-folder DIR (offload_folder=)``."""
    flag = flags or "--" + keyword.replace("_", "-")
    return f"{flag}{' ' + value if value else ''} ({keyword}={'True' if switch else ''})"
