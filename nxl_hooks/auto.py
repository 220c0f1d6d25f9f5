"""``import nxl_hooks.auto``: what ``nxl run`` does, for code you can edit.

    import nxl_hooks.auto                                  # before or after importing transformers
    model = AutoModelForCausalLM.from_pretrained("./my-model")   # attached (unless NXL_MODELS excludes it)
    nxl_hooks.auto.probe(model).calls                      # its records; live: nxl tail --run <run folder>

Every model loaded through ``from_pretrained`` from then on is attached with the options of the ``NXL_*``
environment variables (:mod:`nxl_hooks.apps.serve.settings`; without ``NXL_RUN_DIR``, records stay in memory and
the control socket goes to a private temporary folder, which ``nxl tail`` finds as a live run), and
``transformers serve`` passes request ids. Models loaded before the import are not attached. Nothing raises into
the program: a failure logs one line on the ``nxl_hooks`` logger.
"""

from __future__ import annotations

from typing import Any

from .apps.serve import lazy
from .apps.serve.controller import controller
from .hooks.probe import Probe

__all__ = ["controller", "probe"]


def probe(model: Any) -> Probe | None:
    """The probe ``nxl_hooks.auto`` attached to ``model`` (None when it is not attached: paused, excluded, or
    unsupported; ``controller().status()`` says which)."""
    return vars(model).get("_nxl_probe")


lazy.install()
