"""Option groups declared once. A group is a dataclass whose fields each carry an :class:`Option` (made with
:func:`setting`): the field's type and default, and in its metadata its flag, its ``NXL_*`` variable, its help and
its parsers. Every way in and out is made from that one declaration: the argparse flags of every command that takes
the group (:func:`add_options`, read back by :func:`read_args`), the variables (:func:`read_env`, :func:`write_env`),
a JSON object (a control request, ``NXL_LOAD``: :func:`read_json`) and the docs table (:func:`markdown_table`).
Adding an option is one field.

    @dataclass
    class Look:
        colour: str = setting("plain", Option("NXL_COLOUR", parse_colour, "how tokens are coloured",
                                              flag="--colour", metavar="NAME"))

    add_options(parser, Look)                        # --colour NAME
    look = Look(**read_args(Look, parser.parse_args(argv)))
    write_env(look)                                  # {"NXL_COLOUR": "plain"}
    Look(**read_env(Look, os.environ)) == look

The groups: :class:`nxl_hooks.apps.serve.settings.Settings` (what ``nxl run`` records) and
:class:`nxl_hooks.apps.loading.Loading` (how a model is loaded). A docs page holds a group's table between
``<!-- generated: MODULE:FUNCTION -->`` and ``<!-- end generated -->``; ``python -m nxl_hooks.apps.schema
docs/*.md`` rewrites those tables from their functions (``--check``: only names the pages that are out of date,
exit 1), and a test keeps them equal.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import importlib
import re
import sys
from pathlib import Path
from typing import Any, Callable, Collection, Mapping, Sequence

__all__ = ["Option", "add_options", "generated", "markdown_table", "options", "read_args", "read_env", "read_json",
           "setting", "switch", "switch_text", "write_env"]


def switch(text: str) -> bool:
    """A yes/no variable's text: ``1`` or ``0`` (ValueError otherwise)."""
    if text not in ("0", "1"):
        raise ValueError(f"{text!r}: use 1 (on) or 0 (off)")
    return text == "1"


def switch_text(on: bool) -> str:
    """The text :func:`switch` reads back."""
    return "1" if on else "0"


def _text(value: Any) -> str:
    return "" if value is None else str(value)


@dataclasses.dataclass(frozen=True)
class Option:
    """How one field of a group is written: its ``NXL_*`` variable (``parse`` reads its text, ``text`` writes it;
    an empty variable is the default), its flag, and where else it is taken."""

    env: str | None  #: None: the field has no variable of its own (a loading option: NXL_LOAD holds the group)
    parse: Callable[[str], Any]  #: the variable's text -> the value; ValueError says what is wrong
    help: str
    text: Callable[[Any], str] = _text  #: the value -> the variable's text
    flag: str | None = None  #: None: no flag (set by the command itself: the run folder, the loading options)
    metavar: str | None = None  #: None with a flag and no choices: a yes/no flag (``--allow-remote``)
    choices: tuple[str, ...] | None = None
    arg: Callable[[str], Any] | None = None  #: the flag's text -> the value, where it differs from ``parse``
    shown: Callable[[Any], str] | None = None  #: the default as the flag's help shows it (default: ``text``)
    #: yes/no flags that each set the field to a value, as (flag, value, help): ``--load-in-8bit`` -> "8bit"
    switches: tuple[tuple[str, Any, str], ...] = ()
    #: a value that is not text, from JSON or Python (NXL_LOAD's max_memory object, a layer number in a control
    #: request) -> the value; ValueError says what is wrong. None: only text (and a yes/no field's bool)
    json: Callable[[Any], Any] | None = None
    ctl: bool = False  #: ``nxl ctl attach|detach`` change it in a running program (the control endpoint reads it)
    attach: bool = True  #: ``nxl attach PID`` takes the flag (False: only a program's start can set it)
    #: the default is the variable left unset, which means other than any text (NXL_PLUGINS: unset, every plugin;
    #: empty, none): :func:`write_env` leaves it out at the default, and an empty variable is a value
    unset: bool = False
    program: bool = True  #: a loading option that ``nxl run`` hands to the program's own loads (NXL_LOAD)
    name: str = ""  #: the field (filled in from the field)
    default: Any = None  #: (filled in from the field)
    required: bool = False  #: no default: the field has none (filled in from the field)

    @property
    def dest(self) -> str:
        """The argparse attribute of the flag."""
        return _dest(self.flag) if self.flag else self.name

    @property
    def flags(self) -> tuple[str, ...]:
        """Every flag that sets the field: its flag, or its ``switches``."""
        return (self.flag,) if self.flag else tuple(flag for flag, _, _ in self.switches)

    @property
    def is_switch(self) -> bool:
        """Whether the flag is a yes/no flag (it takes no value)."""
        return self.flag is not None and self.metavar is None and self.choices is None

    def read(self, env: Mapping[str, str]) -> Any:
        """The value ``env`` holds (the default when unset, or empty where the default is written empty);
        ValueError naming the variable."""
        text = env.get(self.env) if self.env else None
        if text is None or (not text and not self.unset and (self.required or self.text(self.default) == "")):
            if self.required:
                raise ValueError(f"{self.env} is not set: give {self.help.split(':')[0]}")
            return copy.copy(self.default)  # a list or dict of one's own
        try:
            return self.value(text)
        except ValueError as error:
            raise ValueError(f"{self.env}: {error}") from None  # the parsers quote the text

    def value(self, text: str, parse: Callable[[str], Any] | None = None) -> Any:
        """``text`` (a variable's, or the flag's with ``parse``) as the value. The one rule for empty text, flag and
        variable alike: it stands for the default only where the default is written empty (``NXL_LISTEN``);
        elsewhere (``--target ''``, ``NXL_TARGET=''``, ``--models ''``) it is refused, never read as "all"."""
        if text == "" and not self.unset and self.text(self.default) != "":
            raise ValueError(f"'' is empty: leave it out for the default ({self.text(self.default)}), or give a "
                             "value")
        return (parse or self.parse)(text)

    def accept(self, value: Any) -> Any:
        """``value`` from a JSON object (a control request, NXL_LOAD) or a keyword argument, as the field's value:
        text as the variable's text is read, a yes/no field's bool as it is, anything else through ``json``."""
        if isinstance(value, str):
            return self.value(value)
        if isinstance(value, bool) and isinstance(self.default, bool):
            return value
        if self.json is not None:
            return self.json(value)
        raise ValueError(f"{value!r:.80}: give a string (or leave it out)")

    def describe(self, *, default: bool = True) -> str:
        """The help, and the default as the flag takes it (``default``: when there is one worth saying)."""
        if not default or self.required or (self.shown is None and self.default in (None, False)):
            return self.help
        shown = (self.shown or self.text)(self.default)
        return f"{self.help} (default: {shown})" if shown else self.help



def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def setting(default: Any, option: Option) -> Any:
    """A group's field: ``default`` (``dataclasses.MISSING``: none; a list, dict or other unhashable value is
    copied per instance) and its :class:`Option`."""
    metadata = {"option": option}
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata=metadata)
    if type(default).__hash__ is None:
        return dataclasses.field(default_factory=lambda: copy.copy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@functools.cache
def _declared(group: type) -> tuple[Option, ...]:
    fields = [each for each in dataclasses.fields(group) if "option" in each.metadata]
    return tuple(
        dataclasses.replace(each.metadata["option"], name=each.name,
                            default=each.default_factory() if each.default_factory is not dataclasses.MISSING
                            else None if each.default is dataclasses.MISSING else each.default,
                            required=each.default is dataclasses.MISSING
                            and each.default_factory is dataclasses.MISSING)
        for each in fields)


def options(group: type, where: Callable[[Option], bool] | None = None) -> tuple[Option, ...]:
    """The :class:`Option` of every field of ``group``, in field order (name and default filled in); ``where``:
    only those it accepts (``options(Settings, where=lambda o: o.ctl)``)."""
    return tuple(option for option in _declared(group) if where is None or where(option))


def add_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup, group: type, *,
                where: Callable[[Option], bool] | None = None, defaults: bool = True,
                set_defaults: bool = False) -> None:
    """The flags of ``group``'s options (``where``: those it accepts); without the defaults in the help when
    ``defaults`` is False (a flag left out keeps a running value). A value flag left out is None (its field's
    default with ``set_defaults``, for a command that reads ``args`` itself), a yes/no flag False:
    :func:`read_args` leaves both out, so the field keeps its default."""
    for option in options(group, where):
        for flag, _, help_ in option.switches:
            parser.add_argument(flag, action="store_true", help=help_)
        if option.flag is None:
            continue
        if option.is_switch:
            parser.add_argument(option.flag, action="store_true", help=option.describe(default=defaults))
            continue

        def read(text: str, option: Option = option) -> Any:
            try:
                return option.value(text, option.arg)
            except ValueError as error:  # argparse prints this message (not its own "invalid value")
                raise argparse.ArgumentTypeError(str(error)) from None

        parser.add_argument(option.flag, type=None if option.choices else read, choices=option.choices,
                            metavar=None if option.choices else option.metavar,
                            default=copy.copy(option.default) if set_defaults else None,
                            help=option.describe(default=defaults))


def read_args(group: type, args: argparse.Namespace, *,
              where: Callable[[Option], bool] | None = None) -> dict[str, Any]:
    """The fields that parsed :func:`add_options` flags set, by name (the others are left out: their defaults).
    A flag given to a yes/no field turns it on (``--sink DIR`` sets ``sink``); two of one field's ``switches``
    are a ValueError."""
    values: dict[str, Any] = {}
    for option in options(group, where):
        on = [(flag, value) for flag, value, _ in option.switches if getattr(args, _dest(flag), False)]
        if len(on) > 1:
            raise ValueError(f"{' and '.join(flag for flag, _ in on)} exclude each other: pick one")
        if on:
            values[option.name] = on[0][1]
        given = getattr(args, option.dest, None) if option.flag else None
        if given is not None and given is not False:
            values[option.name] = bool(given) if isinstance(option.default, bool) else given
    return values


def read_env(group: type, env: Mapping[str, str]) -> dict[str, Any]:
    """Every field of ``group`` that has a variable, as ``env`` holds it (ValueError naming the variable)."""
    return {option.name: option.read(env) for option in options(group) if option.env}


def write_env(values: Any) -> dict[str, str]:
    """Every field of the group instance ``values`` that has a variable, as that variable's text."""
    return {option.env: option.text(getattr(values, option.name)) for option in options(type(values))
            if option.env and not (option.unset and getattr(values, option.name) == option.default)}


def replaced_env(values: Any, env: Mapping[str, str], given: Collection[str] = ()) -> list[str]:
    """The variables ``env`` (the caller's environment) sets to other than the flags' values ``values`` will write,
    as ``NXL_LAYERS='last' (--layers all)``: ``nxl run`` writes every variable from its flags, so a caller who set
    one and gave no flag would have it replaced without a word. Not named: the fields whose flag was ``given``
    (:func:`read_args`' keys: chosen on the command line) and variables no flag sets (the run folder)."""
    replaced, written = [], write_env(values)
    for option in options(type(values)):
        theirs, ours = env.get(option.env or ""), written.get(option.env or "")
        if option.flag is None or option.name in given or not theirs or ours is None:
            continue
        try:
            same = option.text(option.value(theirs)) == ours  # 'last' and 'last ' read alike
        except ValueError:
            same = False  # a bad value is replaced too
        if not same:
            yes_no = isinstance(option.default, bool)  # as the flag is written: --eager, no --listen (not '')
            flag = option.flag if yes_no and ours == switch_text(True) else f"no {option.flag}" if yes_no or not ours \
                else f"{option.flag} {(option.shown or option.text)(getattr(values, option.name))}"  # MB, not bytes
            replaced.append(f"{option.env}={theirs!r:.40} ({flag})")
    return replaced


def read_json(group: type, data: Mapping[str, Any], *,
              where: Callable[[Option], bool] | None = None) -> dict[str, Any]:
    """The fields a JSON object (or keyword arguments) sets, read as :meth:`Option.accept` reads them; None is
    left out. A key that is not one of the options ``where`` accepts, or a bad value, is a ValueError naming it."""
    known = {option.name: option for option in options(group, where)}
    values: dict[str, Any] = {}
    for name, value in data.items():
        if name not in known:
            raise ValueError(f"{name!r:.80} is not an option here: use {', '.join(known)}")
        if value is None:
            continue
        try:
            values[name] = known[name].accept(value)
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None
    return values


def _flags(option: Option) -> str:
    if option.switches:
        return " / ".join(f"`{flag}`" for flag in option.flags)
    if option.flag is None:
        return "(set by nxl run)"
    return f"`{option.flag} {option.metavar}`" if option.metavar else f"`{option.flag}`"


def markdown_table(group: type, *, where: Callable[[Option], bool] | None = None) -> str:
    """``group``'s options (``where``: those it accepts) as a markdown table: flag, variable, the variable's
    default and what it sets; for a group without variables flag, keyword and what it sets (and which ``nxl run``
    takes, where some are not)."""
    chosen = options(group, where)
    variables = any(option.env for option in chosen)
    program = not variables and not all(option.program for option in chosen)
    head = (["flag", "variable", "the variable's default"] if variables else
            ["flag", "keyword"] + (["nxl run (NXL_LOAD)"] if program else []))
    rows = ["| " + " | ".join([*head, "what it sets"]) + " |", "|" + " --- |" * (len(head) + 1)]
    for option in chosen:
        cells = [_flags(option)]
        if variables:
            value = "" if option.required else option.text(option.default)
            cells += [f"`{option.env}`", "(unset)" if option.unset else f"`{value}`" if value else "(empty)"]
        else:
            cells += [f"`{option.name}`"] + (["yes" if option.program else "no"] if program else [])
        cells.append(option.describe().replace("|", "&#124;"))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


_BLOCK = re.compile(r"(<!-- generated: (nxl_hooks(?:\.\w+)+):(\w+) -->\n)(.*?)(<!-- end generated -->)", re.S)


def generated(text: str) -> str:
    """``text`` (a markdown page) with each block between ``<!-- generated: MODULE:FUNCTION -->`` and
    ``<!-- end generated -->`` written anew by that function of the package (no argument, returns markdown)."""
    def fill(match: re.Match) -> str:
        function = getattr(importlib.import_module(match.group(2)), match.group(3))
        return f"{match.group(1)}\n{function()}\n{match.group(5)}"

    return _BLOCK.sub(fill, text)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m nxl_hooks.apps.schema [--check] PAGE...``: rewrite the pages' generated tables."""
    parser = argparse.ArgumentParser(prog="python -m nxl_hooks.apps.schema", allow_abbrev=False,
                                     description="Rewrite the option tables of markdown pages from their groups.")
    parser.add_argument("pages", nargs="+", metavar="PAGE", help="markdown pages (docs/*.md)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a table is out of date")
    args = parser.parse_args(argv)
    stale = []
    for page in map(Path, args.pages):
        text = page.read_text()
        fresh = generated(text)
        if fresh != text:
            stale.append(page)
            if not args.check:
                page.write_text(fresh)
    for page in stale:
        print(f"{page}: {'out of date (run without --check to rewrite)' if args.check else 'rewritten'}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
