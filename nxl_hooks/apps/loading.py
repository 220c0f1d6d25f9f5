"""Load a task model and its tokenizer from a local folder, a hub id or a GGUF file, picking the head from the
config, with the loading options every command takes (``nxl ... --dtype --device-map --load-in-8bit ...``: the
group :class:`~nxl_hooks.apps.loading_options.Loading`, checked there).

    model, tokenizer = load_model("./my-model")                          # or "org/name" on the hub
    model, tokenizer = load_model("gpt2", head="causal_lm", dtype="bfloat16", device_map="auto")
    model, tokenizer = load_model("./smollm2.Q4_1.gguf", quantize="8bit")  # GGUF, then bitsandbytes 8-bit

A local folder and a hub id both go through ``from_pretrained``; a path that does not exist is an error
here (not a hub lookup), so a typo in a path fails fast with a clear message.

GGUF (gguf and accelerate: ``pip install "nxl_hooks[gguf]"``): transformers reads the file's config, tokenizer
and weights and dequantizes the weights into plain tensors (float32 unless ``dtype`` says otherwise). A GGUF file
holds a language model, so the head defaults to ``causal_lm``. transformers refuses a GGUF file together with a bitsandbytes config, so
``quantize`` with GGUF loads the dequantized model first and quantizes its weights in memory (``from_pretrained``
with ``state_dict``): nothing is written to disk, at the cost of holding the dequantized model while its
quantized copy is built. Either way the model keeps what the file's header says of its quantization (its file type
and tensors per GGML type, not its name), which its records' ``quantization`` reports
(:data:`~nxl_hooks.method.placement.DEQUANTIZED_FROM`).
"""

from __future__ import annotations

import atexit
import collections
import importlib.util
import json
import logging
import math
import os
import re
import secrets
import shlex
import shutil
import stat
import sys
import tempfile
import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping

from ..arch.spec import UNEXPLAINED, class_head
from ..arch.text import install_command
from ..method.placement import DEQUANTIZED_FROM
from ..method.subject import PROMPT_LEARNING
from ..records.files import not_a_folder, user_path
from .loading_options import (DTYPES, HEAD_CLASSES, QUANTIZE, Loading, markdown_table, named, read_device_map,
                              read_max_memory)

__all__ = ["DTYPES", "HEAD_CLASSES", "QUANTIZE", "Loading", "check_explainable", "check_gguf", "check_program_load",
           "convert_gguf", "gguf_serve_refusal", "head_from_architectures", "load_model", "markdown_table",
           "model_files", "program_defaults", "quantization_config", "read_device_map", "read_max_memory"]

#: Files one of which a folder's tokenizer is read from; without any, transformers builds an empty-vocabulary
#: tokenizer that reads every word as unknown, silently (tokenizer_config.json names a tokenizer but need not hold its
#: vocabulary: :func:`_check_vocabulary` refuses one loaded without it).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model",
                    "spiece.model", "sentencepiece.bpe.model")


def head_from_architectures(architectures: list[str] | None, config: Any = None) -> str | None:
    """The head kind named by ``config.architectures`` (``["BertForMaskedLM"]`` -> ``"masked_lm"``), or None;
    ``config`` tells XLM's bidirectional ``XLMWithLMHeadModel`` for a masked LM (:func:`~..arch.spec.class_head`)."""
    kinds = (class_head(name, config) for name in architectures or ())
    return next((kind.value for kind in kinds if kind is not None), None)


def _local_folder(name: str, subfolder: str | None) -> Path:
    """Where a local model's files are: ``name``'s ``subfolder`` where one is given, which transformers reads a
    folder's files from as it does a hub repository's (``from_pretrained(folder, subfolder="text")``)."""
    return user_path(name) / (subfolder or "")


def _check_local(name: str, gguf_file: str | None, subfolder: str | None = None) -> None:
    root = user_path(name)
    if root.exists():
        path = _local_folder(name, subfolder)  # (a subfolder's tokenizer may be the root's)
        if subfolder:  # named in each line below: the files looked for are there, not beside name
            name = os.path.join(name, subfolder)
        if gguf_file is not None:
            if not (path / gguf_file).is_file():
                raise FileNotFoundError(f"{name} has no file {gguf_file!r}: check {named('gguf_file')}, a name "
                                        "inside MODEL")
        elif not (path / "config.json").is_file() and (path / "adapter_config.json").is_file():
            raise FileNotFoundError(_adapter_refusal(name, path))
        elif not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{name} has no config.json: pass a folder written by model.save_pretrained() (with its tokenizer), "
                "or a .gguf file"
            )
        elif not any((folder / file).is_file() for folder in (path, root) for file in _TOKENIZER_FILES):
            raise FileNotFoundError(
                f"{name} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}): save it beside the model with "
                "tokenizer.save_pretrained(folder)"
            )
        return
    # Hub ids are "name" or "org/name"; anything else that does not exist is a mistyped path.
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name:
        raise FileNotFoundError(f"no model folder at {name}: check the path (or pass a hub id like org/name)")


def _adapter_refusal(name: str, path: Path) -> str:
    """What to do with a PEFT adapter folder: the commands load whole models only (no adapter option), and the
    adapter's model is its base model with the adapter merged in (the same forward), or the PeftModel in Python. A
    prompt-learning adapter (prompt tuning, P-tuning, prefix tuning) has no weights to merge: Python only."""
    try:
        config = json.loads((path / "adapter_config.json").read_text(encoding="utf-8"))
        base, kind = config.get("base_model_name_or_path"), config.get("peft_type")
    except (OSError, ValueError, AttributeError):  # (AttributeError: JSON that is not an object)
        base = kind = None  # the line is the same without the base's name
    if kind in (*PROMPT_LEARNING, "PREFIX_TUNING"):
        return (f"{name} is a PEFT {kind} adapter (adapter_config.json), not a whole model, and such an adapter "
                "cannot be merged into its base model: attach to the PeftModel in Python "
                "(nxl.attach(PeftModel.from_pretrained(base, folder)))")
    of = f" {base!r}" if isinstance(base, str) and base else ""
    return (f"{name} is a PEFT adapter (adapter_config.json), not a whole model: merge it into its base model{of} "
            "and pass the merged folder (PeftModel.from_pretrained(base, folder).merge_and_unload().save_pretrained("
            "out), with the tokenizer), or attach to the PeftModel in Python")


#: config.json fields that size a model (in it, or in a sub-config such as text_config): each a whole number above 0
#: where given. transformers divides by a head count of 0, fails building a model of a negative width, and rejects a
#: string or a fraction in its type check, each with a traceback.
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim")
_CONFIG_FIX = "use the config.json saved with these weights"


#: from_pretrained keyword arguments that say where a hub model's files are (which revision, which cache, whose
#: token): the config and the tokenizer are read from there too, not only the weights.
_WHERE = ("revision", "subfolder", "cache_dir", "token", "local_files_only", "force_download", "proxies")


#: the :data:`_WHERE` keywords transformers' adapter lookup (``find_adapter_config_file``, which every
#: ``AutoModel*.from_pretrained`` runs where peft is installed) takes but is not handed (5.18-5.24 give it the token
#: and revision only): it looked in the default cache and asked the hub, ``local_files_only`` or not (offline, five
#: retries: 23 s before the model loaded)
_ADAPTER_WHERE = ("cache_dir", "local_files_only", "subfolder", "proxies", "force_download")


def _with_adapter_location(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the adapter lookup told where the model's files are (:data:`_ADAPTER_WHERE`), unless the
    caller tells it itself (``adapter_kwargs``)."""
    location = {key: kwargs[key] for key in _ADAPTER_WHERE if key in kwargs}
    return {**kwargs, "adapter_kwargs": location} if location and "adapter_kwargs" not in kwargs else kwargs


def _location(kwargs: Mapping[str, Any], *also: str) -> dict[str, Any]:
    """The :data:`_WHERE` keyword arguments (and ``also``) among a from_pretrained call's ``kwargs``."""
    return {key: kwargs[key] for key in (*_WHERE, *also) if key in kwargs}


def _read_config(name: str, **location: Any) -> Any:
    """The config of a local folder or hub id (``location``: :data:`_WHERE` keyword arguments), refusing (one line) a
    config.json with a size that is not a whole number above 0 (named by its field), or a value transformers
    rejects."""
    import transformers
    from huggingface_hub.errors import StrictDataclassError

    path = _local_folder(name, location.get("subfolder")) / "config.json"
    try:
        fields = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (ValueError, OSError):
        fields = {}  # transformers says, in its own words, that the file is not JSON
    if not isinstance(fields, dict):
        fields = {}
    parts = [("", fields), *((f"{key}.", value) for key, value in fields.items()
                             if key.endswith("_config") and isinstance(value, dict))]
    for where, part in parts:
        for key in _SIZES:
            value = part.get(key)
            values = value if isinstance(value, list) and value else [value]  # (Gemma 3n: one size per layer)
            if value is not None and any(type(each) is not int or each <= 0 for each in values):
                raise ValueError(f"{path}: {where}{key} is {value!r}; a size must be a whole number above 0: "
                                 f"{_CONFIG_FIX}")
    try:
        return _no_remote_code(name, lambda: transformers.AutoConfig.from_pretrained(name, trust_remote_code=False,
                                                                                     **location))
    except OSError as err:
        if user_path(name).exists():
            raise
        # Not here, so transformers asked the hub: a mistyped folder name reads as a hub id, and the hub's answer
        # (no connection, no such repository) alone sends the user looking in the wrong place.
        detail = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise OSError(f"{name}: no folder of that name in {Path.cwd()}, and the hub gave no model by that id "
                      f"({detail}); check the name, or give a folder's path") from None
    except (StrictDataclassError, ZeroDivisionError) as err:  # a value of a field the check above does not know
        detail = str(err).strip().splitlines()[-1].strip()
        raise ValueError(f"{name}: transformers rejects its config.json ({type(err).__name__}: {detail}); "
                         f"{_CONFIG_FIX}") from None


#: Weight files that are pickles (torch.load): never read (:func:`_check_weights`, ``use_safetensors=True``).
_PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt")


def _check_weights(folder: Path, auto: Any, config: Any) -> None:
    """Every ``*.safetensors`` file of a local model folder is whole, and each tensor it shares with the model that
    ``config`` describes has that model's shape: a truncated or damaged file, or a config.json that does not fit the
    weights, is named here in one line (from_pretrained would print a report and raise deep inside)."""
    import torch
    from safetensors import SafetensorError, safe_open

    pickled = sorted(file.name for pattern in _PICKLED for file in folder.glob(pattern))
    if pickled and not any(folder.glob("*.safetensors")):
        raise ValueError(f"{folder} holds its weights as pickle files only ({', '.join(pickled[:3])}): nxl_hooks never "
                         "loads pickle, which runs code as it reads; save them as safetensors (load the model in a "
                         "Python you trust, then model.save_pretrained(folder), which writes model.safetensors)")
    stored: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in _weight_files(folder):
        try:
            with safe_open(file, "pt") as fh:
                for key in fh.keys():
                    stored[key] = (tuple(fh.get_slice(key).get_shape()), file.name)
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{file} is damaged ({err}): it is truncated or not a safetensors file; copy it again "
                             "or save the model again") from None
    # Every block stores a tensor of its own (ALBERT's shared ones aside, fewer blocks than tensors still): a config
    # claiming more blocks than that is refused here, where building it on the meta device would take minutes.
    blocks = getattr(config.get_text_config(), "num_hidden_layers", None)
    if stored and isinstance(blocks, int) and blocks > len(stored):
        numbered = sorted({int(found[1]) for key in stored if (found := re.search(r"\.(\d+)\.", key))})
        held = f" (blocks {numbered[0]}..{numbered[-1]})" if numbered else ""
        raise ValueError(f"{folder / 'config.json'}: num_hidden_layers is {blocks}, but the weights hold "
                         f"{len(stored)} tensors in all{held}, too few for that many blocks; {_CONFIG_FIX}")
    if not stored or getattr(config, "quantization_config", None) is not None:
        return  # nothing to compare, or weights saved packed (their shapes are the quantizer's, not the config's)
    try:
        with torch.device("meta"):  # the model's shapes without its memory
            skeleton = auto.from_config(config)
    except (RuntimeError, ValueError, TypeError, ZeroDivisionError, OverflowError) as err:  # a size under another name
        raise ValueError(f"{folder / 'config.json'}: transformers cannot build the model it describes "
                         f"({type(err).__name__}: {err}); {_CONFIG_FIX}") from None
    prefix = f"{skeleton.base_model_prefix}."
    for key, tensor in skeleton.state_dict().items():
        found = stored.get(key) or stored.get(key.removeprefix(prefix))  # a checkpoint of the base model alone
        if found is not None and found[0] != tuple(tensor.shape):
            raise ValueError(
                f"{folder / 'config.json'} does not match the weights: {key} is {list(found[0])} in {found[1]} but "
                f"{list(tensor.shape)} for the config; {_CONFIG_FIX}"
            )


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files transformers reads from a local folder: those its shard index
    (model.safetensors.index.json) lists, or else every ``*.safetensors`` file. An index entry must be a file name
    in the folder itself: one reaching elsewhere (``../x``, an absolute path) would load weights that are neither
    checked here nor fingerprinted with the folder (:func:`model_files`), so it is refused in one line."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return sorted(folder.glob("*.safetensors"))
    try:
        shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
    except (ValueError, OSError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{index} is damaged ({type(err).__name__}: {err}): it is not a shard index with a "
                         "weight_map; copy it again or save the model again") from None
    for shard in sorted(shards, key=str):
        if not isinstance(shard, str) or shard in ("", ".", "..") or Path(shard).name != shard:
            raise ValueError(f"{index} names the shard {shard!r}, which is not a file name in {folder}: a model's "
                             "shards lie in its own folder; put the shard beside the index and name it there, or "
                             "save the model again")
        if not (folder / shard).is_file():
            raise ValueError(f"{index} names the shard {shard}, which is not in {folder}: copy it again or save the "
                             "model again")
    return [folder / shard for shard in sorted(shards)]


#: Files up to this size count by their content in :func:`model_files` (config, tokenizer); larger ones (weights) by
#: size and modification time, which costs no read of gigabytes.
_READ_WHOLE = 1 << 20


def model_files(name: str, gguf_file: str | None = None) -> str | None:
    """A cheap fingerprint of a local model's files, so that a resumed run knows it reads the same model and not only
    the same path: sha256 over each file of the folder (or the one GGUF file), by name, and by content up to 1 MiB
    (config.json, the tokenizer) or size and modification time above (the weights: replaced weights of the same size
    are new files). None for a hub id, whose files are the hub's. ``model_files("./my-model")``"""
    import hashlib

    path = user_path(name)
    if gguf_file is not None:
        path = path / gguf_file
    if not path.exists():
        return None
    digest = hashlib.sha256()
    for file in [path] if path.is_file() else sorted(f for f in path.iterdir() if f.is_file()):
        info = file.stat()
        content = file.read_bytes() if info.st_size <= _READ_WHOLE else f"{info.st_size} {info.st_mtime_ns}".encode()
        digest.update(f"{file.name}\0{len(content)}\0".encode() + content)
    return digest.hexdigest()[:16]


def check_explainable(model: Any, tokenizer: Any, layers: Any) -> tuple[list[int], int]:
    """Raise what ``attach(model, layers, tokenizer=tokenizer)`` would refuse (an unknown architecture, a registry
    head that does not fit, a layer out of range, a tokenizer that does not match the model), once before a dataset
    runs rather than for every example; no hook goes on. Returns the layers resolved and the model's block count.
    ``layers, n_blocks = check_explainable(model, tok, [-1])``"""
    from ..method.subject import unwrap
    from ..hooks.plan import make_plan

    # the plan is not kept: its head holds references to the weights (a tensor-parallel model's copies), which
    # would keep model.to() from swapping them
    plan = make_plan(unwrap(model), layers=layers, target="predicted", tokenizer=tokenizer, embedding="layer_input")
    return plan.layers, plan.n_blocks


def _split_gguf(name: str, gguf_file: str | None) -> tuple[str, str | None]:
    """``model.gguf`` -> (its folder, its file name); a folder or hub id with ``gguf_file`` stays as it is."""
    if not name.lower().endswith(".gguf"):
        return name, gguf_file
    if gguf_file is not None:
        raise ValueError(f"MODEL {name} is a .gguf file and {named('gguf_file')} names {gguf_file!r}: give the "
                         f"file as MODEL, or its folder plus {named('gguf_file')}")
    path = user_path(name)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {name}: check the path")
    return str(path.parent), path.name


def quantization_config(mode: str, dtype: Any = None) -> Any:
    """The bitsandbytes config of a mode: ``8bit``, ``4bit`` (nf4) or ``fp4``; 4-bit computes in ``dtype``
    (default float32)."""
    import torch
    from transformers import BitsAndBytesConfig

    if mode == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    if mode in ("4bit", "fp4"):
        compute = dtype if isinstance(dtype, torch.dtype) else torch.float32
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4" if mode == "fp4" else "nf4",
                                  bnb_4bit_compute_dtype=compute)
    raise ValueError(f"quantize={mode!r}: use one of {', '.join(QUANTIZE)}")


def program_defaults(load: Mapping[str, Any]) -> dict[str, Any]:
    """The ``from_pretrained`` keyword arguments of the loading options ``nxl run`` gives a program's own loads
    (``load``: a :class:`Loading`, or a mapping of dtype, device_map, max_memory, offload_folder, quantize,
    gguf_file)."""
    kwargs = {key: load[key] for key in ("device_map", "offload_folder", "gguf_file") if load.get(key) is not None}
    if load.get("max_memory") is not None:
        kwargs["max_memory"] = dict(load["max_memory"])  # a copy per load: from_pretrained rewrites its sizes in place
    dtype = _torch_dtype(load.get("dtype"))
    if dtype is not None:
        kwargs["dtype"] = dtype
    if load.get("quantize") is not None:
        kwargs["quantization_config"] = quantization_config(load["quantize"], dtype)
    return kwargs


def _torch_dtype(dtype: Any) -> Any:
    import torch

    if dtype is None or dtype == "auto" or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: use one of {', '.join(DTYPES)}")
    return getattr(torch, dtype)


def _unmark_gguf(model: Any) -> bool:
    """Drop the quantized marks of a GGUF model whose weights transformers dequantized into plain tensors (it keeps
    ``hf_quantizer``, ``is_quantized`` and ``config.quantization_config``, so save_pretrained refuses the model and
    "is it quantized?" checks are misled). Returns False, leaving the model as it is, when weights stay packed."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None or getattr(quantizer, "packed_modules", None):
        return quantizer is None
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return True


#: What torchrun sets in each process it starts; --tp needs them (transformers joins the process group with them).
_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def tp_rank() -> int:
    """This process's rank in a torchrun launch: ``torchrun --nproc-per-node 2 -m nxl_hooks attribute M T --tp``.
    A ValueError (one line) when the process was not launched by torchrun."""
    missing = [name for name in _TORCHRUN if name not in os.environ]
    if missing:
        raise ValueError(f"{named('tp')} loads one shard of the model per torchrun process, but this process was not "
                         f"launched by torchrun ({', '.join(missing)} not set): run torchrun --nproc-per-node N -m "
                         f"nxl_hooks ... --tp, or your script under torchrun, or drop {named('tp')}")
    return int(os.environ["RANK"])


def _check_tp_heads(name: str, config: Any) -> None:
    """Refuse (one line) a model whose attention heads the torchrun processes cannot share evenly: where its
    ``tp_plan`` splits the attention projections by output ("colwise"), each process holds a slice of every
    projection, and one that is not whole heads fails in the model's own reshape, with a traceback on every rank."""
    text = config.get_text_config()
    plan = getattr(text, "base_model_tp_plan", None) or {}
    if not any(style == "colwise" and re.search(r"(attn|attention)\.", key) for key, style in plan.items()):
        return  # heads not split (a gathered output, or only the MLP or experts sharded)
    world = int(os.environ["WORLD_SIZE"])
    counts = {key: getattr(text, key, None) for key in ("num_attention_heads", "num_key_value_heads")}
    counts = {key: count for key, count in counts.items() if isinstance(count, int)}
    uneven = {key: count for key, count in counts.items() if count % world}
    if uneven:
        common = math.gcd(*counts.values())
        fits = [str(n) for n in range(2, common + 1) if common % n == 0]
        fix = (f"launch torchrun with --nproc-per-node {' or '.join(fits[:4])}" if fits else
               f"its heads cannot be split: drop {named('tp')}")
        said = " and ".join(f"{key} is {count}" for key, count in uneven.items())
        raise ValueError(f"{name}: {named('tp')} splits the attention heads between the {world} torchrun processes, "
                         f"but {said}, which {world} does not divide; {fix}")


def tp_outputs(args: Any, *names: str) -> None:
    """Under ``--tp``, on every rank but 0: the output options ``names`` of ``args`` point into a private temporary
    folder and stdout goes to /dev/null, so that rank 0 alone prints and writes. Every rank still runs every forward
    (the shards compute together). Called once the command has checked its output options (a pure check), so that
    each rank refuses a bad path itself, at once, rather than wait for rank 0 in the model's load until torchrun
    ends it. ``tp_outputs(args, "out", "html")``"""
    if not getattr(args, "tp", False) or tp_rank() == 0:
        return
    private = tempfile.mkdtemp(prefix=f"nxl-tp-rank{os.environ['RANK']}-")
    atexit.register(shutil.rmtree, private, ignore_errors=True)
    for name in names:
        if getattr(args, name, None) is not None:
            setattr(args, name, os.path.join(private, os.path.basename(str(getattr(args, name)).rstrip("/")) or name))
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


_GGUF_FIX = "the file is damaged or was written wrong: download or convert it again"


def _gguf_value(reader: Any, key: str) -> Any:
    """The scalar a GGUF header holds at ``key`` (None when absent); an array or string is returned as found."""
    from transformers.modeling_gguf_pytorch_utils import read_field

    value = read_field(reader, key)
    return value[0] if len(value) == 1 else value or None


def _gguf_names(skeleton: Any, arch: str, config: Any) -> dict[str, str]:
    """GGUF tensor name -> model parameter name, as transformers maps them when it loads the file; empty where it
    cannot tell (then a missing tensor is found after loading, from transformers' own loading report)."""
    try:
        from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                              get_gguf_hf_weights_map)

        return get_gguf_hf_weights_map(skeleton, TENSOR_PROCESSORS.get(arch, TensorProcessor)(config.to_dict()))
    except (ImportError, NotImplementedError):
        return {}


def _gguf_quantization(reader: Any) -> dict[str, Any]:
    """How a GGUF file stores its weights, as its header says (its tensor table, not their data, which a file's
    name may misstate): ``{"quant_method": "gguf", "file_type": "MOSTLY_Q4_1", "tensor_types": {"F32": 61,
    "Q4_1": 210, "Q8_0": 1}}``. ``file_type`` is ``general.file_type`` by its ``LlamaFileType`` name (None where
    the header has none; as written where gguf names no such type); ``tensor_types`` counts the tensors per GGML
    type."""
    from gguf import LlamaFileType

    written = _gguf_value(reader, "general.file_type")
    try:
        file_type = LlamaFileType(written).name
    except ValueError:
        file_type = written  # (a file type newer than the installed gguf knows, or none)
    counts = collections.Counter(tensor.tensor_type.name for tensor in reader.tensors)
    return {"quant_method": "gguf", "file_type": file_type, "tensor_types": dict(sorted(counts.items()))}


def check_gguf(path: str | Path, head: str = "causal_lm") -> dict[str, Any]:
    """Refuse, in one line (ValueError), a GGUF file whose header does not describe the tensors it holds, before
    anything is allocated (the file memory-mapped, the model its header describes built on the meta device), however
    large the numbers it claims: no vocabulary, a block count other than the blocks its tensors hold, a zero head
    count or embedding length, a token embedding that is not (vocabulary x embedding length), a model of more
    parameters than the file holds values (a feed-forward width or a head count that its tensors do not have).
    Returns how the header says the weights are stored (:func:`_gguf_quantization`), read in the same pass.
    ``check_gguf("smollm2.Q4_1.gguf")["file_type"] == "MOSTLY_Q4_1"``; :func:`load_model` calls it before reading
    the model from a GGUF file, and refuses a tensor the model needs that the file lacks after loading it."""
    import torch
    import transformers
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as err:  # noqa: BLE001 - gguf raises what a cut or crafted file makes numpy/struct raise
        raise ValueError(f"{path} is not a readable GGUF file ({type(err).__name__}: {err}); {_GGUF_FIX}") from None
    arch = _gguf_value(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{path} names no architecture (general.architecture is {arch!r}); {_GGUF_FIX}")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    count = len(tokens.data) if tokens is not None else 0
    if not count:
        raise ValueError(f"{path} has no vocabulary (tokenizer.ggml.tokens is missing or empty), so no tokenizer can "
                         f"be built from it; {_GGUF_FIX}")
    # blk.N.* (enc.blk.N.* and dec.blk.N.* for encoder-decoders): the blocks the file really holds, which bound the
    # model built below, however many the header claims
    found = {int(match.group(1)) for match in (re.match(r"(?:[a-z]+\.)?blk\.(\d+)\.", t.name) for t in reader.tensors)
             if match}
    blocks = _gguf_value(reader, f"{arch}.block_count")
    if not isinstance(blocks, int) or found != set(range(blocks)):
        held = f"blocks 0..{max(found)} ({len(found)} blocks)" if found else "no block"
        raise ValueError(f"{path}: its header says {arch}.block_count = {blocks!r} but its tensors hold {held}; "
                         f"{_GGUF_FIX}")
    width = _gguf_value(reader, f"{arch}.embedding_length")
    for key, value in (("embedding_length", width), ("attention.head_count", _gguf_value(reader, f"{arch}."
                                                                                        "attention.head_count"))):
        values = value if isinstance(value, list) else [value]
        if value is not None and not all(isinstance(v, int) and v > 0 for v in values):
            raise ValueError(f"{path}: its header says {arch}.{key} = {value!r}; expected a positive number, so "
                             f"{_GGUF_FIX}")
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is not None and list(embedding.shape) != [width, count]:
        rows, cols = list(reversed(embedding.shape)) + [None] * (2 - len(embedding.shape))
        raise ValueError(f"{path}: its token embedding is {rows} x {cols}, but the header gives {count} tokens of "
                         f"width {width} ({arch}.embedding_length), so it should be {count} x {width}; {_GGUF_FIX}")
    path = Path(path)
    try:
        config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        with torch.device("meta"):  # the shapes without the memory
            skeleton = getattr(transformers, HEAD_CLASSES[head]).from_config(config)
    except (ValueError, KeyError, TypeError, ZeroDivisionError, OverflowError) as err:
        raise ValueError(f"{path}: transformers cannot build a model from its header ({type(err).__name__}: {err}); "
                         f"{_GGUF_FIX}") from None
    parameters = dict(skeleton.named_parameters())  # tied ones once
    names = _gguf_names(skeleton, arch, config)
    absent = set(names.values()) - {names[tensor.name] for tensor in reader.tensors if tensor.name in names}
    _refuse_missing(path, [name for name in parameters if name in absent])
    needed = sum(parameter.numel() for parameter in parameters.values())
    held = sum(int(tensor.n_elements) for tensor in reader.tensors)
    if needed > held:
        raise ValueError(f"{path}: its header describes a model of {needed:,} parameters, but the file holds "
                         f"{held:,} values; {_GGUF_FIX}")
    return _gguf_quantization(reader)


def _cached_gguf(name: str, gguf_file: str, where: Mapping[str, Any]) -> Path:
    """Where a hub repository's GGUF file lies in the local cache (``where``: :data:`_WHERE` keyword arguments),
    which reading the tokenizer from it has just filled: looked up there alone, never fetched a second time."""
    from transformers.utils import cached_file

    there = {key: value for key, value in where.items() if key != "force_download"}
    return Path(cached_file(name, gguf_file, **{**there, "local_files_only": True}))


def _mark_dequantized(model: Any, header: Mapping[str, Any], dtype: Any) -> None:
    """Leave on ``model`` (:data:`~..method.placement.DEQUANTIZED_FROM`, which its records' ``quantization`` reads)
    the GGUF file's quantization its weights were dequantized from (``header``: :func:`check_gguf`'s), and the dtype
    they were dequantized to: transformers' own marks of it are dropped (:func:`_unmark_gguf`)."""
    setattr(model, DEQUANTIZED_FROM, {**header, "dequantized_to": str(dtype).removeprefix("torch.")})


def load_model(name: str, head: str | None = None, *, gguf_file: str | None = None, dtype: Any = None,
               device_map: Any = None, max_memory: dict | None = None, offload_folder: str | None = None,
               quantize: str | None = None, tp: bool | None = None, chat: bool = False,
               **kwargs: Any) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for a local folder, hub id or ``.gguf`` file, in eval mode.

    - ``head``: "causal_lm", "sequence_classification" or "masked_lm"; by default the one ``config.architectures``
      names (a GGUF file: causal_lm).
    - ``gguf_file``: the GGUF file inside the folder or hub repository ``name`` (or pass the file as ``name``).
    - ``dtype`` ("auto", "float32", "float16", "bfloat16" or a torch dtype), ``device_map``, ``max_memory``: as
      ``from_pretrained`` takes them; ``quantize``: bitsandbytes "8bit", "4bit" (nf4) or "fp4".
    - ``offload_folder``: with ``device_map``, the folder that weights offloaded to disk are written to, where
      transformers writes them anew rather than read them from the model's files (a MoE model's experts); not inside
      the model's folder. A GGUF model is never offloaded to disk (ValueError).
    - ``tp``: tensor parallel, for a process launched by torchrun: ``tp_plan="auto"`` shards the weights over its
      ranks (each rank calls this and runs every forward); excludes device_map, max_memory, offload_folder, quantize
      and GGUF, and
      refuses attention heads the ranks cannot share evenly.
    - ``chat``: the texts go through the tokenizer's chat template (``--chat``): a tokenizer without one, or whose
      template fails, is refused before the weights load.
    - ``kwargs`` go to the model's ``from_pretrained``, and those that say where its files are (``revision``,
      ``cache_dir``, ``token``, ``local_files_only``... :data:`_WHERE`) to its config's and tokenizer's too; it reads
      safetensors only and runs no code of the model's own (ValueError for ``trust_remote_code=True`` or
      ``use_safetensors=False``).
    """
    import transformers

    if kwargs.pop("trust_remote_code", False) or kwargs.pop("use_safetensors", True) is False:
        raise ValueError("load_model reads safetensors weights only and runs no code of a model's own: drop "
                         "trust_remote_code=True / use_safetensors=False (or load the model with transformers "
                         "yourself, then nxl.attach it)")

    from ..method.chat import chat_prompt

    loading = Loading(head=head, gguf_file=gguf_file, dtype=dtype, device_map=device_map, max_memory=max_memory,
                      offload_folder=offload_folder, quantize=quantize, tp=tp, chat=chat)
    loading = loading.loadable().followed()  # checked as the flags are
    name, split = _split_gguf(name, loading.gguf_file)
    if split != loading.gguf_file:  # the .gguf file given as name (checked again: --tp excludes it)
        loading = dataclasses.replace(loading, gguf_file=split)
    head, gguf_file, device_map, quantize = loading.head, loading.gguf_file, loading.device_map, loading.quantize
    where = _location(kwargs)
    _check_local(name, gguf_file, where.get("subfolder"))
    if gguf_file is None:  # (a GGUF model is its file alone, and is never offloaded to disk)
        _check_offload_folder(name, loading.offload_folder)
    if loading.tp:
        tp_rank()
        kwargs["distributed_config"] = transformers.DistributedConfig(tp_plan="auto")
    if quantize == "8bit":
        # In float32, bitsandbytes logs a cast warning for every Linear at every call: thousands of lines.
        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    placement = program_defaults({**loading, "gguf_file": None})
    quantization = placement.pop("quantization_config", None)
    dtype = placement.get("dtype")
    for package in ("gguf", "accelerate") if gguf_file is not None else ():  # before transformers' own advice
        if importlib.util.find_spec(package) is None:  # (which names accelerate alone, or [big] through it)
            raise ModuleNotFoundError(f"reading a .gguf file needs {package}: {install_command('gguf')}", name=package)
    if gguf_file is not None:
        kind = head or "causal_lm"  # a GGUF file holds a language model; its config names no architecture
        if kind != "causal_lm":  # (check_gguf would build the file's model with that head, and blame the file)
            raise ValueError(f"{gguf_file}: a GGUF file holds a causal language model, not a {kind} head: use "
                             f"{named('head', 'causal_lm')}, or drop {named('head')}")
        config = None
    else:
        config = _read_config(name, **where)
        kind = head or head_from_architectures(getattr(config, "architectures", None), config)
        if kind is None:
            fits, architectures = _explained_heads(config), getattr(config, "architectures", None)
            base = _built(config, "base")
            # a class of the user's own (a subclass saved with save_pretrained) names no head transformers knows
            known = [one for one in architectures or () if isinstance(one, str) and hasattr(transformers, one)]
            if known and (base is None or base.__name__ not in known):  # a task model not explained
                raise ValueError(f"{name}: config.architectures names {architectures}; {UNEXPLAINED}")
            if not fits:  # (T5's: --head would be refused as well, whichever it named)
                raise ValueError(f"{name}: NormXLogit explains no head of {config.model_type} models; {UNEXPLAINED}")
            # (a base model's weights, a class of the user's own, or none named: --head builds a task model of them)
            what = "no class of transformers" if architectures and not known else "no head that NormXLogit explains"
            raise ValueError(f"{name}: config.architectures ({architectures}) names {what}; pass {named('head')} "
                             f"with one of {', '.join(fits)}")
        if loading.tp:
            _check_tp_heads(name, config)
        _check_saved_quantization(name, getattr(config, "quantization_config", None),
                                 quantization if quantization is not None else kwargs.get("quantization_config"))
    auto = getattr(transformers, HEAD_CLASSES[kind])
    if config is not None:
        _check_head(name, config, kind)
    header = None  # a GGUF file's quantization, as its header says
    local = _local_folder(name, where.get("subfolder")) / gguf_file if gguf_file is not None else None
    if local is not None and local.is_file():
        header = check_gguf(local, kind)  # before the tokenizer and model are built from it
    try:  # first: a damaged tokenizer costs no model load
        tokenizer = _read_tokenizer(name, where, gguf_file)
    except (OSError, ValueError) as err:
        fix = ("save it again with tokenizer.save_pretrained(folder)" if user_path(name).exists() else
               "check the hub id and your access to it (or save the model and tokenizer to a folder)")
        raise ValueError(f"{name}: its tokenizer cannot be read ({type(err).__name__}: {err}); {fix}") from err
    _check_vocabulary(name, tokenizer)
    if gguf_file is not None and header is None:  # a hub repository's file, which the tokenizer's load fetched
        try:
            cached = _cached_gguf(name, gguf_file, where)
        except OSError:  # not where the cache says (a tokenizer read from elsewhere): the model's load fetches it
            header = {"quant_method": "gguf", "file_type": None, "tensor_types": None}  # (its records say so)
        else:
            header = check_gguf(cached, kind)
    if loading.chat:  # a minute of loading weights is not spent on a template that is missing or fails
        chat_prompt(tokenizer, "Hello")
    if quantization is not None and gguf_file is None:
        kwargs["quantization_config"] = quantization
    if gguf_file is None:
        if user_path(name).is_dir():
            _check_weights(_local_folder(name, where.get("subfolder")), auto, config)
        model = _from_pretrained(auto, name, {"config": config, **placement, **kwargs})
    elif quantization is None:
        model = _from_gguf(auto, name, gguf_file, {**placement, **kwargs})
        if _unmark_gguf(model):  # (weights kept packed: their quantization_config, transformers' own, says so)
            _mark_dequantized(model, header, model.dtype)
    else:
        plain = _from_gguf(auto, name, gguf_file, {**({"dtype": dtype} if dtype else {}), **kwargs})
        if not _unmark_gguf(plain):
            raise ValueError(f"{gguf_file}: transformers keeps this file's weights packed in GGUF kernels, so "
                             f"bitsandbytes cannot quantize them; drop {named('quantize')}")
        model = type(plain).from_pretrained(None, config=plain.config, state_dict=plain.state_dict(),
                                            quantization_config=quantization, **placement)
        # both say what the numbers came from: bitsandbytes' config, and the file the weights it quantized were
        # dequantized from (records: the quantizer's settings with the file's under "dequantized_from")
        _mark_dequantized(model, header, plain.dtype)
        del plain
    if gguf_file is not None:  # named by its file, not the folder holding it: the folder may hold other weights
        model.name_or_path = model.config.name_or_path = f"{name.rstrip('/')}/{gguf_file}"
    return model.eval(), tokenizer


def _read_tokenizer(name: str, where: dict, gguf_file: str | None) -> Any:
    """The tokenizer of ``name`` where its files are (``where``: :data:`_WHERE` keyword arguments), or, where the
    ``subfolder`` named there has none, the root's: repositories often keep the tokenizer at the root and the weights
    in a subfolder. The subfolder's error is raised where neither is read."""
    import transformers

    def read(location: dict) -> Any:
        return _no_remote_code(name, lambda: transformers.AutoTokenizer.from_pretrained(
            name, trust_remote_code=False, **location, **({"gguf_file": gguf_file} if gguf_file else {})))

    try:
        return read(where)
    except (OSError, ValueError) as err:
        if not where.get("subfolder"):
            raise
        error = err
    try:
        return read({key: value for key, value in where.items() if key != "subfolder"})
    except (OSError, ValueError):
        raise error from None


def _built(config: Any, kind: str) -> type | None:
    """The class transformers' Auto class for head ``kind`` (or ``"base"``: AutoModel's) builds for this config, or
    None."""
    import transformers

    mapping = getattr(transformers, HEAD_CLASSES.get(kind, "AutoModel"))._model_mapping
    return mapping[type(config)] if type(config) in mapping else None


def _explained_heads(config: Any) -> list[str]:
    """The head kinds (``--head``) whose class transformers builds for this config and NormXLogit explains."""
    return [kind for kind in HEAD_CLASSES
            if (built := _built(config, kind)) is not None and class_head(built.__name__, config)]


def _check_head(name: str, config: Any, kind: str) -> None:
    """Refuse (one line) a head kind that transformers has no class of for this model type (``--head masked_lm`` for
    a Llama): building it fails deep inside, where the error reads as a config.json that does not fit its weights."""
    found, fits = _built(config, kind), _explained_heads(config)
    if found is not None and kind not in fits:  # (AutoModelForCausalLM builds Gemma 3 as its vision-language model)
        raise ValueError(f"{name}: transformers builds {config.model_type} models as {found.__name__} for {kind}; "
                         f"{UNEXPLAINED}")
    if kind not in fits:
        fix = f"use {named('head', ' or '.join(fits))}" if fits else UNEXPLAINED  # (no head of it: T5's)
        raise ValueError(f"{name}: transformers has no {kind} head for {config.model_type} models "
                         f"({HEAD_CLASSES[kind]} does not take a {type(config).__name__}); {fix}")


def _quantization(found: Any) -> str | None:
    """How a quantization config (a config's ``quantization_config``: a mapping, or transformers' object) stores the
    weights, in words ("bitsandbytes 8-bit", "bitsandbytes 4-bit nf4", "gptq"), or None for no config."""
    if found is None:
        return None

    def field(key: str) -> Any:
        return found.get(key) if isinstance(found, Mapping) else getattr(found, key, None)

    method = field("quant_method")
    method = str(getattr(method, "value", method) or "a quantization")  # (QuantizationMethod: a str enum)
    if method == "bitsandbytes" and field("load_in_8bit"):
        return "bitsandbytes 8-bit"
    if method == "bitsandbytes" and field("load_in_4bit"):
        kind = field("bnb_4bit_quant_type")
        return f"bitsandbytes 4-bit {kind}" if kind else "bitsandbytes 4-bit"
    return method


def _check_saved_quantization(name: str, saved: Any, asked: Any) -> None:
    """Refuse (one line) a quantization asked for (``asked``: a quantization config, or None) other than the one a
    model's weights are saved in (``saved``: its config's ``quantization_config``, or None): transformers loads the
    saved one, with a warning only. The one it is saved in, asked for again, loads as asked."""
    stored, wanted = _quantization(saved), _quantization(asked)
    if stored is not None and wanted is not None and stored != wanted:
        raise ValueError(f"{name} is saved quantized ({stored}: its config.json's quantization_config), and "
                         f"transformers loads it so, not {wanted} as asked by {named('quantize')} or "
                         f"quantization_config=: ask for {stored}, drop it, or give the unquantized model")


def check_program_load(name: str, kwargs: Mapping[str, Any]) -> None:
    """:func:`_check_saved_quantization` for a program's ``from_pretrained(name, **kwargs)`` under ``nxl run``: the
    model's config read as from_pretrained reads it (its ``config=``, else its config.json where ``kwargs`` say)."""
    import transformers

    asked = kwargs.get("quantization_config")
    if asked is None:
        return
    config = kwargs.get("config")
    if isinstance(config, transformers.PretrainedConfig):
        saved = getattr(config, "quantization_config", None)
    else:  # its config.json as a dict: no class of the model's is built (nor code of its own run) to read it
        fields, _ = transformers.PretrainedConfig.get_config_dict(config or name, **_location(kwargs, "gguf_file"))
        saved = (fields or {}).get("quantization_config")
    _check_saved_quantization(name, saved, asked)


def _check_offload_folder(name: str, folder: str | None) -> None:
    """Refuse (one line) an offload folder in the model's own folder (or that folder): the weights written there would
    be read back as the model's files, as --out refuses to write into an input."""
    model = user_path(name)
    if folder is None or not model.is_dir():
        return
    real, there = os.path.realpath(folder), os.path.realpath(model)
    if os.path.commonpath([real, there]) == there:
        raise ValueError(f"{named('offload_folder', folder)} would write into {name}, the model's folder: the "
                         "weights written there would be read as the model's; give a folder elsewhere")


def _check_vocabulary(name: str, tokenizer: Any) -> None:
    """Refuse (one line) a tokenizer that holds no token but its special ones: tokenizer_config.json without the
    vocabulary file it names builds one without complaint, which reads every word as unknown (or as nothing)."""
    added = getattr(tokenizer, "get_added_vocab", None)  # (mistral_common's backend has none: not checked)
    if not callable(added):
        return
    special = set(tokenizer.all_special_tokens) | set(added())
    if set(tokenizer.get_vocab()) <= special:
        raise ValueError(f"{name}: its tokenizer ({type(tokenizer).__name__}) has no vocabulary, only its special "
                         f"tokens ({', '.join(sorted(special))}), so it would read every word as unknown: its "
                         "vocabulary file is missing; save it beside the model with tokenizer.save_pretrained(folder)")


def _from_gguf(auto: Any, name: str, gguf_file: str, kwargs: dict[str, Any]) -> Any:
    """``auto.from_pretrained`` of a GGUF file, refusing (one line) a file that lacks a tensor the model needs:
    transformers would fill it with random numbers and only log a report (which is kept quiet here: this says it)."""
    logger = logging.getLogger("transformers.modeling_utils")
    # A filter, not a raised level: transformers checks its tensor-parallel plan (and warns "layers were not
    # sharded", naming the norms) whenever this logger's own level is WARNING or above.
    def quiet(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR

    logger.addFilter(quiet)
    path = os.path.join(name, gguf_file)
    on_disk = ValueError(f"{path}: transformers cannot offload a GGUF model to disk; drop \"disk\" from "
                         f"{named('device_map')}, give {named('max_memory')} room for the whole model, or nxl convert "
                         "the file first")
    try:
        model, info = auto.from_pretrained(name, gguf_file=gguf_file, output_loading_info=True,
                                           **_with_adapter_location(kwargs))
    except (RuntimeError, ValueError) as err:
        # a map naming "disk" (RuntimeError), or one auto made (ValueError: it asks for an offload_folder)
        if "Disk offload is not supported" in str(err) or "`offload_folder`" in str(err):
            raise on_disk from None
        if not isinstance(err, RuntimeError) or "mismatched" not in str(err) and "size mismatch" not in str(err):
            raise
        raise ValueError(f"{path}: its tensors do not have the shapes its header gives the model; "
                         f"{_GGUF_FIX}") from None
    finally:
        logger.removeFilter(quiet)
    if "disk" in {str(place) for place in getattr(model, "hf_device_map", {}).values()}:
        raise on_disk  # (with an offload_folder it loads, then its forward fails: KeyError 'lm_head.weight')
    _refuse_missing(path, info["missing_keys"])
    return model


def _no_remote_code(name: str, load: Callable[[], Any]) -> Any:
    """``load()``, which transformers refuses (ValueError) where the model or tokenizer needs code of its own
    (``auto_map``, ``trust_remote_code``): said in one line of nxl's, which never runs such code."""
    try:
        return load()
    except ValueError as error:
        if "trust_remote_code" not in str(error):
            raise
        raise ValueError(f"{name} needs code of its own to load (auto_map in its config): nxl_hooks never runs code "
                         "from a model folder or repository; use a model of an architecture transformers ships") from None


def _from_pretrained(auto: Any, name: str, kwargs: dict[str, Any]) -> Any:
    """``auto.from_pretrained`` of a folder or hub id, refusing (one line) weights that lack a tensor the model needs:
    transformers would fill it with random numbers and only log its load report. The missing keys are transformers'
    own, after it ties weights and drops those the model initialises itself (``_keys_to_ignore_on_load_missing``);
    the report is held back while they are read, and logged as transformers would unless this refuses."""
    logger = logging.getLogger("transformers.modeling_utils")
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        held.append(record)
        return False

    missing = None
    logger.addFilter(hold)
    try:
        # safetensors only (a pickle runs code as it is read), and no code of the model's own (auto_map)
        model, info = _no_remote_code(name, lambda: auto.from_pretrained(
            name, output_loading_info=True, use_safetensors=True, trust_remote_code=False,
            **_with_adapter_location(kwargs)))
        missing = info["missing_keys"]
    except ValueError as err:
        if "`offload_folder`" in str(err):  # transformers' advice names a from_pretrained keyword
            raise ValueError(f"{name}: {named('device_map')} offloads part of the model to disk, and transformers "
                             "writes those weights anew (this model holds them in another form than its files): pass "
                             f"{named('offload_folder', 'DIR')} for them") from None
        if "llm_int8_enable_fp32_cpu_offload" not in str(err):
            raise
        # transformers' advice names from_pretrained keywords, which no nxl flag sets; without a quantization asked
        # for, the folder holds one (its weights saved quantized), and no flag of the user's is to drop
        cause, drop = ((f"{named('quantize')} quantize the model where it runs",
                        f"drop {named('quantize')}") if "quantization_config" in kwargs else
                       (f"its weights are saved quantized "
                        f"({_quantization(getattr(kwargs.get('config'), 'quantization_config', None))}), to run "
                        "where they are loaded", "give the unquantized model"))
        raise ValueError(f"{name}: {cause}, and {named('device_map')} puts part of it on the CPU or disk: give the "
                         f"device it runs on room for the whole model with {named('max_memory')}, or {drop}") from None
    finally:
        logger.removeFilter(hold)
        if not missing:  # loaded whole, or transformers raised: its report is its own to give
            for record in held:
                logger.handle(record)
    _refuse_missing(name, missing, f"save the whole model again (model.save_pretrained), or pass the {named('head')} "
                    "its weights were trained with")
    return model


def _refuse_missing(path: str | Path, missing: Any, fix: str = _GGUF_FIX) -> None:
    """A ValueError naming the model's parameters (``missing``) that its weights (a GGUF file, a folder) have no
    tensor for, with ``fix``: what to do."""
    missing = sorted(missing)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ValueError(f"{path} lacks tensors the model needs ({', '.join(missing[:3])}{more}): they would be "
                         f"random numbers; {fix}")


def convert_gguf(gguf: str | Path, out: str | Path, *, gguf_file: str | None = None, dtype: Any = "float32") -> Path:
    """Write the model of a GGUF file as a plain transformers folder that ``from_pretrained`` and ``transformers
    serve`` load: the weights dequantized to ``dtype`` (safetensors), config, generation config, tokenizer and its
    chat template. ``convert_gguf("smollm2.Q4_1.gguf", "smollm2-hf")``; ``gguf_file``: the file inside ``gguf`` when
    that is a folder or hub id.

    ``out`` must not exist or be an empty folder (not a symbolic link to one); the folder is written beside it and
    renamed into place, so it is whole or absent. A ValueError when transformers keeps the file's weights packed
    (nothing to dequantize into).
    """
    if dtype == "auto":
        raise ValueError("dtype='auto': a GGUF file's weights are quantized; name the dtype to dequantize them to "
                         "(float32, float16 or bfloat16)")
    out = user_path(out)
    if out.is_symlink():  # the folder is renamed into place, which a link (even to an empty folder) cannot take
        raise FileExistsError(f"{out} is a symbolic link: name a new folder (or an empty one) for the converted model")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder: name a new folder for the converted model")
    below_a_file = not_a_folder(out)  # before the model loads: making the folder would fail after (errno 17)
    if below_a_file is not None:
        raise NotADirectoryError(below_a_file)
    model, tokenizer = load_model(str(gguf), gguf_file=gguf_file, dtype=dtype)
    if getattr(model, "hf_quantizer", None) is not None:
        raise ValueError(f"{gguf}: transformers keeps this file's weights packed in GGUF kernels, so there are no "
                         f"plain weights to save; load it with {named('gguf_file')} instead of converting it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".partial-{out.name}-{secrets.token_hex(6)}"
    tmp.mkdir()  # the user's umask, unlike mkdtemp's 0700: the folder is theirs to share or serve
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)  # tokenizer.json, its config and chat_template.jinja when the file has one
        # safetensors writes its files 0600 whatever the umask; the rest are the user's umask (config.json's mode)
        mode = stat.S_IMODE((tmp / "config.json").stat().st_mode)
        for weights in tmp.glob("*.safetensors"):
            weights.chmod(mode)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def gguf_serve_refusal(program: list[str], gguf_file: str | None) -> str | None:
    """Why ``nxl run --gguf-file F -- transformers serve ...`` cannot work, with the ``nxl convert`` command to run
    instead; None for any other program or without ``gguf_file``. (``transformers serve`` reads a processor from
    the model folder, which a GGUF file does not give it.)"""
    names = [os.path.basename(arg) for arg in program[:3]]
    if gguf_file is None or "transformers" not in names or "serve" not in program[:4]:
        return None
    after = program[program.index("serve") + 1:]
    loose = [index for index, arg in enumerate(after) if not arg.startswith("-")]
    # The model folder: the argument that holds the file, else one that is no option's value (--port 8000's)
    holding = [] if os.path.isabs(gguf_file) else [
        index for index in loose if os.path.isfile(os.path.join(after[index], gguf_file))]
    free = [index for index in loose if index == 0 or not after[index - 1].startswith("-") or "=" in after[index - 1]]
    at = next(iter(holding or free), None)
    folder = after[at] if at is not None else "MODEL_DIR"
    out = f"{folder.rstrip('/')}-converted"
    # (where the folder is not told apart from an option's value, serve's arguments are named, not guessed)
    served = (shlex.join([out if index == at else arg for index, arg in enumerate(after)]) if at is not None
              else f"{out}, with serve's other arguments")
    return (f"--gguf-file with transformers serve: serve cannot load a GGUF file (it reads a processor from a "
            f"model folder); convert it once, then serve the folder: nxl convert "
            f"{shlex.quote(os.path.join(folder, gguf_file))} {shlex.quote(out)} && nxl run -- transformers serve "
            f"{served}")
