"""The crash-safe stream file under its former module name: the writer (:mod:`nxl_hooks.records.writer`: format,
:class:`Sink`, :class:`RotatingSink`) and the reader (:mod:`nxl_hooks.records.reader`: :func:`read_stream`).

    from nxl_hooks.records.sink import Sink, read_stream   # still works; new code imports from writer / reader
"""

from __future__ import annotations

from .reader import Damage, Stream, StreamDamageWarning, StreamError, read_stream
from .writer import RotatingSink, Sink, encode_call, encode_end, encode_step, stream_bytes

__all__ = ["Damage", "RotatingSink", "Sink", "Stream", "StreamDamageWarning", "StreamError", "encode_call",
           "encode_end", "encode_step", "read_stream", "stream_bytes"]
