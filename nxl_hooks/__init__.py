"""nxl_hooks: per-layer NormXLogit token attribution, hooked onto a running transformers model.

    import nxl_hooks as nxl
    with nxl.attach(model, layers="all") as probe:
        model(**enc)
    probe.result().normxlogit   # (layers, rows, seq)
"""

from .attribution import Attribution
from .capture import Probe, attach
from .registry import ArchSpec, UnknownArchitectureError, register_architecture, register_file
from .stream import GenerationCall, Sink, Step, read_stream

__all__ = [
    "ArchSpec",
    "Attribution",
    "GenerationCall",
    "Probe",
    "Sink",
    "Step",
    "UnknownArchitectureError",
    "attach",
    "read_stream",
    "register_architecture",
    "register_file",
]
__version__ = "0.1.0"
