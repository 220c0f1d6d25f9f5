"""What the bootstrap changes in transformers, as each module is first imported (:mod:`.lazy`).

- ``transformers.modeling_utils``: ``PreTrainedModel.from_pretrained`` hands every model it returns to the
  process's :class:`~nxl_hooks.apps.serve.controller.Controller` (only the outermost call, when loads nest), and
  ``transformers.models.auto.modeling_auto``: each ``AutoModel*`` class's ``from_pretrained`` likewise.
- ``transformers.cli.serving.utils``: request ids of ``transformers serve``, a part of the engine of transformers
  (:func:`nxl_hooks.hooks.engines.transformers_serve.patch_serving`; :data:`~nxl_hooks.apps.serve.lazy.HOOKS` names it).
- ``vllm.v1.worker.gpu_model_runner`` / ``cpu_model_runner`` (vLLM's V1 runners) and ``vllm.v1.worker.gpu.model_runner``
  (V2, whose requests are each said not recorded): each model runner's ``load_model`` hands the controller a view of
  the model it loaded (:class:`~nxl_hooks.hooks.engines.vllm.VllmForCausalLM`), which the vLLM engine follows;
  ``vllm.engine.arg_utils``: engines are made recordable
  (:func:`~nxl_hooks.hooks.engines.vllm.patch_engine_args`).

Each patch is applied once (a marker on the wrapper), keeps the original's name and signature, and never raises
into the program: a failure inside a wrapper is logged as one line and the original runs on.
"""

from __future__ import annotations

import functools
import threading
from types import ModuleType
from typing import Any

from ...hooks.engines.vllm import V2_RUNNER_MODULE
from ...hooks.guard import logger, one_line, reason
from .controller import controller

__all__ = ["patch_auto_models", "patch_modeling_utils", "patch_vllm_runner"]

_MARK = "__nxl_patched__"
_loading = threading.local()  # depth of from_pretrained calls in this thread


def _patched(function: Any) -> bool:
    return getattr(function, _MARK, False)


def patch_modeling_utils(module: ModuleType) -> None:
    """Wrap ``PreTrainedModel.from_pretrained``: every model it returns is adopted by the controller."""
    _wrap_from_pretrained(module.PreTrainedModel)


def patch_auto_models(module: ModuleType) -> None:
    """Wrap the ``from_pretrained`` of every ``AutoModel*`` class as ``PreTrainedModel``'s: an auto class reads
    the config before any model class is called, so a loading default it needs (``--gguf-file`` for a folder
    holding a GGUF file alone) must reach it there. (Each auto class holds its own copy of the method.)"""
    classes = [module._BaseAutoModelClass]
    for cls in classes:
        classes.extend(cls.__subclasses__())
        if "from_pretrained" in vars(cls):
            _wrap_from_pretrained(cls)


def _wrap_from_pretrained(cls: type) -> None:
    """Wrap ``cls.from_pretrained``: the outermost call in a thread gets :func:`_with_defaults` and hands the model
    it returns to the controller; the calls it makes (an auto class calling a model class, a model loading its
    parts) run as they are."""
    original = vars(cls)["from_pretrained"].__func__
    if _patched(original):
        return

    @functools.wraps(original)
    def from_pretrained(klass: type, *args: Any, **kwargs: Any) -> Any:
        depth, given = getattr(_loading, "depth", 0), kwargs
        name = str(args[0] if args else kwargs.get("pretrained_model_name_or_path", ""))
        if depth == 0:
            kwargs = _with_defaults(name, kwargs)
        _loading.depth = depth + 1
        try:
            try:
                if "quantization_config" in kwargs and "quantization_config" not in given:
                    # nxl run's: transformers would keep another one the model is saved with, warning only
                    from ..loading import check_program_load

                    check_program_load(name, kwargs)
                model = original(klass, *args, **kwargs)
            except Exception as error:
                if kwargs is given:  # the program's own load failed: its own error, as without nxl run
                    raise
                # nxl run's loading options cannot work here (a device it lacks, a file the model has not):
                # the model loads as the program asked, and that is said
                logger.warning("nxl_hooks: the loading options of nxl run were not applied to %s (%s: %s); it "
                               "loads as the program asked", args[0] if args else "the model", type(error).__name__,
                               one_line(error))
                model = original(klass, *args, **given)
        finally:
            _loading.depth = depth
        if depth == 0:  # a model class loading its parts calls from_pretrained again: adopt the whole only
            _adopt(model, name)
        return model

    setattr(from_pretrained, _MARK, True)
    cls.from_pretrained = classmethod(from_pretrained)


def _with_defaults(name: str, kwargs: dict) -> dict:
    """``kwargs`` plus the loading options of ``nxl run`` (--dtype, --load-in-8bit...) the program did not set
    itself, for the models ``--models`` selects."""
    try:
        settings = controller().settings
    except Exception:  # noqa: BLE001 - bad NXL_* settings: _adopt says so, once
        return kwargs
    if not settings.load or not settings.selects(name):
        return kwargs
    try:
        from ..loading import program_defaults

        defaults = program_defaults(settings.load)
        if kwargs.get("torch_dtype") is not None:  # the program set the dtype under its older name, which
            defaults.pop("dtype", None)  # from_pretrained reads only when dtype is not given
        return {**defaults, **kwargs}
    except Exception as error:  # noqa: BLE001 - the program loads as it asked
        reason("the loading options of nxl run", error)
        return kwargs


def _adopt(model: Any, name: str) -> None:
    try:
        controller().adopt(model, name, at_load=True)
    except Exception as error:  # noqa: BLE001 - bad NXL_* settings: the program runs unrecorded
        reason(f"model {name}", error)


#: The model runner classes whose ``load_model`` is wrapped, by the module that defines each: V1's, followed, and
#: V2's (the CPU's V2 runner is a subclass), whose requests are each said not recorded.
_RUNNERS = {"vllm.v1.worker.gpu_model_runner": "GPUModelRunner", "vllm.v1.worker.cpu_model_runner": "CPUModelRunner",
            V2_RUNNER_MODULE: "GPUModelRunner"}


def patch_vllm_runner(module: ModuleType) -> None:
    """Wrap the ``load_model`` of ``module``'s vLLM model runner class: the model it loads is adopted by the
    controller, as a :class:`~nxl_hooks.hooks.engines.vllm.VllmForCausalLM` (kept on the runner: the controller
    holds models weakly), under the name vLLM loaded it from."""
    cls = getattr(module, _RUNNERS.get(module.__name__, ""), None)
    original = vars(cls).get("load_model") if cls is not None else None
    if original is None or _patched(original):
        return

    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        if "_nxl_view" not in vars(self):  # a subclass's load_model calling its parent's: adopted once
            _adopt_vllm(self)
        return out

    setattr(load_model, _MARK, True)
    cls.load_model = load_model


def _adopt_vllm(runner: Any) -> None:
    name = "vllm"
    try:
        from ...hooks.engines.vllm import VllmForCausalLM

        name = str(runner.vllm_config.model_config.model)
        view = vars(runner)["_nxl_view"] = VllmForCausalLM(runner)
    except Exception as error:  # noqa: BLE001 - vLLM serves unrecorded
        reason(f"vLLM model {name}", error)
        return
    _adopt(view, name)
