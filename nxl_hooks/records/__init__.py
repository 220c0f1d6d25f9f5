"""What comes out: attributions of forwards, step records of generations, the files they are saved in.

- :mod:`.attribution`: :class:`Attribution` and its safetensors + JSON file
- :mod:`.steps`: :class:`Step` and :class:`GenerationCall`
- :mod:`.sink`: the crash-safe stream file (:class:`Sink`, :class:`RotatingSink`, :func:`read_stream`)
- :mod:`.html`: self-contained HTML pages of records
"""

from .attribution import Attribution
from .sink import RotatingSink, Sink, read_stream
from .steps import GenerationCall, Step

__all__ = ["Attribution", "GenerationCall", "RotatingSink", "Sink", "Step", "read_stream"]
