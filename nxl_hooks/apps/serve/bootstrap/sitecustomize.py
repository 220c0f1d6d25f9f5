"""The bootstrap ``nxl run`` injects: this folder goes first on PYTHONPATH, and Python imports this file at
start-up, as ``opentelemetry-instrument`` and ``ddtrace-run`` do it.

It only registers import hooks (standard library, nothing else is imported): when the program imports
``transformers.modeling_utils``, every model loaded through ``from_pretrained`` gets a probe
(:mod:`nxl_hooks.apps.serve.patches`); when it imports ``transformers.cli.serving.utils``, ``transformers serve``
passes each request's X-Request-ID to the probe. Settings come from the ``NXL_*`` environment variables that
``nxl run`` sets (:mod:`nxl_hooks.apps.serve.settings`); without ``NXL_RUN_DIR`` this file does nothing but chain.
Then it imports the ``sitecustomize`` it shadows, if there is one. Nothing here raises into the program. A program
whose own environment has no nxl_hooks (another interpreter than nxl's) is lent nxl_hooks alone, never the rest of
nxl's environment (:mod:`nxl_hooks.apps.serve.installed`), or, lacking what nxl_hooks needs, told so in one line;
one without transformers, which loads no model, runs untouched and is told nothing.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _say(text):
    try:
        sys.stderr.write(f"nxl_hooks: {text}\n")
    except Exception:  # noqa: BLE001 - no stderr: stay silent
        pass


def _load(name):
    """A standard-library-only module of this package, by path (importing the package would import torch)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_nxl_hooks_{name}", os.path.join(os.path.dirname(_HERE),
                                                                                     f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _install():
    import importlib.util

    if importlib.util.find_spec("nxl_hooks") is None:  # another environment than nxl's: lend nxl_hooks alone
        if importlib.util.find_spec("transformers") is None:
            return  # no model loads here (every child Python inherits PYTHONPATH: build tools, helpers): nothing lost
        installed = _load("installed")
        refusal = installed.refusal(sys.executable)
        if refusal is not None:
            _say(refusal)
            return
        installed.reach()
    _load("lazy").install()


def _chain():
    """Import the sitecustomize this one shadows (the next one on sys.path), under the same name."""
    own = sys.modules.get("sitecustomize")
    sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _HERE]
    del sys.modules["sitecustomize"]
    try:
        import sitecustomize  # noqa: F401 - the shadowed one, found now that this folder is off sys.path
    except ImportError as error:
        if error.name != "sitecustomize":
            _say(f"the program's own sitecustomize failed to import ({error})")
        sys.modules["sitecustomize"] = own
    except Exception as error:  # noqa: BLE001 - the shadowed one's own failure: Python would report it too
        _say(f"the program's own sitecustomize raised {type(error).__name__}: {error}")
        sys.modules["sitecustomize"] = own


if os.environ.get("NXL_RUN_DIR"):
    try:
        _install()
    except Exception as error:  # noqa: BLE001 - never into the program
        _say(f"bootstrap not installed ({type(error).__name__}: {error}); the program runs unrecorded")
try:
    _chain()
except Exception as error:  # noqa: BLE001
    _say(f"could not chain to the program's own sitecustomize ({type(error).__name__}: {error})")
