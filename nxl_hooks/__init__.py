"""nxl_hooks: per-layer NormXLogit token attribution, hooked onto a running transformers model.

    import nxl_hooks as nxl
    with nxl.attach(model, layers="all") as probe:
        model(**enc)
    probe.result().normxlogit   # (layers, rows, seq)

The package in layers, each importing only from the ones above it in this list:
``arch`` (where things are), ``method`` (what is computed), ``records`` (what comes out), ``hooks`` (when, on a
live model), ``eval`` (checking), ``apps`` (the command line and views).
"""

from . import _moved
from .arch import ArchSpec, RegistryError, UnknownArchitectureError, register_architecture, register_file
from .hooks import Probe, attach, detach_all, explain
from .records import (Attribution, GenerationCall, RecordError, RecordSink, RotatingSink, Sink, Step, StreamError,
                      make_sink, read_stream, register_sink)

__all__ = [
    "ArchSpec",
    "Attribution",
    "GenerationCall",
    "Probe",
    "RecordError",
    "RecordSink",
    "RegistryError",
    "RotatingSink",
    "Sink",
    "Step",
    "StreamError",
    "UnknownArchitectureError",
    "attach",
    "detach_all",
    "explain",
    "make_sink",
    "read_stream",
    "register_architecture",
    "register_file",
    "register_sink",
]
__version__ = "0.1.0"

_moved.install()


def __getattr__(name: str) -> object:
    # ``nxl.stream``, ``nxl.evaluate``...: the old module names, as attributes of the package too.
    if name in _moved.MOVED:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
