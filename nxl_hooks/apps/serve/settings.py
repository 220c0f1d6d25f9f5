"""What ``nxl run`` records: one option schema, from which the command line, the ``NXL_*`` environment variables
and their reading back are made. ``nxl run`` writes the variables, the bootstrap in every process the program
starts reads them; ``nxl attach PID`` takes the same flags.

    add_run_options(parser)                        # --layers, --target, ..., --sink DIR, --keep-calls, ...
    settings = Settings.from_args(parser.parse_args(argv), run_dir=folder)
    env = settings.to_env()                        # {"NXL_RUN_DIR": "runs/...", "NXL_LAYERS": "all", ...}
    Settings.from_env(os.environ) == settings

Each setting is one field of :class:`Settings`, declared once: its type and default, and in the field's metadata
an :class:`Option` with its variable, its parser, its flag and its help. :data:`OPTIONS` lists them in order;
``docs/nxl-run-options.md`` holds the table (:func:`markdown_table`; a test keeps the two equal).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import fnmatch
import ipaddress
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from ...method.protocol import check_name
from ...method.select import EMBEDDINGS, option_text, parse_embedding, parse_layers, parse_target

__all__ = ["DEFAULT_KEEP_CALLS", "OPTIONS", "Option", "Settings", "add_run_options", "markdown_table", "matches",
           "parse_listen", "whole_number"]

DEFAULT_KEEP_CALLS = 16  #: bounded by default: a server runs for weeks
_LOADING = ("dtype", "device_map", "max_memory", "quantize", "gguf_file")  #: what NXL_LOAD may hold


def parse_listen(value: str, *, allow_remote: bool = False) -> tuple[str, int]:
    """``"127.0.0.1:8765"`` | ``":8765"`` | ``"8765"`` -> (host, port). A host that is not loopback is refused
    unless ``allow_remote`` (the endpoint then still requires its token)."""
    host, _, port_text = value.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ValueError(f"--listen {value!r}: give HOST:PORT with a port from 0 to 65535, e.g. 127.0.0.1:8765")
    if not allow_remote and not _loopback(host):
        raise ValueError(f"--listen {value!r}: {host} is not a loopback address, so anyone who can reach it could "
                         "try the endpoint; use 127.0.0.1, or add --allow-remote (a bearer token is still required)")
    return host, port


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def whole_number(text: str) -> int:
    """An int of 0 or more (ValueError otherwise): ``--keep-calls``, the NXL_* counts."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{text!r}: give a whole number (0 or more)")
    return value


def _positive(text: str) -> int:
    value = whole_number(text)
    if value < 1:
        raise ValueError(f"{text!r}: give a whole number of at least 1")
    return value


def _megabytes(text: str) -> int:
    return _positive(text) << 20


def _switch(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError(f"{text!r}: use 1 (on) or 0 (off)")
    return text == "1"


def _switch_text(on: bool) -> str:
    return "1" if on else "0"


def _methods(text: str) -> list[str]:
    """A comma list of attribution method names (looked up when the probe attaches: a program may register its
    own first)."""
    return [check_name(name.strip()) for name in text.split(",") if name.strip()]


def _globs(text: str) -> list[str]:
    globs = [glob.strip() for glob in text.split(",") if glob.strip()]
    if not globs:
        raise ValueError(f"{text!r}: give at least one glob, like * or *llama*,gpt2")
    for glob in globs:
        if _unclosed(glob):
            raise ValueError(f"{text!r}: in {glob!r} a '[' opens a character class that is never closed, so it "
                             "would match a literal '[' and most likely no model; close it, or write [[] for a '['")
    return globs


def _unclosed(glob: str) -> bool:
    """Whether a '[' of ``glob`` has no closing ']' (fnmatch then reads it as a literal '['), scanned as
    ``fnmatch.translate`` scans it."""
    i = 0
    while i < len(glob):
        if glob[i] == "[":
            j = i + 1 + (glob[i + 1:i + 2] == "!")
            j += glob[j:j + 1] == "]"  # a ']' right after '[' or '[!' is a member, not the end
            end = glob.find("]", j)
            if end < 0:
                return True
            i = end
        i += 1
    return False


def _load(text: str) -> dict:
    try:
        load = json.loads(text)
    except ValueError:
        load = None
    if not isinstance(load, dict) or set(load) - set(_LOADING):
        raise ValueError(f"{text!r}: a JSON object of {', '.join(_LOADING)}")
    return {key: value for key, value in load.items() if value is not None}


def matches(name: str, globs: list[str]) -> bool:
    """Whether a model loaded from ``name`` (a path or hub id) matches a glob, itself or its last part."""
    tail = name.rstrip("/").rpartition("/")[2]
    return any(fnmatch.fnmatchcase(name, glob) or fnmatch.fnmatchcase(tail, glob) for glob in globs)


@dataclass(frozen=True)
class Option:
    """How one :class:`Settings` field is written: its ``NXL_*`` variable (``parse`` reads its text, ``text``
    writes it; an empty variable is the default) and, when the user sets it, its ``nxl run`` flag."""

    env: str
    parse: Callable[[str], Any]  #: the variable's text -> the value; ValueError says what is wrong
    help: str
    text: Callable[[Any], str] = str  #: the value -> the variable's text
    flag: str | None = None  #: None: set by ``nxl run`` itself (the run folder, the loading options)
    metavar: str | None = None  #: None with a flag: a switch (``--allow-remote``)
    choices: tuple[str, ...] | None = None
    arg: Callable[[str], Any] | None = None  #: the flag's text -> the value, where it differs from ``parse``
    shown: Callable[[Any], str] | None = None  #: the default as the flag's help shows it (default: ``text``)
    name: str = ""  #: the :class:`Settings` field (filled in from the field)
    default: Any = None  #: (filled in from the field)
    required: bool = False  #: no default: the field has none (filled in from the field)

    @property
    def dest(self) -> str:
        """The argparse attribute of the flag."""
        return self.flag.lstrip("-").replace("-", "_") if self.flag else self.name

    def read(self, env: Mapping[str, str]) -> Any:
        """The value ``env`` holds (the default when unset, or empty where the default is written empty);
        ValueError naming the variable."""
        text = env.get(self.env)
        if text is None or (not text and (self.required or self.text(self.default) == "")):
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
        if text == "" and self.text(self.default) != "":
            raise ValueError(f"'' is empty: leave it out for the default ({self.text(self.default)}), or give a "
                             "value")
        return (parse or self.parse)(text)

    def describe(self, *, default: bool = True) -> str:
        """The help, and the default as the flag takes it (``default``: when there is one worth saying)."""
        if not default or self.required or (self.shown is None and self.default in (None, False)):
            return self.help
        shown = (self.shown or self.text)(self.default)
        return f"{self.help} (default: {shown})" if shown else self.help


def _setting(default: Any, option: Option) -> Any:
    """A :class:`Settings` field: ``default`` (copied per instance when it is a list or dict) and its option."""
    metadata = {"option": option}
    if default is dataclasses.MISSING:
        return field(metadata=metadata)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class Settings:
    """One run's options, each declared once with its variable, flag and help (module docstring)."""

    run_dir: Path = _setting(dataclasses.MISSING, Option(
        "NXL_RUN_DIR", Path, "the run folder: control sockets, token, records (nxl run makes it, in --sink DIR or "
        "a private temporary folder); unset: the bootstrap is off"))
    sink: bool = _setting(False, Option(
        "NXL_SINK", _switch, "write records to the run folder DIR (rotated files, one folder per process and model) "
        "next to the control sockets, or NAME:ARG, a registered sink kind (parquet:out.parquet; {model} in ARG: "
        "the model's name); without it: a private temporary folder, records in memory only",
        text=_switch_text, flag="--sink", metavar="DIR", arg=str))
    sink_spec: str | None = _setting(None, Option(
        "NXL_SINK_SPEC", str, "NAME:ARG: write records to that registered sink kind instead of the run folder's "
        "files (nxl run sets it from --sink parquet:out.parquet; {model} in ARG: the model's folder name)",
        text=lambda value: value or ""))
    layers: str | list[int] = _setting("all", Option(
        "NXL_LAYERS", parse_layers, "layers explained: all | last | comma list like 0,2,-1",
        text=option_text, flag="--layers", metavar="LAYERS"))
    target: str | int | list[str | int] = _setting("predicted", Option(
        "NXL_TARGET", parse_target, "what is explained: predicted | an id | a token | comma list, spaces kept",
        text=option_text, flag="--target", metavar="TARGET"))
    embedding: str = _setting("layer_input", Option(
        "NXL_EMBEDDING", parse_embedding, "embedding norm: the input of block 1, or the raw word-embedding row",
        flag="--embedding", metavar="EMBEDDING", choices=EMBEDDINGS))
    methods: list[str] = _setting([], Option(
        "NXL_METHODS", _methods, "attribution methods computed beside normxlogit and logat (comma list of registered "
        "names, like contrastive): records carry their scores, nxl tail --method ranks by them", text=",".join,
        flag="--methods", metavar="NAMES"))
    models: list[str] = _setting(["*"], Option(
        "NXL_MODELS", _globs, "record only models whose name or path matches one of these comma-separated globs", text=",".join, flag="--models", metavar="PATTERN"))
    keep_calls: int = _setting(DEFAULT_KEEP_CALLS, Option(
        "NXL_KEEP_CALLS", whole_number, "requests kept in memory per model; older ones are in the sink",
        flag="--keep-calls", metavar="N"))
    listen: str | None = _setting(None, Option(
        "NXL_LISTEN", str, "also serve the control endpoint over HTTP on HOST:PORT: loopback only, bearer token in "
        "RUN_FOLDER/token", text=lambda value: value or "", flag="--listen", metavar="ADDR", shown=lambda _: "off"))
    allow_remote: bool = _setting(False, Option(
        "NXL_ALLOW_REMOTE", _switch, "let --listen use an address that is not loopback (the token is still "
        "required)", text=_switch_text, flag="--allow-remote"))
    eager: bool = _setting(False, Option(
        "NXL_EAGER", _switch, "run recorded calls eagerly so that each is recorded: continuous-batching managers "
        "without CUDA graphs, generate without its automatic torch.compile (slower; without it such calls run at "
        "full speed and their records say 'not recorded')", text=_switch_text, flag="--eager"))
    sink_max_bytes: int = _setting(64 << 20, Option(
        "NXL_SINK_MAX_BYTES", _positive, "start a new record file past this size in MB",
        flag="--sink-file-mb", metavar="MB", arg=_megabytes, shown=lambda size: str(size >> 20)))
    sink_max_files: int = _setting(16, Option(
        "NXL_SINK_MAX_FILES", _positive, "record files kept per process and model; older ones are deleted",
        flag="--sink-files", metavar="N"))
    load: dict = _setting({}, Option(
        "NXL_LOAD", _load, "JSON: the loading options (--dtype, --device-map, --max-memory, --load-in-8bit/4bit, "
        "--gguf-file) the program's own from_pretrained calls get where they do not set them",
        text=lambda load: json.dumps(load) if load else ""))

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        if self.listen:
            parse_listen(self.listen, allow_remote=self.allow_remote)
        sizing = [option for option in OPTIONS if option.name in ("sink_max_bytes", "sink_max_files")
                  and getattr(self, option.name) != option.default] if self.sink_spec else []
        if sizing:
            given = " and ".join(f"{option.flag} ({option.env})" for option in sizing)
            raise ValueError(f"{given} size the run folder's rotated record files, but --sink {self.sink_spec} "
                             "writes to that sink kind instead; drop them (or record to a folder: --sink DIR)")

    def selects(self, name: str) -> bool:
        """Whether a model loaded from ``name`` is recorded (:func:`matches` one of ``models``)."""
        return matches(name, self.models)

    def attach_options(self) -> dict:
        """What goes to :func:`nxl_hooks.attach` besides the sink."""
        return {"layers": self.layers, "target": self.target, "embedding": self.embedding, "methods": self.methods}

    def to_env(self) -> dict[str, str]:
        """Every setting as its ``NXL_*`` variable (an empty one for an unset ``listen`` / ``load``, so that a
        parent's variable does not leak into the program)."""
        return {option.env: option.text(getattr(self, option.name)) for option in OPTIONS}

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, run_dir: Path | None = None) -> "Settings":
        """The settings ``env`` holds (ValueError, naming the variable, on a bad value); ``run_dir`` when
        ``NXL_RUN_DIR`` is not set."""
        if run_dir is not None and not env.get("NXL_RUN_DIR"):
            env = {**env, "NXL_RUN_DIR": str(run_dir)}
        return cls(**{option.name: option.read(env) for option in OPTIONS})

    @classmethod
    def from_args(cls, args: argparse.Namespace, **given: Any) -> "Settings":
        """The settings of parsed :func:`add_run_options` flags; ``given`` sets the fields without a flag
        (``run_dir``, ``load``). A flag given to a yes/no field turns it on: ``--sink DIR`` sets ``sink`` (the
        caller makes the run folder in DIR)."""
        values = dict(given)
        for option in OPTIONS:
            if option.flag and getattr(args, option.dest, None) is not None:
                value = getattr(args, option.dest)
                values[option.name] = bool(value) if isinstance(option.default, bool) else value
        return cls(**values)


#: Every setting's :class:`Option`, in the order of :class:`Settings` (name and default filled in).
OPTIONS: tuple[Option, ...] = tuple(
    dataclasses.replace(each.metadata["option"], name=each.name,
                        default=each.default_factory() if each.default_factory is not dataclasses.MISSING
                        else None if each.default is dataclasses.MISSING else each.default,
                        required=each.default is dataclasses.MISSING and each.default_factory is dataclasses.MISSING)
    for each in dataclasses.fields(Settings))


def add_run_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *,
                    only: tuple[str, ...] | None = None, defaults: bool = True) -> None:
    """The flags of every :data:`OPTIONS` entry that has one (what ``nxl run`` and ``nxl attach`` take); ``only``
    these fields, and without the defaults in the help when ``defaults`` is False (``nxl ctl attach``: a flag left
    out keeps the running value). A flag left out is None in the parsed arguments, so :meth:`Settings.from_args`
    keeps the field's default."""
    for option in OPTIONS:
        if option.flag is None or (only is not None and option.name not in only):
            continue
        if option.metavar is None:
            parser.add_argument(option.flag, action="store_true", default=None, help=option.describe(default=defaults))
            continue

        def read(text: str, option: Option = option) -> Any:
            try:
                return option.value(text, option.arg)
            except ValueError as error:  # argparse prints this message (not its own "invalid value")
                raise argparse.ArgumentTypeError(str(error)) from None

        parser.add_argument(option.flag, type=None if option.choices else read, choices=option.choices,
                            metavar=None if option.choices else option.metavar,
                            help=option.describe(default=defaults))


def markdown_table() -> str:
    """:data:`OPTIONS` as a markdown table (flag, variable, what it does and its default): the one in
    ``docs/nxl-run-options.md``."""
    rows = ["| flag | variable | the variable's default | what it sets |", "| --- | --- | --- | --- |"]
    for option in OPTIONS:
        flag = f"`{option.flag} {option.metavar}`" if option.flag and option.metavar else (
            f"`{option.flag}`" if option.flag else "(set by nxl run)")
        value = "" if option.required else option.text(option.default)
        rows.append(f"| {flag} | `{option.env}` | {f'`{value}`' if value else '(empty)'} | "
                    f"{option.describe().replace('|', '&#124;')} |")
    return "\n".join(rows) + "\n"
