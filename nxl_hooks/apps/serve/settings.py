"""What ``nxl run`` records, as one ``NXL_*`` environment variable per option: the command line writes them, the
bootstrap in every process the program starts reads them.

    env = Settings(run_dir=Path("runs"), sink=True, layers="last").to_env()   # {"NXL_RUN_DIR": "runs", ...}
    Settings.from_env(os.environ)

| variable | option | default |
| --- | --- | --- |
| ``NXL_RUN_DIR`` | the run folder: control sockets, token, records (``--sink DIR``) | none: the bootstrap is off |
| ``NXL_SINK`` | ``1``: write records to the run folder (rotated files) | off: records in memory only |
| ``NXL_SINK_SPEC`` | ``NAME:ARG``: write records to that registered sink kind instead (``--sink parquet:out.parquet``; ``{model}`` in ARG: the model's folder name) | none |
| ``NXL_LAYERS`` / ``NXL_TARGET`` / ``NXL_EMBEDDING`` | what is explained, as ``nxl attribute`` takes them | all / predicted / layer_input |
| ``NXL_MODELS`` | comma list of globs on the name or path a model is loaded from | ``*`` |
| ``NXL_KEEP_CALLS`` | calls kept in memory per model | 16 |
| ``NXL_LISTEN`` / ``NXL_ALLOW_REMOTE`` | loopback HTTP control endpoint ``HOST:PORT``; ``1`` to allow another address | off / off |
| ``NXL_SINK_MAX_BYTES`` / ``NXL_SINK_MAX_FILES`` | rotation: bytes per file, files kept per process and model | 64 MiB / 16 |
| ``NXL_LOAD`` | JSON: loading options (dtype, device_map, max_memory, quantize, gguf_file) the program's own ``from_pretrained`` calls get where they do not set them | none |
"""

from __future__ import annotations

import argparse
import fnmatch
import ipaddress
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from ..options import parse_layers, parse_target

__all__ = ["DEFAULT_KEEP_CALLS", "Settings", "matches", "parse_listen", "whole_number"]

DEFAULT_KEEP_CALLS = 16  #: bounded by default: a server runs for weeks


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
    value = int(text)
    if value < 0:
        raise ValueError(f"{text!r} is negative")
    return value


def _count(name: str, text: str) -> int:
    try:
        return whole_number(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: give a whole number (0 or more)") from None


def _load(text: str) -> dict:
    try:
        load = json.loads(text)
    except ValueError:
        load = None
    if not isinstance(load, dict) or set(load) - {"dtype", "device_map", "max_memory", "quantize", "gguf_file"}:
        raise ValueError(f"NXL_LOAD={text!r}: a JSON object of dtype, device_map, max_memory, quantize, gguf_file")
    return {key: value for key, value in load.items() if value is not None}


def matches(name: str, globs: list[str]) -> bool:
    """Whether a model loaded from ``name`` (a path or hub id) matches a glob, itself or its last part."""
    tail = name.rstrip("/").rpartition("/")[2]
    return any(fnmatch.fnmatchcase(name, glob) or fnmatch.fnmatchcase(tail, glob) for glob in globs)


@dataclass
class Settings:
    """One run's options (see the module docstring for each)."""

    run_dir: Path
    sink: bool = False
    sink_spec: str | None = None  #: NAME:ARG of a registered sink kind, used instead of the run folder's files
    layers: str | list[int] = "all"
    target: str | int | list[str | int] = "predicted"
    embedding: str = "layer_input"
    models: list[str] = field(default_factory=lambda: ["*"])
    keep_calls: int = DEFAULT_KEEP_CALLS
    listen: str | None = None
    allow_remote: bool = False
    sink_max_bytes: int = 64 << 20
    sink_max_files: int = 16
    load: dict = field(default_factory=dict)  #: loading options for the program's own from_pretrained calls

    def selects(self, name: str) -> bool:
        """Whether a model loaded from ``name`` is recorded (:func:`matches` one of ``models``)."""
        return matches(name, self.models)

    def attach_options(self) -> dict:
        """What goes to :func:`nxl_hooks.attach` besides the sink."""
        return {"layers": self.layers, "target": self.target, "embedding": self.embedding}

    def to_env(self) -> dict[str, str]:
        env = {
            "NXL_RUN_DIR": str(self.run_dir),
            "NXL_SINK": "1" if self.sink else "0",
            "NXL_LAYERS": self.layers if isinstance(self.layers, str) else ",".join(map(str, self.layers)),
            "NXL_TARGET": ",".join(map(str, self.target)) if isinstance(self.target, list) else str(self.target),
            "NXL_EMBEDDING": self.embedding,
            "NXL_MODELS": ",".join(self.models),
            "NXL_KEEP_CALLS": str(self.keep_calls),
            "NXL_ALLOW_REMOTE": "1" if self.allow_remote else "0",
            "NXL_SINK_MAX_BYTES": str(self.sink_max_bytes),
            "NXL_SINK_MAX_FILES": str(self.sink_max_files),
        }
        if self.listen:
            env["NXL_LISTEN"] = self.listen
        if self.sink_spec:
            env["NXL_SINK_SPEC"] = self.sink_spec
        if self.load:
            env["NXL_LOAD"] = json.dumps(self.load)
        return env

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, run_dir: Path | None = None) -> "Settings":
        """The settings ``env`` holds (ValueError, naming the variable, on a bad value); ``run_dir`` when
        ``NXL_RUN_DIR`` is not set."""
        def get(name: str, default: str) -> str:
            return env.get(name) or default

        try:
            layers = parse_layers(get("NXL_LAYERS", "all"))
            target = parse_target(get("NXL_TARGET", "predicted"))
        except argparse.ArgumentTypeError as error:
            raise ValueError(f"NXL_LAYERS / NXL_TARGET: {error}") from None
        embedding = get("NXL_EMBEDDING", "layer_input")
        if embedding not in ("layer_input", "word"):
            raise ValueError(f"NXL_EMBEDDING={embedding!r}: use layer_input or word")
        folder = env.get("NXL_RUN_DIR") or run_dir
        if folder is None:
            raise ValueError("NXL_RUN_DIR is not set: give the run folder")
        allow_remote = get("NXL_ALLOW_REMOTE", "0") == "1"
        listen = env.get("NXL_LISTEN") or None
        if listen:
            parse_listen(listen, allow_remote=allow_remote)
        settings = cls(
            run_dir=Path(folder), sink=get("NXL_SINK", "0") == "1", sink_spec=env.get("NXL_SINK_SPEC") or None,
            layers=layers, target=target, embedding=embedding,
            models=[glob.strip() for glob in get("NXL_MODELS", "*").split(",") if glob.strip()] or ["*"],
            keep_calls=_count("NXL_KEEP_CALLS", get("NXL_KEEP_CALLS", str(DEFAULT_KEEP_CALLS))),
            listen=listen, allow_remote=allow_remote,
            sink_max_bytes=_count("NXL_SINK_MAX_BYTES", get("NXL_SINK_MAX_BYTES", str(64 << 20))),
            sink_max_files=_count("NXL_SINK_MAX_FILES", get("NXL_SINK_MAX_FILES", "16")),
            load=_load(get("NXL_LOAD", "{}")),
        )
        if settings.sink_max_bytes < 1 or settings.sink_max_files < 1:
            raise ValueError("NXL_SINK_MAX_BYTES and NXL_SINK_MAX_FILES must be at least 1")
        return settings
