"""What comes out: attributions of forwards, step records of generations, the files they are saved in.

- :mod:`.attribution`: :class:`Attribution` and its safetensors + JSON file
- :mod:`.steps`: :class:`Step` and :class:`GenerationCall`
- :mod:`.sinks`: where generation records go: :class:`RecordSink`, :func:`make_sink`, :func:`register_sink`
- :mod:`.writer`: the crash-safe stream file and its writers (:class:`Sink`, :class:`RotatingSink`)
- :mod:`.reader`: reading it back (:func:`read_stream`, :class:`Damage`); :mod:`.sink` keeps both's former name
- :mod:`.view`: one generated token as every live reader shows it (:class:`~.view.StepView`)
- :mod:`.parquet`: tidy Parquet rows of step records (:class:`~.parquet.ParquetSink`, ``nxl export``)
- :mod:`.files`: whole files written under a temporary name and renamed
- :mod:`.html`: self-contained HTML pages of records

A file that does not hold together raises :class:`RecordError` (a ValueError); a stream file, :class:`StreamError`.
"""

from .attribution import Attribution, RecordError
from .reader import Damage, StreamDamageWarning, StreamError, read_stream
from .sinks import RecordSink, make_sink, register_sink
from .steps import GenerationCall, Step
from .view import StepView
from .writer import RotatingSink, Sink

__all__ = ["Attribution", "Damage", "GenerationCall", "RecordError", "RecordSink", "RotatingSink", "Sink", "Step",
           "StepView", "StreamDamageWarning", "StreamError", "make_sink", "read_stream", "register_sink"]
