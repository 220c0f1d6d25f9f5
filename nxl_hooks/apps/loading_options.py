"""The loading options: one option group (:mod:`nxl_hooks.apps.schema`), :class:`Loading`, read alike from the
flags every loading command takes, from :func:`~nxl_hooks.apps.loading.load_model`'s keyword arguments and from
``nxl run``'s ``NXL_LOAD``, with the names they take.

    loading = Loading.from_args(args)                    # --dtype bfloat16 --load-in-8bit ...
    model, tokenizer = load_model("./my-model", **loading)
    Loading.from_json('{"dtype": "bfloat16"}') == {"dtype": "bfloat16"}
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

from ..arch.text import flag_and_keyword
from ..method.select import int_text
from ..records.files import not_a_folder, user_path
from .schema import Option, markdown_table as group_table, options, read_args, read_json, setting, switch

__all__ = ["DTYPES", "HEAD_CLASSES", "QUANTIZE", "Loading", "markdown_table", "named", "read_device_map",
           "read_max_memory"]

#: The Auto class per head kind the library explains (regression loads as sequence classification).
HEAD_CLASSES = {
    "causal_lm": "AutoModelForCausalLM",
    "sequence_classification": "AutoModelForSequenceClassification",
    "masked_lm": "AutoModelForMaskedLM",
}
#: ``--dtype`` names; "auto" is the checkpoint's own dtype.
DTYPES = ("auto", "float32", "float16", "bfloat16")
#: bitsandbytes modes: 8bit, 4bit (nf4), fp4.
QUANTIZE = ("8bit", "4bit", "fp4")


def _one_of(names: Sequence[str]) -> Callable[[str], str]:
    def read(text: str) -> str:
        if text not in names:
            raise ValueError(f"{text!r}: use one of {', '.join(names)}")
        return text

    return read


def read_max_memory(text: str) -> dict[Any, Any]:
    """``0=10GiB,cpu=30GiB`` -> ``{0: "10GiB", "cpu": "30GiB"}`` (accelerate's max_memory; ``cpu=1000``: bytes,
    ``{"cpu": 1000}``); ValueError otherwise."""
    limits: dict[Any, str] = {}
    for part in text.split(","):
        device, sep, size = part.strip().partition("=")
        if not sep or not device or not size:
            raise ValueError(f"{text!r}: use DEVICE=SIZE pairs like 0=10GiB,cpu=30GiB")
        limits[_device_key(device)] = size
    return _memory_devices(limits)


#: The units accelerate reads after a number, in any case (a lower-case b in GB/MB/KB is bits); digits alone are bytes.
_UNITS = ("GIB", "MIB", "KIB", "GB", "MB", "KB")


def _device_key(text: str) -> Any:
    """A device as text: a number (ASCII digits) is the accelerator's; anything else stays a name."""
    number = int_text(text)
    return text if number is None else number


def _memory_devices(limits: dict[Any, Any]) -> dict[Any, Any]:
    """``limits``, each device (but cpu and disk) checked to be one this machine has, as --device-map's are, and
    each size to be one accelerate reads (digits alone: bytes, which it takes as a number only): accelerate would
    raise deep inside the load."""
    for device in limits:
        if device in _STRATEGIES:  # (a strategy places a model: it is no device to cap)
            raise ValueError(f"{device!r} is a placing strategy, not a device; {_MEMORY_PLACES}")
        if device not in ("cpu", "disk"):
            _present(device, "cap cpu, or a device it has", places=_MEMORY_PLACES)
    return {device: _size(size) for device, size in limits.items()}


def _size(size: Any) -> Any:
    if not isinstance(size, str):
        return size
    if (number := int_text(size)) is not None and number >= 0:
        return number
    unit = next((unit for unit in _UNITS if size.upper().endswith(unit)), None)
    try:  # a number as accelerate reads it (float() of what comes before the unit: "10 GiB", "1e1GiB", ".5GB")
        amount = float(size[: -len(unit)]) if unit else math.nan
    except ValueError:
        amount = math.nan
    if not (math.isfinite(amount) and amount >= 0):  # (accelerate raises OverflowError on inf)
        raise ValueError(f"{size!r:.80} is no size: give bytes (like 1000000000) or a number and a unit, GiB, MiB, "
                         "KiB, GB, MB or KB (like 10GiB)")
    return size


def _memory_map(value: Any) -> dict[Any, Any]:
    """max_memory as JSON or Python gives it: ``{"0": "10GiB", "cpu": 2**30}`` (a device number as text, as JSON
    writes it, is the number again)."""
    if not isinstance(value, Mapping) or not all(isinstance(size, (str, int)) and not isinstance(size, bool)
                                                 for size in value.values()):
        raise ValueError(f"{value!r:.80}: give DEVICE=SIZE pairs like 0=10GiB,cpu=30GiB, or a mapping like "
                         "{0: '10GiB', 'cpu': '30GiB'}")
    return _memory_devices({_device_key(device) if isinstance(device, str) else device: size
                            for device, size in value.items()})


#: device_map values that name a strategy (accelerate's)
_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def read_device_map(text: str) -> Any:
    """``auto`` | ``balanced`` | ``sequential`` | ``cpu`` | ``cuda:0`` | a JSON object ``{module: device}``."""
    if not text.startswith("{"):
        return _placement(_device_key(text))  # a number is the accelerator's, as accelerate's
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{text!r} is not valid JSON: {error}") from None
    return _placement(value)


#: A mapping that offloads part of a model to disk, as advice: said as one kind of model's (a Llama-like decoder's:
#: the model is not known where the option is read, and a BERT's modules have other names), its blocks on disk,
#: which hold no weight tied to another module's (lm_head on disk apart from a tied embedding fails the load).
_MODULES_ON_DISK = ("a mapping of the model's own module names (print(model) shows them), such as a Llama-like "
                    'decoder\'s {"model.embed_tokens": "cpu", "model.layers": "disk", "model.norm": "cpu", '
                    '"lm_head": "cpu"}')
#: What a module's place in a mapping may be, and what the whole model's may be: disk only for a module, a
#: strategy only for the whole model (accelerate's strategies make a mapping; torch reads "auto" as no device).
_MODULE_PLACES = "give cpu, disk, or a device such as cuda:0 or its number"
_MODEL_PLACES = ("give auto, balanced, sequential, cpu, a device such as cuda:0 or its number, or a mapping "
                 "{module: device} (which may put modules on disk)")
#: What --max-memory caps.
_MEMORY_PLACES = "cap cpu, disk, or a device such as cuda:0 or its number"


def _placement(value: Any) -> Any:
    """A device_map that is not text (a mapping, a device number, a torch.device): from_pretrained reads it."""
    if isinstance(value, (bool, list, tuple, float)):
        raise ValueError(f"{value!r:.80}: give auto, a device, or a mapping {{module: device}}")
    if isinstance(value, Mapping):
        if not value:  # (transformers fails on it with KeyError: '', said as the one word '')
            raise ValueError("{}: an empty mapping places no module; give auto, a device, or a mapping "
                             "{module: device}")
        for device in value.values():
            _present(device, "give cpu, disk, or a device it has", module=True)
        # "" (the root module) beside a module on disk fails the load ("weight is on the meta device")
        if "" in value and "disk" in value.values():
            raise ValueError(f"{json.dumps(value, default=str):.80}: \"\" (the whole model) beside modules on disk "
                             f"does not load (their weights stay on the meta device); drop \"\" and name each module: "
                             f"{_MODULES_ON_DISK}")
        return dict(value)
    if value == "disk":  # (a module's place in a mapping, not the whole model's)
        raise ValueError("'disk' for the whole model: transformers places no model on disk alone; give auto with "
                         f"{named('max_memory')}, which offloads what does not fit, or {_MODULES_ON_DISK}")
    return _present(value)


def _present(device: Any, fix: str = "give auto, cpu, or a device it has", *, module: bool = False,
             places: str | None = None) -> Any:
    """``device`` (a strategy, a device name or number), checked to be one this machine has: a typo or a GPU that
    is not there is one line now, not a traceback from the load. ``fix``: what to give instead. ``module``: the
    place of a module in a mapping, which may be disk and no strategy (the whole model's: the other way round).
    ``places``: what a name that is no device should be (default: a module's or the whole model's places)."""
    import torch

    if isinstance(device, str) and device in (("disk",) if module else (*_STRATEGIES, "disk")) \
            or isinstance(device, bool):
        return device
    if module and device in _STRATEGIES:  # (the load failed with torch's RuntimeError: no device type 'auto')
        raise ValueError(f"{device!r}: a strategy places the whole model, not one module of a mapping (give "
                         f"{named('device_map')} {device} alone); in a mapping, {_MODULE_PLACES}")
    if isinstance(device, int):  # the accelerator's device number (accelerate's reading)
        kind, index, count = "accelerator", device, torch.accelerator.device_count()
    else:
        try:
            where = torch.device(device)
        except (RuntimeError, TypeError, ValueError):
            raise ValueError(f"{device!r:.80} is no device: "
                             f"{places or (_MODULE_PLACES if module else _MODEL_PLACES)}") from None
        if where.type == "meta":  # shapes without data: the load fails reading weights into it
            raise ValueError(f"{device!r:.80} holds no weights (the meta device has shapes, not data); {fix}")
        if where.type == "cpu":  # one device: accelerate fails in the forward moving weights to cpu:1
            if where.index:
                raise ValueError(f"{device!r:.80}: the CPU is one device, with no number; write cpu")
            return device
        module = getattr(torch, where.type, None)
        kind, index = where.type, where.index or 0
        count = module.device_count() if hasattr(module, "device_count") else 0
    if index < 0 or index >= count:
        have = f"{count} {kind} device(s)" if count else f"no {kind} device"
        raise ValueError(f"{device!r:.80}: this machine has {have}; {fix}")
    return device


def _dtype(value: Any) -> Any:
    """A torch dtype given in Python: its name where it is one of :data:`DTYPES` (so that NXL_LOAD can hold it)."""
    import torch

    if not isinstance(value, torch.dtype):
        raise ValueError(f"{value!r:.80}: use one of {', '.join(DTYPES)} (or a torch dtype)")
    name = str(value).removeprefix("torch.")
    return name if name in DTYPES else value


def _folder(text: str) -> str:
    """A folder to write (created when missing), ``~`` expanded: refused where it or a folder above it is a file."""
    why = not_a_folder(text)
    if why is not None:
        raise ValueError(why)
    return str(user_path(text))


def _gguf_name(text: str) -> str:
    if not text.lower().endswith(".gguf"):
        raise ValueError(f"{text!r}: name the .gguf file inside MODEL")
    return text


def named(name: str, value: str = "") -> str:
    """The loading option ``name`` (a field of :class:`Loading`) as every message names it, its flags as declared
    (:func:`~nxl_hooks.arch.text.flag_and_keyword`): ``named("head")`` -> ``--head (head=)``,
    ``named("quantize")`` -> ``--load-in-8bit/--load-in-4bit (quantize=)``, ``named("tp")`` -> ``--tp (tp=True)``."""
    (option,) = options(Loading, where=lambda option: option.name == name)
    return flag_and_keyword(name, value, flags="/".join(option.flags), switch=option.is_switch)


@dataclass(frozen=True, eq=False)
class Loading(Mapping[str, Any]):
    """How a model is loaded: one option group (:mod:`nxl_hooks.apps.schema`), read alike from the flags every
    loading command takes (:meth:`from_args`), from :func:`load_model`'s keyword arguments and from ``NXL_LOAD``
    (:meth:`from_json`), and checked once, here. It is also a read-only mapping of the options that are set, so it
    is ``load_model``'s keyword arguments as it is::

        loading = Loading.from_args(args)                # --dtype bfloat16 --load-in-8bit ...
        model, tokenizer = load_model("./my-model", **loading)
        Loading.from_json('{"dtype": "bfloat16"}') == {"dtype": "bfloat16"}

    ``nxl run`` hands the options marked ``program`` to the program's own ``from_pretrained`` calls (NXL_LOAD);
    the others (``--head``, ``--tp``, ``--chat``) belong to a command that loads its model itself.
    """

    head: str | None = setting(None, Option(
        None, _one_of(tuple(HEAD_CLASSES)), "which head to load when config.architectures does not say (a .gguf "
        "file: causal_lm)", flag="--head", metavar="HEAD", choices=tuple(HEAD_CLASSES), program=False))
    dtype: Any = setting(None, Option(
        None, _one_of(DTYPES), "load the weights in this dtype (auto: the checkpoint's)", flag="--dtype",
        metavar="DTYPE", choices=DTYPES, json=_dtype))
    device_map: Any = setting(None, Option(
        None, read_device_map, "accelerate placement: auto | balanced | sequential | cpu | cuda:0 | JSON {module: "
        "device}", flag="--device-map", metavar="MAP", json=_placement))
    max_memory: dict | None = setting(None, Option(
        None, read_max_memory, "with --device-map: what each device may hold, like 0=10GiB,cpu=30GiB (digits alone: "
        "bytes)", flag="--max-memory", metavar="LIMITS", json=_memory_map))
    offload_folder: str | None = setting(None, Option(
        None, _folder, "with --device-map: the folder weights offloaded to disk are written to, where transformers "
        "writes them anew (a MoE model's experts); created when missing", flag="--offload-folder", metavar="DIR"))
    quantize: str | None = setting(None, Option(
        None, _one_of(QUANTIZE), "quantize with bitsandbytes: 8bit, 4bit (nf4) or fp4 (fp4: in Python only)",
        switches=(("--load-in-8bit", "8bit", "quantize with bitsandbytes, 8-bit"),
                  ("--load-in-4bit", "4bit", "quantize with bitsandbytes, 4-bit nf4"))))
    gguf_file: str | None = setting(None, Option(
        None, _gguf_name, "the .gguf file inside MODEL (a folder or hub id); or pass the .gguf file as MODEL",
        flag="--gguf-file", metavar="NAME"))
    tp: bool = setting(False, Option(
        None, switch, "tensor parallel: launched by torchrun, load with tp_plan='auto' (one shard per process; rank "
        "0 prints and writes)", flag="--tp", program=False))
    chat: bool = setting(False, Option(
        None, switch, "wrap each text in the tokenizer's chat template as the user's message, with the assistant's "
        "turn after it", flag="--chat", program=False))

    def __post_init__(self) -> None:
        for option in options(type(self)):  # a keyword argument is read as NXL_LOAD's JSON is
            value = getattr(self, option.name)
            if value is None or value is option.default:
                object.__setattr__(self, option.name, option.default)
                continue
            try:
                object.__setattr__(self, option.name, option.accept(value))
            except ValueError as error:
                raise ValueError(f"{option.name}: {error}") from None
        clash = [name for name in ("device_map", "max_memory", "offload_folder", "quantize", "gguf_file")
                 if getattr(self, name) is not None]
        if self.tp and clash:
            raise ValueError(f"{named('tp')} with {', '.join(map(named, clash))}: tensor parallel places one shard "
                             "per torchrun process itself; drop those (a GGUF file: nxl convert it, then load the "
                             "folder)")

    def loadable(self) -> "Loading":
        """Itself, when a model can be loaded with these options alone; ValueError otherwise (max_memory without a
        device_map, or offload_folder without one). Not asked of NXL_LOAD's options: they are defaults that the
        program's own call completes."""
        if self.max_memory is not None and self.device_map is None:
            raise ValueError(f"{named('max_memory')} needs {named('device_map')}, e.g. auto: it caps what each "
                             "device holds")
        if self.offload_folder is not None and self.device_map is None:
            raise ValueError(f"{named('offload_folder')} needs {named('device_map')}, auto with "
                             f"{named('max_memory')} or a mapping naming disk: without one nothing is offloaded")
        return self

    def followed(self) -> "Loading":
        """Itself, when transformers follows every option given; ValueError otherwise: max_memory with a device_map
        that is not a strategy, or offload_folder with one that places nothing on disk. Asked where the model is
        loaded with these options alone (``load_model``), not of ``nxl run``'s, whose program's own call may give
        the strategy."""
        # transformers reads max_memory only to make a strategy's map, and a device or a mapping that names no disk
        # offloads nothing to disk: either was accepted and ignored, the model loaded as if it were not given
        strategy = isinstance(self.device_map, str) and self.device_map in _STRATEGIES
        given = self.device_map if isinstance(self.device_map, str) else json.dumps(self.device_map, default=str)
        where = named("device_map", f"{given:.80}")
        if self.max_memory is not None and not strategy:
            raise ValueError(f"{named('max_memory')} with {where}: a device or a mapping places every module itself, "
                             f"so the limits would be ignored; give the device map {' or '.join(_STRATEGIES)} with "
                             f"them, or drop {named('max_memory')}")
        on_disk = isinstance(self.device_map, Mapping) and "disk" in self.device_map.values()
        if self.offload_folder is not None and not (strategy or on_disk):
            raise ValueError(f"{named('offload_folder')} with {where}: it places nothing on disk, so the folder "
                             "would not be used; give a mapping naming \"disk\" for some modules, or auto with "
                             f"{named('max_memory')}, or drop {named('offload_folder')}")
        return self

    def __getitem__(self, name: str) -> Any:
        if name not in self._given():
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._given())

    def __len__(self) -> int:
        return len(self._given())

    def _given(self) -> list[str]:
        """The options set (not None, not off), in field order."""
        return [option.name for option in options(type(self)) if getattr(self, option.name) not in (None, False)]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Loading":
        """The options of parsed :func:`~nxl_hooks.apps.options.add_loading_options` flags (ValueError for a
        combination that cannot work)."""
        return cls(**read_args(cls, args)).loadable()

    @classmethod
    def program(cls, values: Mapping[str, Any]) -> "Loading":
        """The options ``nxl run`` hands to a program's own loads, from a mapping of them (NXL_LOAD's object);
        ValueError naming a key that is not one of them or a bad value."""
        return cls(**read_json(cls, values, where=lambda option: option.program))

    @classmethod
    def from_json(cls, text: str) -> "Loading":
        """NXL_LOAD's text: a JSON object of the ``program`` options (:meth:`program`)."""
        try:
            values = json.loads(text)
        except ValueError:
            values = None
        names = ", ".join(option.name for option in options(cls) if option.program)
        if not isinstance(values, dict):
            raise ValueError(f"{text!r:.200}: a JSON object of {names}")
        try:
            return cls.program(values)
        except ValueError as error:
            raise ValueError(f"{text!r:.200}: a JSON object of {names} ({error})") from None

    def to_json(self) -> str:
        """The text :meth:`from_json` reads back; empty when no option is set."""
        return json.dumps(dict(self), default=str) if self else ""  # (default: a torch dtype not in DTYPES)


def markdown_table() -> str:
    """:class:`Loading` as a markdown table (flag, keyword, whether nxl run takes it, what it sets): the one in
    ``docs/command-line.md`` (:mod:`nxl_hooks.apps.schema` rewrites it)."""
    return group_table(Loading)
