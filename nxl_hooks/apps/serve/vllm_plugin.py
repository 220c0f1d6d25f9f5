"""vLLM's ``vllm.general_plugins`` entry point: what ``nxl run`` does, in every vLLM process, when ``NXL_*`` settings
say to record.

vLLM calls :func:`register` in each of its processes (API server, EngineCore, Worker). Without ``NXL_RUN_DIR``
in the environment it returns at once and vLLM runs exactly as without nxl_hooks. With it (``nxl run`` sets it; so
may a container's environment, for a vLLM started without ``nxl run``), it registers the import hooks of ``nxl
run``'s bootstrap (:data:`~nxl_hooks.apps.serve.lazy.HOOKS`), once per process, so that vLLM's worker is recorded
even where the bootstrap's ``sitecustomize`` does not run.

    [project.entry-points."vllm.general_plugins"]
    nxl_hooks = "nxl_hooks.apps.serve.vllm_plugin:register"
"""

from __future__ import annotations

import os

__all__ = ["register"]


def register() -> None:
    """Install ``nxl run``'s import hooks when ``NXL_RUN_DIR`` is set; else nothing. Never raises into vLLM."""
    if not os.environ.get("NXL_RUN_DIR"):
        return
    try:
        from . import lazy

        lazy.install()
    except Exception as error:  # noqa: BLE001 - vLLM runs unrecorded
        from ...hooks.guard import reason

        reason("the vLLM plugin of nxl_hooks", error)
