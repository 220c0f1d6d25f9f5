"""One loader for every kind of plugin: installed distributions extend nxl_hooks through entry-point groups.

    from nxl_hooks.arch.plugins import load, load_all
    factory = load("nxl_hooks.sinks", "jsonl")       # one plugin by name: its object, or None
    methods = load_all("nxl_hooks.methods")          # every allowed plugin of a group: {name: object}

Each group, its entry points' names and objects, and when they are loaded:

- ``nxl_hooks.architectures``: a ``model_type`` -> a function that registers it (``register_architecture``), or
  that returns ArchSpecs or a TOML file's path; loaded when an attached model's ``model_type`` has no registry
  entry (that one plugin).
- ``nxl_hooks.methods``: a method's name -> the method; loaded when the method registry asks (by name, or all of
  them to list them).
- ``nxl_hooks.sinks``: a sink kind -> ``factory(arg, **options)``; loaded when a sink spec names that kind (that
  one plugin).
- ``nxl_hooks.engines``: an engine's name -> ``factory() -> Engine``; loaded at the first attach of a model that
  generates (all of them).

The same for every group: nothing is read when nxl_hooks is imported (``nxl run``'s bootstrap stays cheap). A
group's entry points are read once, the first time the group is asked for; a plugin is imported once, the first
time it is asked for, and kept. What a name registered in code gives (``register_sink``, ``register_engine``,
``register_architecture``...) wins over a plugin of that name: the registries ask the loader only for names they
do not know.

A broken plugin (its package fails to import, its object is missing, the group's metadata is unreadable) is
never raised: it is logged once, as one line on the ``nxl_hooks`` logger naming the plugin and what to do, and
left out; :func:`failure` keeps that line for a registry that wants to say why a name it was asked for is
missing. The host's call goes on as if the plugin were not installed.

``NXL_PLUGINS`` (the allow-list, read on each lookup): unset, every installed plugin is loaded; otherwise a
comma-separated list of the plugins that may be (an entry point's name, or ``GROUP:NAME`` with the group's last
part, ``sinks:jsonl``, for one group's); empty, none is.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import os
import pkgutil
import sys
import threading
from importlib import metadata
from typing import Any, Callable

from .text import typed

__all__ = ["ARCHITECTURES", "ENGINES", "GROUPS", "METHODS", "SETTING", "SINKS", "allowed", "broken",
           "contained", "declared", "entry_points", "failure", "load", "load_all"]

ARCHITECTURES = "nxl_hooks.architectures"
METHODS = "nxl_hooks.methods"
SINKS = "nxl_hooks.sinks"
ENGINES = "nxl_hooks.engines"
#: Every entry-point group nxl_hooks reads.
GROUPS = (ARCHITECTURES, METHODS, SINKS, ENGINES)
#: The environment variable holding the allow-list.
SETTING = "NXL_PLUGINS"

_logger = logging.getLogger("nxl_hooks")
_lock = threading.RLock()
_points: dict[str, dict[str, metadata.EntryPoint]] = {}  # group -> name -> entry point, read once per group
_loaded: dict[tuple[str, str], Any] = {}  # (group, name) -> the plugin's object
_failed: dict[tuple[str, str], str] = {}  # (group, name) -> the line logged when it failed


def allowed(group: str, name: str) -> bool:
    """Whether :data:`SETTING` lets the plugin ``name`` of ``group`` load: ``allowed("nxl_hooks.sinks", "jsonl")``."""
    setting = os.environ.get(SETTING)
    if setting is None:
        return True
    wanted = {item.strip() for item in setting.split(",")}
    return name in wanted or f"{group.rpartition('.')[2]}:{name}" in wanted


def contained(error: BaseException) -> BaseException:
    """``error``, raised by a plugin's code (importing it or calling it), for the caller to report as that plugin's
    failure: anything a plugin raises, ``SystemExit`` included, is its own line and never the host's, but a
    ``KeyboardInterrupt`` (the user's Ctrl-C), raised on here.
    ``except BaseException as error: broken(group, name, contained(error))``"""
    if isinstance(error, KeyboardInterrupt):
        raise error
    return error


def broken(group: str, name: str, error: BaseException, *, what: str = "", log: bool = True) -> str:
    """Report the plugin ``name`` of ``group`` as broken by ``error`` (raised loading or using it): one log line
    naming it and what to do, kept for :func:`failure`; returns the line."""
    line = (f"plugin {name!r} ({group}{', ' + what if what else ''}) failed to load "
            f"({typed(error)}); left out: fix or uninstall its package, or leave it out of "
            f"{SETTING}")
    with _lock:
        _failed[(group, name)] = line
    if log:
        _logger.warning("nxl_hooks: %s", line)
    return line


def entry_points(group: str) -> dict[str, metadata.EntryPoint]:
    """The installed entry points of ``group`` that :func:`allowed` lets load, by name (the first installed wins
    where two share a name); read once per group. Unreadable metadata: one log line, none."""
    with _lock:
        if group not in _points:
            try:
                found = metadata.entry_points(group=group)
            except Exception as error:  # noqa: BLE001 - broken package metadata: the built-in parts still work
                broken(group, "*", error)
                found = ()
            points: dict[str, metadata.EntryPoint] = {}
            for point in found:
                points.setdefault(point.name, point)
            _points[group] = points
        return {name: point for name, point in _points[group].items() if allowed(group, name)}


def load(group: str, name: str, *, log: bool = True) -> Any | None:
    """The object of the plugin ``name`` of ``group`` (imported once, then kept); None when none is installed, the
    allow-list leaves it out, or it failed to load (one log line, once: :func:`failure`; ``log=False`` for a caller
    that puts that line in its own refusal instead, so the user reads it once)."""
    point = entry_points(group).get(name)
    if point is None:
        return None
    with _lock:
        key = (group, name)
        if key in _failed:  # failed to load, or its registry refused it: reported once
            return None
        if key in _loaded:
            return _loaded[key]
        try:
            loaded = point.load()
        except BaseException as error:  # noqa: BLE001 - a plugin's SystemExit or import error is its own line
            broken(group, name, contained(error), what=point.value, log=log)
            return None
        _loaded[key] = loaded
        return loaded


def load_all(group: str, register: Callable[[str, Any], Any] | None = None) -> dict[str, Any]:
    """Every allowed plugin of ``group`` that loads, by name, in the order installed. ``register``: a registry's own
    step, called as ``register(name, object)`` for each; a plugin it raises for is left out with its one line, like
    one that fails to load (a ``SystemExit`` too: :func:`contained`). ``load_all(METHODS, register=load_plugin)``"""
    found = {}
    for name in entry_points(group):
        loaded = load(group, name)
        if loaded is None:
            continue
        if register is not None:
            try:
                register(name, loaded)
            except BaseException as error:  # noqa: BLE001 - a plugin its registry refuses is its line, never a raise
                broken(group, name, contained(error))
                continue
        found[name] = loaded
    return found


def failure(group: str, name: str) -> str | None:
    """The line logged when the plugin ``name`` of ``group`` failed to load; None when it did not fail."""
    with _lock:
        return _failed.get((group, name))


def declared(package: str, constant: str) -> dict[str, Any]:
    """Built-in extensions found without importing them: each module of ``package`` (imported) whose source assigns
    ``constant`` a literal at its top level -> that literal, by the module's full name. A registry reads what its
    modules declare this way where importing them all would import their heavy dependencies."""
    found = {}
    for module in pkgutil.iter_modules(sys.modules[package].__path__, f"{package}."):
        spec = importlib.util.find_spec(module.name)
        source = spec.loader.get_source(module.name) if spec is not None and spec.loader is not None else None
        if source is None:  # an install of compiled files alone: the module itself says it, imported
            value = getattr(importlib.import_module(module.name), constant, None)
            if value is not None:
                found[module.name] = value
            continue
        if f"\n{constant} = " not in source:  # parsed only where it may be declared
            continue
        for node in ast.parse(source).body:
            if isinstance(node, ast.Assign) and any(getattr(each, "id", None) == constant for each in node.targets):
                found[module.name] = ast.literal_eval(node.value)
    return found
