"""Where things are: per-architecture specs (blocks, head-on-top steps, pooling), no tensors.

``nxl_hooks.arch.specs()["llama"].blocks == "model.layers"``; the family files are ``registry/*.toml``.
"""

from .registry import *  # noqa: F403 - the registry is this layer's whole interface
from .registry import __all__  # noqa: F401
