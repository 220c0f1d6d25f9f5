"""nxl_hooks: per-layer NormXLogit token attribution, hooked onto a running transformers model.

    import nxl_hooks as nxl
    with nxl.attach(model, layers="all") as probe:
        model(**enc)
    probe.result().normxlogit   # (layers, rows, seq)

The package in layers, each importing only from the ones above it in this list:
``arch`` (where things are), ``method`` (what is computed), ``records`` (what comes out), ``hooks`` (when, on a
live model), ``eval`` (checking), ``apps`` (the command line and views). The module paths of 0.1
(``nxl_hooks.evaluate``, ``nxl_hooks.stream``, ...) were removed in 0.2.0: CHANGELOG.md says where each went.
"""

from .arch import ArchSpec, RegistryError, UnknownArchitectureError, register_architecture, register_file
from .arch.version import VERSION  # before .hooks: a torch below the floor is one line (arch/version.py)
from .hooks import Probe, attach, detach_all, explain
from .method.protocol import Given, Method
from .method.registry import get_method, method_names, register_method
from .records import (Attribution, GenerationCall, RecordError, RecordSink, RotatingSink, Sink, Step,
                      StreamDamageWarning, StreamError, make_sink, read_stream, register_sink)

__all__ = [
    "ArchSpec",
    "Attribution",
    "GenerationCall",
    "Given",
    "Method",
    "Probe",
    "RecordError",
    "RecordSink",
    "RegistryError",
    "RotatingSink",
    "Sink",
    "Step",
    "StreamDamageWarning",
    "StreamError",
    "UnknownArchitectureError",
    "attach",
    "detach_all",
    "explain",
    "get_method",
    "make_sink",
    "method_names",
    "read_stream",
    "register_architecture",
    "register_file",
    "register_method",
    "register_sink",
]
__version__ = VERSION
