"""What ``nxl run`` records: one option group (:mod:`nxl_hooks.apps.schema`), from which the command line, the
``NXL_*`` environment variables and their reading back, ``nxl ctl``'s changes and the control endpoint's reading of
them, and the docs table are made. ``nxl run`` writes the variables, the bootstrap in every process the program
starts reads them; ``nxl attach PID`` takes the same flags.

    add_run_options(parser)                        # --layers, --target, ..., --sink DIR, --keep-calls, ...
    settings = Settings.from_args(parser.parse_args(argv), run_dir=folder)
    env = settings.to_env()                        # {"NXL_RUN_DIR": "runs/...", "NXL_LAYERS": "all", ...}
    Settings.from_env(os.environ) == settings
    Settings.changes({"layers": "last"})           # what the endpoint reads from `nxl ctl attach --layers last`

Each setting is one field of :class:`Settings`, declared once: its type and default, and in the field's metadata
an :class:`~nxl_hooks.apps.schema.Option` with its variable, its parser, its flag, its help and whether ``nxl ctl``
changes it (``ctl=True``). Adding a setting is that one field (and what reads it). :data:`OPTIONS` lists them in
order; ``docs/nxl-run-options.md`` holds the table (:func:`markdown_table`; a test keeps the two equal). The
loading options (``NXL_LOAD``) are the group :class:`~nxl_hooks.apps.loading.Loading`.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import ipaddress
import operator
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from ...method.registry import wanted_name
from ...arch import plugins
from ...method.select import EMBEDDINGS, option_text, parse_embedding, parse_layers, parse_target
from ..loading_options import Loading
from ..schema import (Option, add_options, markdown_table as group_table, options, read_args, read_env, read_json,
                      setting, switch, switch_text, write_env)

__all__ = ["ATTACH", "CTL", "DEFAULT_KEEP_CALLS", "NoMatch", "OPTIONS", "Option", "Settings", "add_run_options",
           "attach_options", "markdown_table", "matches", "parse_listen", "positive_number", "whole_number"]

DEFAULT_KEEP_CALLS = 16  #: bounded by default: a server runs for weeks
#: The settings that are :func:`nxl_hooks.attach`'s own options: every command that attaches takes their flags.
ATTACH = ("layers", "target", "embedding")
PLUGINS = plugins.SETTING  #: NXL_PLUGINS: the plugin allow-list, which nxl_hooks.arch.plugins reads


def attach_options(values: Any) -> dict:
    """The :data:`ATTACH` options ``values`` holds, by name: a :class:`Settings`, or the parsed arguments of a command
    that takes their flags. Every one of them goes on to :func:`nxl_hooks.attach`, so that declaring one in ATTACH is
    all it takes: ``attach_options(args)`` -> ``{"layers": "all", "target": "predicted", ...}``"""
    return {name: getattr(values, name) for name in ATTACH}


def parse_listen(value: str, *, allow_remote: bool = False) -> tuple[str, int]:
    """``"127.0.0.1:8765"`` | ``":8765"`` | ``"8765"`` -> (host, port). A host that is not loopback is refused
    unless ``allow_remote`` (the endpoint then still requires its token)."""
    if value.count(":") > 1 and not value.startswith("["):
        raise ValueError(f"--listen {value!r}: write an IPv6 address in brackets, with its port: [::1]:8765")
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


def address_family(host: str) -> socket.AddressFamily:
    """The family a --listen host binds with (:func:`parse_listen`'s host): IPv6 for an address with colons
    (``::1``, given as ``[::1]:8765``), else IPv4 (a name such as localhost too, as ``ThreadingHTTPServer`` binds)."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


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


def positive_number(text: str) -> int:
    """An int of 1 or more (ValueError otherwise): the NXL_SINK_MAX_* sizes, and ``nxl``'s counts
    (:data:`nxl_hooks.apps.options.positive_int`)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{text!r}: give a whole number of at least 1")
    return value


def _megabytes(text: str) -> int:
    return positive_number(text) << 20


def _methods(text: str) -> list[str]:
    """A comma list of attribution method names (looked up when the probe attaches: a program may register its
    own first; a name no method can take is refused now)."""
    return [wanted_name(name.strip()) for name in text.split(",") if name.strip()]


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


def _plugin_names(text: str) -> list[str]:
    """NXL_PLUGINS, as :func:`nxl_hooks.arch.plugins.allowed` reads it, checked: a GROUP:NAME whose group is not
    one of them would leave that plugin out without a word."""
    names = [name.strip() for name in text.split(",")] if text.strip() else []
    groups = [group.rpartition(".")[2] for group in plugins.GROUPS]
    for name in names:
        group, colon, plugin = name.rpartition(":")
        if not plugin or (colon and group not in groups):
            raise ValueError(f"{text!r}: {name!r} is not a plugin's NAME or GROUP:NAME with GROUP one of "
                             f"{', '.join(groups)}; leave it empty for no plugin")
    return names


def matches(name: str, globs: list[str]) -> bool:
    """Whether a model loaded from ``name`` (a path or hub id) matches a glob, itself or its last part."""
    tail = name.rstrip("/").rpartition("/")[2]
    return any(fnmatch.fnmatchcase(name, glob) or fnmatch.fnmatchcase(tail, glob) for glob in globs)


class NoMatch(LookupError):
    """The globs of ``nxl ctl attach/detach --models`` match none of this process's models: nothing was changed, not
    even the options of models loaded later (a typo must not quietly re-attach the next model). ``loaded``: the
    names of its models alive, which the operator picks from."""

    def __init__(self, globs: str, loaded: list[str]) -> None:
        super().__init__(f"--models {globs} matches none of the models loaded here ({', '.join(loaded) or 'none'}); "
                         "nothing changed")
        self.loaded = loaded


def _number_or_text(parse: Callable[[str], Any]) -> Callable[[Any], Any]:
    """A control request's layer or token id: a JSON number read as its text."""

    def read(value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            return parse(str(value))
        raise ValueError(f"{value!r:.80}: give a string or a number (or leave it out)")

    return read


@dataclass
class Settings:
    """One run's options, each declared once with its variable, flag and help (module docstring)."""

    run_dir: Path = setting(dataclasses.MISSING, Option(
        "NXL_RUN_DIR", Path, "the run folder: control sockets, token, records (nxl run makes it, in --sink DIR or "
        "a private temporary folder); unset: the bootstrap is off"))
    sink: bool = setting(False, Option(
        "NXL_SINK", switch, "write records to the run folder DIR (rotated files, one folder per process and model) "
        "next to the control sockets, or NAME:ARG, a registered sink kind (parquet:out.parquet; {model} in ARG: "
        "the process's model folder name, PID-NAME); without it: a private temporary folder, records in memory only",
        text=switch_text, flag="--sink", metavar="DIR", arg=str))
    sink_spec: str | None = setting(None, Option(
        "NXL_SINK_SPEC", str, "NAME:ARG: write records to that registered sink kind instead of the run folder's "
        "files (nxl run sets it from --sink parquet:out.parquet; {model} in ARG: the process's model folder name, "
        "PID-NAME)"))
    layers: str | list[int] = setting("all", Option(
        "NXL_LAYERS", parse_layers, "layers explained: all | last | comma list like 0,2,-1",
        text=option_text, flag="--layers", metavar="LAYERS", json=_number_or_text(parse_layers), ctl=True))
    target: str | int | list[str | int] = setting("predicted", Option(
        "NXL_TARGET", parse_target, "what is explained: predicted | an id | a word (read after the text: 'Paris' is "
        "' Paris'), a token or a label | comma list, spaces kept",
        text=option_text, flag="--target", metavar="TARGET", json=_number_or_text(parse_target), ctl=True))
    embedding: str = setting("layer_input", Option(
        "NXL_EMBEDDING", parse_embedding, "embedding norm: the input of block 1, or the raw word-embedding row",
        flag="--embedding", metavar="EMBEDDING", choices=EMBEDDINGS, ctl=True))
    methods: list[str] = setting([], Option(
        "NXL_METHODS", _methods, "attribution methods computed beside normxlogit and logat (comma list of registered "
        "names, like contrastive): records carry their scores, nxl tail --method ranks by them", text=",".join,
        flag="--methods", metavar="NAMES"))
    models: list[str] = setting(["*"], Option(
        "NXL_MODELS", _globs, "record only models whose name or path matches one of these comma-separated globs",
        text=",".join, flag="--models", metavar="PATTERN", ctl=True))
    keep_calls: int = setting(DEFAULT_KEEP_CALLS, Option(
        "NXL_KEEP_CALLS", whole_number,
        "generate requests kept in memory per model (and as many plain forwards), and every one still running; "
        "older ones are in the sink",
        flag="--keep-calls", metavar="N"))
    listen: str | None = setting(None, Option(
        "NXL_LISTEN", str, "also serve the control endpoint over HTTP on HOST:PORT: loopback only, bearer token in "
        "RUN_FOLDER/token", flag="--listen", metavar="ADDR", shown=lambda _: "off"))
    allow_remote: bool = setting(False, Option(
        "NXL_ALLOW_REMOTE", switch, "let --listen use an address that is not loopback (the token is still "
        "required)", text=switch_text, flag="--allow-remote"))
    eager: bool = setting(False, Option(
        "NXL_EAGER", switch, "a fallback: run recorded calls eagerly (generate without its automatic "
        "torch.compile, continuous-batching managers without CUDA graphs or asynchronous batching, vLLM with "
        "enforce_eager); compiled calls are recorded without it, compiled", text=switch_text, flag="--eager"))
    sink_max_bytes: int = setting(64 << 20, Option(
        "NXL_SINK_MAX_BYTES", positive_number, "start a new record file past this size in MB",
        flag="--sink-file-mb", metavar="MB", arg=_megabytes, shown=lambda size: str(size >> 20)))
    sink_max_files: int = setting(16, Option(
        "NXL_SINK_MAX_FILES", positive_number, "record files kept per process and model; older ones are deleted",
        flag="--sink-files", metavar="N"))
    plugins: list[str] | None = setting(None, Option(
        PLUGINS, _plugin_names, "the plugins that may load (docs: Plugins): a comma list of names, or GROUP:NAME "
        "for one group's (sinks:jsonl); empty: none; unset: every installed one (the program's environment "
        "decides)", text=lambda names: "" if names is None else ",".join(names), flag="--plugins", metavar="NAMES",
        unset=True, attach=False))
    load: Loading = setting(Loading(), Option(
        "NXL_LOAD", Loading.from_json, "JSON: the loading options (--dtype, --device-map, --max-memory, "
        "--offload-folder, --load-in-8bit/4bit, --gguf-file) the program's own from_pretrained calls get where they do "
        "not set them",
        text=Loading.to_json))

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        self.load = Loading.program(self.load)  # only what nxl run hands to a program (a dict: as NXL_LOAD's object)
        if self.listen:
            parse_listen(self.listen, allow_remote=self.allow_remote)
        sizing = [option for option in options(type(self)) if option.name in ("sink_max_bytes", "sink_max_files")
                  and getattr(self, option.name) != option.default] if self.sink_spec else []
        if sizing:
            given = " and ".join(f"{option.flag} ({option.env})" for option in sizing)
            raise ValueError(f"{given} size the run folder's rotated record files, but --sink {self.sink_spec} "
                             "writes to that sink kind instead; drop them (or record to a folder: --sink DIR)")

    def selects(self, name: str) -> bool:
        """Whether a model loaded from ``name`` is recorded (:func:`matches` one of ``models``)."""
        return matches(name, self.models)

    def attach_options(self) -> dict:
        """What goes to :func:`nxl_hooks.attach` besides the sink (the :data:`ATTACH` fields, and the attribution
        methods computed beside NormXLogit and LogAt)."""
        return {**attach_options(self), "methods": self.methods}

    def to_env(self) -> dict[str, str]:
        """Every setting as its ``NXL_*`` variable (an empty one for an unset ``listen`` / ``load``, so that a
        parent's variable does not leak into the program)."""
        return write_env(self)

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, run_dir: Path | None = None) -> "Settings":
        """The settings ``env`` holds (ValueError, naming the variable, on a bad value); ``run_dir`` when
        ``NXL_RUN_DIR`` is not set."""
        if run_dir is not None and not env.get("NXL_RUN_DIR"):
            env = {**env, "NXL_RUN_DIR": str(run_dir)}
        return cls(**read_env(cls, env))

    @classmethod
    def from_args(cls, args: argparse.Namespace, **given: Any) -> "Settings":
        """The settings of parsed :func:`add_run_options` flags; ``given`` sets the fields without a flag
        (``run_dir``, ``load``). A flag given to a yes/no field turns it on: ``--sink DIR`` sets ``sink`` (the
        caller makes the run folder in DIR)."""
        return cls(**{**given, **read_args(cls, args)})

    @classmethod
    def changes(cls, request: Mapping[str, Any]) -> dict[str, Any]:
        """The options a control request changes (``nxl ctl attach|detach``: the :data:`CTL` options, as text or,
        for a layer or token id, a number), read as their variables are: ``{"layers": "last"}`` ->
        ``{"layers": "last"}``, ``{"models": "a*,b"}`` -> ``{"models": ["a*", "b"]}``. ValueError naming the field
        on a bad value or a field that is not one of them."""
        return read_json(cls, request, where=CTL)


#: The options ``nxl ctl attach|detach`` change in a running program (:attr:`Option.ctl`), as a ``where`` filter.
CTL: Callable[[Option], bool] = operator.attrgetter("ctl")


#: Every setting's :class:`Option`, in the order of :class:`Settings` (name and default filled in).
OPTIONS: tuple[Option, ...] = options(Settings)


def add_run_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *,
                    only: tuple[str, ...] | None = None, defaults: bool = True, group: type = Settings,
                    where: Callable[[Option], bool] | None = None) -> None:
    """The flags of every option of ``group`` that has one (what ``nxl run`` and ``nxl attach`` take); ``where``
    (or ``only``, their names): only those, and without the defaults in the help when ``defaults`` is False (``nxl
    ctl attach``: a flag left out keeps the running value). A flag left out stays out of
    :meth:`Settings.from_args`, so the field keeps its default."""
    add_options(parser, group, defaults=defaults,
                where=where or (None if only is None else (lambda option: option.name in only)))


def markdown_table(group: type = Settings) -> str:
    """The options of ``group`` as a markdown table (flag, variable, its default, what it sets): the one in
    ``docs/nxl-run-options.md`` (:mod:`nxl_hooks.apps.schema` rewrites it)."""
    return group_table(group)
