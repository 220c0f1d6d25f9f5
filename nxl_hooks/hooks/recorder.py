"""The probe's hooks: what runs inside the model's forward, and the per-thread state of the calls they record.

    recorder = Recorder(plan, backbone, gens, engines, results, notice)
    handles = recorder.register()       # on the task model, its backbone, its blocks, the word embedding

Made and registered by :func:`~nxl_hooks.attach` (:mod:`.probe`), which owns their lifecycle. Eagerly each hook feeds
the calling thread's capture or recorded call (:mod:`.generate`, :mod:`.engines`); inside a forward torch.compile
traces, it does nothing in a recorded call and keeps a plain forward's tensors (:mod:`.traced`). No hook ever raises
into the host's forward (:mod:`.guard`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import threading
import types
import weakref
from typing import Any, Callable

import torch
from torch import nn
from torch.compiler import is_dynamo_compiling, is_exporting

from ..arch import plugins
from ..arch.registry import blocks
from ..arch.text import typed
from ..method.head import replaced
from ..method.subject import compiled_original
from ..records.attribution import Attribution
from .conventions import find_cache, start
from .engines import Engine
from .forward import Capture, assemble, embedding_norms, open_capture
from .generate import Generations, Run
from .guard import SHORT, Notice, Owned, logger, reason
from .plan import Plan
from .recording import NOT_RECORDED, Recording
from .traced import Recompiled, Traced, TracedForward, eager_frame

__all__ = ["Recorder", "Results"]


_STARTED_BEFORE = ("not recorded: this generate call started before the probe attached, so the context of its tokens "
                   "ran unseen; the calls that start from now on are recorded")
#: Why a generate call whose prompt the probe saw run goes on unfollowed: it was not called through the model's own
#: ``generate``, which the probe wraps (a method taken before the attach).
_BOUND_BEFORE = ("not recorded: this generate call was made through a reference to it taken before the probe "
                 "attached (g = model.generate, a functools.partial of it), which the probe does not wrap; call "
                 "model.generate itself, or take the reference after attaching")


def _hidden(output: Any) -> torch.Tensor:
    # Most transformers v5 blocks return a tensor; Falcon, Bloom, MPT, GPT-J, DeBERTa-v2 return tuples.
    return output[0] if isinstance(output, (tuple, list)) else output


def _without_traceback(error: BaseException) -> BaseException:
    # Kept for result(): a traceback would keep every tensor of the failed forward's frames alive.
    return error.with_traceback(None)


def traced() -> bool:
    """Whether the probe's hooks run as traced code (torch.compile's dynamo, a torch.export), not as the eager forward
    they watch. Not ``torch.compiler.is_compiling()``, nor ``is_exporting()`` alone: since torch 2.13 the one, and
    the other during an export, are True in every thread while one compiles or exports, which would make another
    thread's eager forwards (a compiled call's eager refill among them) go unrecorded; a non-strict export traces
    this thread's tensors as fake ones (:func:`_exporting`). Asked by every hook of every forward: an eager one
    makes two flag reads, no more."""
    return is_dynamo_compiling() or (is_exporting() and _exporting())


def _exporting() -> bool:
    """Whether a non-strict torch.export (torch's default) runs this thread's forward, as plain Python on fake
    tensors: what its hooks kept would be assembled into a record of fake tensors. Never while dynamo traces (a
    strict export, a compile): before torch 2.13 dynamo takes ``is_exporting()`` as True in every compile, and it
    cannot trace the dispatch-mode query (its ``Unsupported`` went into the user's compile or export)."""
    return (not is_dynamo_compiling() and is_exporting()
            and torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None)


#: module -> {hook name: the id its always_call forward hook had when first registered}: _always_called
_STABLE_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _always_called(module: nn.Module, hook: Callable) -> torch.utils.hooks.RemovableHandle:
    """``hook`` as ``module``'s first forward hook, run on an exception too, under the id the probe's first such hook
    on ``module`` had. First: a hook of the user's on the module, registered before attaching or after, then finds
    the forward recorded (``probe.peek()``). The id: dynamo guards compiled code that calls a module on it
    (``hook_id in _forward_hooks_always_called``), so a new id per attach would recompile generate's compiled call at
    every attach, and past dynamo's ``recompile_limit`` run its decoding steps partly eagerly."""
    handle = module.register_forward_hook(hook, always_call=True, prepend=True)
    stable = _STABLE_IDS.setdefault(module, {}).setdefault(hook.__name__, handle.id)
    hooks, always = module._forward_hooks, module._forward_hooks_always_called
    if stable != handle.id and stable not in hooks:
        hooks[stable], always[stable] = hooks.pop(handle.id), always.pop(handle.id)
        hooks.move_to_end(stable, last=False)  # (re-keyed, it went last)
        handle.id = stable  # what remove() takes out
    return handle


class _InCall(RuntimeError):
    """What :meth:`~nxl_hooks.Probe.result` says after a ``generate`` call: its records are per token (``recorded``),
    or its call record says why there are none."""

    def __init__(self, recorded: bool) -> None:
        self.recorded = recorded
        said = ("a recorded generate call, whose records are its tokens': read probe.steps, or probe.calls[-1] (and "
                "its .attribution(step))" if recorded else
                "a generate call that was not recorded (probe.calls[-1].error says why)")
        super().__init__(f"the last call in this thread was {said}; result() is the last plain forward's "
                         "(model(...) called by itself)")


def _unended() -> RuntimeError:
    """What a plain forward's result is from its start until its end is recorded: torch runs no always_call hook when a
    BaseException (Ctrl-C) ends it, nor any hook once the probe detached in it, and result() then gave the forward
    before it as this one's."""
    return RuntimeError("the last forward did not end under the probe (a Ctrl-C or another BaseException stopped it "
                        "inside the model, or the probe detached while it ran), so nothing was recorded for it")


class Results(threading.local):
    """The last forward's attribution (or why there is none), per thread. Shared by the probe and its hooks: the
    probe keeps it after it detaches, without keeping the model."""

    last: Attribution | BaseException | None = None


class _Task:
    """One task-model forward running in this thread: whether it is a step of a recorded call, whether its blocks
    reached the hooks, and (a plain forward) its backbone's capture, assembled when the task model returns, and the
    ``logits_to_keep`` it was called with."""

    __slots__ = ("in_call", "run", "blocks_ran", "backbone_ran", "capture", "keep", "ids")

    def __init__(self, run: Recording | None, keep: Any = None, ids: bool = False) -> None:
        self.in_call, self.run, self.blocks_ran, self.backbone_ran = run is not None, run, False, False
        self.capture: Capture | None = None
        self.keep = keep
        self.ids = ids  #: whether the task model was given input_ids (the backbone may get inputs_embeds only)


class Recorder:
    """The hooks, and the per-thread state of the calls they record. The model holds it (through its hooks), never
    the :class:`Probe`, so neither a dropped probe nor a dropped model is kept alive by the other."""

    def __init__(self, plan: Plan, backbone: nn.Module, gens: Generations | None, engines: list[Engine],
                 results: Results, notice: Notice) -> None:
        self.plan, self.backbone, self.gens, self.engines = plan, backbone, gens, engines
        self.notice = notice
        self._signature = inspect.signature(backbone.forward)
        # The backbone's **kwargs (flash / continuous-batching arguments arrive there) are read like named ones.
        self._var_keyword = next((name for name, parameter in self._signature.parameters.items()
                                  if parameter.kind is inspect.Parameter.VAR_KEYWORD), None)
        self._local = threading.local()
        self.results = results
        self._told_stray = False
        self._stray_broken: set[int] = set()  # id() of each engine whose stray() raised: said once, then skipped
        self._told_cached = False  # a forward that continues a KV cache was said not recorded
        #: id(cache) -> (weak reference to it, why its forwards are not recorded, or None: a loop of the user's): each
        #: KV cache whose context the probe did not follow is one unrecorded call (:meth:`_continued`)
        self._continued_caches: dict[int, tuple[weakref.ref, str | None]] = {}
        #: id(cache) -> weak reference to it: the KV caches a plain forward began (:meth:`_stray`), whose later
        #: forwards are a call's the probe saw start but did not follow
        self._begun_caches: dict[int, weakref.ref] = {}
        # Layers whose features a hook computes; the last block is hooked in any case, for final logits.
        self._wanted = set(plan.layers)
        # Blocks whose input is checked to be the very tensor the probe kept as the block before's output
        # (:meth:`_changed`): where that layer is kept, and both it and the block's output are blocks' own (not a
        # layer_outputs submodule's). Layer 0 needs none: block 1's first pre-hook reads it, after every hook of the
        # embedding's.
        own = [True, *(module is block for module, block in zip(plan.subject.layer_modules, plan.blocks))]
        self._checked = {index for index in range(2, plan.n_blocks + 1)
                         if index - 1 in self._wanted and own[index - 1] and own[index]}
        # Under torch.compile the hooks only keep what a plain forward saw (graph-safe: no host read, no lock).
        self.plain = TracedForward(functools.partial(embedding_norms, plan))
        self._recompiled = Recompiled()
        #: (name, how to find it in the model now, weak reference to it) of each module :meth:`register` hooks
        self._hooked: list[tuple[str, Callable[[], nn.Module], weakref.ref]] = []

    # -- per-thread state --------------------------------------------------------------------------------

    def _stacks(self) -> tuple[list[Capture | None], list[_Task]]:
        local = self._local
        try:
            return local.captures, local.tasks
        except AttributeError:
            local.captures, local.tasks = [], []
            return local.captures, local.tasks

    def _run(self) -> Recording | None:
        return self.gens.current() if self.gens is not None else None

    def _fail(self, what: str, error: BaseException) -> None:
        """This thread's current capture failed: nothing more is recorded for its call."""
        captures, _ = self._stacks()
        if captures:
            captures[-1] = None
        error = self._replaced() or error
        run = self._run()
        if run is not None:
            run.fail(what, error)
        else:
            reason(what, error)
            self.results.last = _without_traceback(error)

    def _drop_ended(self, run: Recording | None) -> None:
        """Let go of what this thread holds of a forward a BaseException (Ctrl-C) ended, its hidden states
        included: torch runs always_call hooks on an Exception only, so its entries were never taken off. A plain
        task forward whose blocks ran is such a one when another forward starts, whether its backbone's capture came
        (the Ctrl-C landed in its head or loss) or not (its backbone runs once); a step of a call is when a forward
        starts outside that call."""
        captures, tasks = self._stacks()
        ended = tasks[-1] if tasks else None
        if ended is not None and ended.blocks_ran and (not ended.in_call or ended.run is not run):
            tasks.clear()
            captures.clear()

    def _current(self) -> Capture | None:
        captures, _ = self._stacks()
        return captures[-1] if captures else None

    def _arguments(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        if not args and self._var_keyword not in kwargs:  # keywords only, as task models call their backbone:
            return dict(kwargs)  # binding would give the same names, once flattened
        arguments = self._signature.bind_partial(*args, **kwargs).arguments
        extra = arguments.pop(self._var_keyword, None) if self._var_keyword else None
        if extra:
            arguments.update(extra)
        return arguments

    def _stray(self, arguments: dict[str, Any], past: int | torch.Tensor | None) -> bool:
        """Whether a forward outside every recorded call is an engine's own (its warmup, or a step it cannot
        follow), or continues a KV cache holding ``past`` positions (:func:`~.conventions.start` at its start), which
        a plain forward's record cannot explain: then it is not recorded, and the result says why.
        Said once per probe: as a warning when the engine cannot follow its host at all (also kept as
        ``Probe.unrecorded``), else as information."""
        for engine in self.engines:
            if id(engine) in self._stray_broken:
                continue
            try:
                why = engine.stray(arguments)
            except BaseException as error:  # noqa: BLE001 - a broken engine must not cost every plain forward's record
                self._stray_broken.add(id(engine))
                logger.warning("nxl_hooks: engine %r failed to tell its own forwards (%s); left out of that check: "
                               "fix or uninstall it", engine.name, typed(plugins.contained(error)))
                continue
            if why is None:
                continue
            self.results.last = RuntimeError(why)
            if engine.unfollowed:
                self.notice.text = f"not recorded: {engine.unfollowed}"
            if not self._told_stray:
                self._told_stray = True
                logger.log(logging.WARNING if engine.unfollowed else logging.INFO,
                           "nxl_hooks: %s forwards are not recorded (%s); they run unchanged", engine.name,
                           engine.unfollowed or "a forward outside its generation steps, e.g. a warmup")
            return True
        if arguments.get("cu_seq_lens_q") is not None:  # padding-free inputs, in a model no engine follows
            self.results.last = RuntimeError(
                "the last forward packed several sequences into one row (cu_seq_lens_q: padding-free inputs), which "
                "a plain forward's record cannot explain; pass a padded batch")
            return True
        # (read on the host where it is a tensor, a static cache's: a plain forward's record is made on it anyway)
        past = int(past) if past is not None else 0
        cache = find_cache(arguments)
        if past not in (0, self.plan.subject.virtual_tokens):
            self.results.last = ValueError(self._continued(cache, past))
            return True
        if cache is not None:
            if len(self._begun_caches) >= 64:  # (the caches freed since go)
                self._begun_caches = {key: ref for key, ref in self._begun_caches.items() if ref() is not None}
            self._begun_caches[id(cache)] = weakref.ref(cache)
        return False

    def _continued(self, cache: Any, past: int) -> str:
        """Why a forward that continues ``cache``, a KV cache the probe never saw, is not recorded: a ``generate``
        call that started before the probe attached (``nxl attach`` or ``nxl ctl resume`` mid-call), or a decoding
        loop of the user's. On a model that generates, each such cache is one call run unrecorded (counted once,
        told apart by the cache object its forwards share, not per token), and a call of generate is said as it is
        met; a loop of the user's is said once per probe."""
        if self.gens is None or cache is None:  # no call to count, or nothing to tell its forwards by
            return self._own_loop(past)
        seen = self._continued_caches.get(id(cache))
        new = seen is None or seen[0]() is not cache  # (an id a freed cache had may be another's now)
        if new:  # (once per cache) whether transformers' generate loop runs it, and whether its start was seen
            utils = sys.modules.get("transformers.generation.utils")
            frame, in_generate = sys._getframe(), False
            while frame is not None and not in_generate:
                in_generate = utils is not None and frame.f_code.co_filename == utils.__file__
                frame = frame.f_back
            begun = self._begun_caches.get(id(cache))
            called = (_BOUND_BEFORE if begun is not None and begun() is cache else _STARTED_BEFORE) if in_generate \
                else None
            self._continued_caches = {key: value for key, value in self._continued_caches.items()
                                      if value[0]() is not None}
            self._continued_caches[id(cache)] = (weakref.ref(cache), called)
        else:
            called = seen[1]
        why = called or self._own_loop(past)
        if new:
            self.notice.unrecorded(why if called else f"not recorded: {why}", log=called is not None)
        return why

    def _own_loop(self, past: int) -> str:
        """A decoding loop of the user's (said once per probe; its every forward's result says it)."""
        # (filled before attaching, or by forwards of the user's under the probe: each is recorded alone, so either
        # way this one's context is in no record)
        why = (f"the last forward continued a KV cache holding {past} positions (past_key_values) filled by other "
               "forwards (before the probe, or earlier ones of your own: each plain forward is recorded alone), so "
               "its tokens' context is unknown and it was not recorded; run the whole sequence in one forward, or "
               "decode with generate, which nxl_hooks follows step by step")
        if not self._told_cached:
            self._told_cached = True
            logger.warning("nxl_hooks: %s", why)
        return why

    # -- hooks -------------------------------------------------------------------------------------------

    def _replaced(self) -> RuntimeError | None:
        """Why hooks of the probe's did not run, where a module they are on is no longer the model's (replaced while
        attached: ``model.model.layers[2] = block``, ``set_input_embeddings``): what followed from it (a layer
        missing, no word embeddings, no blocks run) would blame the config, the inputs or compiled code. Looked for
        only once a forward went wrong."""
        for name, find, hooked in self._hooked:
            try:
                now = find()
            except Exception:  # noqa: BLE001 - gone from the model altogether: replaced too
                now = None
            if now is not hooked():
                return replaced(name)
        return None

    def _hook(self, name: str, find: Callable[[], nn.Module]) -> nn.Module:
        """The model's module ``find`` gives now, which the probe hooks (named ``name``), kept for :meth:`_replaced`."""
        module = find()
        self._hooked.append((name, find, weakref.ref(module)))
        return module

    def register(self) -> list[torch.utils.hooks.RemovableHandle]:
        plan, handles = self.plan, []
        subject, path = plan.subject, plan.spec.blocks
        eager_frame(Recorder.on_task_start)
        eager_frame(Recorder.on_task_end)
        try:  # each an Owned: a copy of the model made while attached gets hooks that do nothing
            handles.append(plan.model.register_forward_pre_hook(Owned(self.on_task_start), with_kwargs=True))
            handles.append(_always_called(plan.model, Owned(self.on_task_end)))
            self._hook("backbone", lambda: subject.backbone)
            handles.append(self.backbone.register_forward_pre_hook(Owned(self.on_backbone_start), with_kwargs=True))
            handles.append(_always_called(self.backbone, Owned(self.on_backbone_end)))
            # first: layer 0 is what the embeddings gave, a pre-hook of the user's on block 1 steers block 1's input
            first = self._hook(f"{path}.0", lambda: blocks(plan.model, plan.spec)[0])  # (the list replaced too)
            handles.append(first.register_forward_pre_hook(Owned(self.on_block_input), with_kwargs=True, prepend=True))
            for index, module in enumerate(subject.layer_modules, start=1):
                if index in self._wanted or index == plan.n_blocks or index in self._checked:
                    name = f"{path}.{index - 1}" if module is plan.blocks[index - 1] else plan.spec.layer_outputs[index]
                    self._hook(name, lambda at=index - 1: subject.layer_modules[at])
                    handles.append(module.register_forward_hook(Owned(self._block_hook(index)), with_kwargs=True))
            if plan.embedding == "word":
                embedding = self._hook("input embedding", plan.model.get_input_embeddings)
                handles.append(embedding.register_forward_hook(Owned(self.on_word_embedding)))
            peft = compiled_original(plan.subject.given) or plan.subject.given
            if peft is not plan.model and hasattr(peft, "active_peft_config"):  # a PeftModel: see on_peft_start
                handles.append(peft.register_forward_pre_hook(Owned(self.on_peft_start), with_kwargs=True))
                handles.append(_always_called(peft, Owned(self.on_peft_end)))
        except BaseException:
            for handle in handles:
                handle.remove()
            raise
        return handles

    def _plain_traced(self) -> bool:
        """Inside a forward dynamo traces (:func:`traced`): whether it is a plain one, outside every recorded
        call, and not a non-strict export's (:func:`_exporting`: its tensors are fake; a strict export replays
        nothing into the probe). Only then do the hooks keep anything (:class:`~.traced.TracedForward`). Nothing of
        the probe's goes into the compiled code of a recorded call, which would change the model's own kernels
        (inductor fuses what the hooks add into them and tunes them anew, and a GPU's bf16 logits then differ in the
        last place): a ``generate`` call records its compiled forwards by running them again eagerly when it ends,
        and an engine's taps record its steps."""
        return self._run() is None and not _exporting()

    def settle(self) -> None:
        """Assemble this thread's last plain forward that ran wholly compiled (the task model's hooks traced too):
        when its result is read, and at detach (:mod:`.probe`: once detached, the recorder goes with the model's
        hooks). Never raises."""
        try:
            seen = self.plain.take()
            if seen is not None and seen.capture is not None:
                self._traced(seen, seen.output, seen.keep)
            elif seen is not None:
                self.results.last = self._skipped()
        except Exception as error:  # noqa: BLE001 - never into the user's detach
            self._fail("this forward", error)

    def _took_traced(self, output: Any, keep: Any) -> bool:
        """Assemble this thread's last traced forward, if its blocks' hooks kept one (:meth:`_traced`), as the task
        model ends: whether one was there. Never raises into the host's forward."""
        try:
            seen = self.plain.take()
            if seen is None or seen.capture is None:
                return False
            self._traced(seen, output, keep)
        except Exception as error:  # noqa: BLE001 - never into the host's forward
            self._fail("this forward", error)
        return True

    def _traced(self, seen: Traced, output: Any, keep: Any) -> None:
        """Assemble a plain forward that ran compiled (:meth:`~.traced.TracedForward.take`), whose task model gave
        ``output`` called with ``logits_to_keep`` ``keep``, checked as an eager one is at its start and between its
        blocks (by value where the graph gave a block's input and the block before's output apart: one host read
        each, once per forward)."""
        capture = seen.capture
        if self._stray(seen.arguments, seen.past) or any(
                self._changed(self.plan.subject.layer_modules[index - 1], index, capture.hidden[index - 1], given,
                              by_value=True)
                for index, given in seen.given.items() if index - 1 in capture.hidden):
            return
        self._finish(capture, output, keep)

    def on_task_start(self, module: nn.Module, args: tuple, kwargs: dict = SHORT) -> None:
        if kwargs is SHORT:  # called after its removal
            return
        if traced():
            if self._plain_traced():
                self.plain.task(kwargs.get("logits_to_keep"))
            return
        self._recompiled.check(module)
        _, tasks = self._stacks()
        run = self._run()
        self._drop_ended(run)
        ids = kwargs.get("input_ids", args[0] if args else None)
        tasks.append(_Task(run, kwargs.get("logits_to_keep"), isinstance(ids, torch.Tensor)))
        if run is None:
            self.results.last = _unended()
        else:  # (once per call: the next plain forward sets its own)
            recorded, last = run is not NOT_RECORDED, self.results.last
            if not isinstance(last, _InCall) or last.recorded != recorded:
                self.results.last = _InCall(recorded)
                self.plain.discard()  # a forward traced before it is not the last either

    def on_task_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        if traced():
            if self._plain_traced():
                self.plain.keep("logits", getattr(output, "logits", None))
            return
        _, tasks = self._stacks()
        if not tasks:
            return
        task = tasks.pop()
        if task.capture is not None:
            self.plain.discard()  # a traced forward kept before this one is not the last any more
            self._finish(task.capture, output, task.keep)
        elif task.in_call:
            run = self._run()
            # (its blocks ran compiled: its logits are not those of a forward the hooks followed)
            if run is not None and not run.failed and output is not None and task.blocks_ran:
                try:  # a step of a call: its logits give the probability of the token it emits
                    run.after_task(output)
                except Exception as error:  # noqa: BLE001 - never into the host's forward
                    run.fail("this call", error)
            elif run is not None and not run.failed and not task.backbone_ran and self.plan.subject.backbone is not \
                    self.backbone:  # (one look, not _replaced(): a compiled step also leaves both hooks unrun)
                run.fail("this call", replaced("backbone"))
            elif isinstance(run, Run) and not task.backbone_ran:  # the whole forward ran compiled
                run.ran_compiled()
        elif not task.blocks_ran and output is not None and self._took_traced(output, task.keep):
            pass  # its forward ran compiled, tracing the blocks' hooks: assembled, or why not said
        elif not task.blocks_ran and output is not None and task.backbone_ran:
            self.results.last = self._replaced() or RuntimeError(
                f"{type(self.plan.model).__name__} ran its backbone's hooks, but its blocks ran code compiled by "
                "torch.compile (the backbone's forward or its blocks compiled in place, regional compilation), which "
                "a plain forward's record cannot follow; compile the model's own forward instead "
                "(model.forward = torch.compile(model.forward)), or run the call under "
                "`with torch.compiler.set_stance('force_eager'):`")
        elif not task.blocks_ran and output is not None:  # its hooks ran, those of its blocks did not: compiled code
            self.results.last = self._skipped()

    def _skipped(self) -> RuntimeError:
        return self._replaced() or RuntimeError(
            f"{type(self.plan.model).__name__} ran, but its blocks never reached the probe's hooks: the call ran "
            "code compiled by torch.compile before the hooks existed, which skips them. Attach to the compiled model "
            "itself (nxl.attach(compiled) runs it eagerly while attached), call the uncompiled module, or run the "
            "call under `with torch.compiler.set_stance('force_eager'):`")

    def _peft_calls(self) -> list[tuple[Any, int, torch.Tensor | None]]:
        """This thread's PeftModel calls running: (their ids, virtual tokens, the ids' word-embedding norms)."""
        local = self._local
        try:
            return local.peft_calls
        except AttributeError:
            local.peft_calls = []
            return local.peft_calls

    def on_peft_start(self, module: nn.Module, args: tuple, kwargs: dict = SHORT) -> None:
        """A PeftModel's call: with prompt tuning its backbone gets the virtual tokens' and the ids' embeddings
        (inputs_embeds) only, so the ids the records name (:func:`~.forward.open_capture`) are this call's."""
        if kwargs is SHORT or traced():
            return
        try:
            virtual = self.plan.subject.prompt_tokens
        except Exception:  # noqa: BLE001 - never into the host's call (PEFT's active config of several adapters)
            virtual = 0
        self._peft_calls().append((kwargs.get("input_ids", args[0] if args else None), virtual, None))

    def on_peft_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        calls = self._peft_calls()
        if calls and not traced():
            calls.pop()

    def on_backbone_start(self, module: nn.Module, args: tuple, kwargs: dict = SHORT) -> None:
        if kwargs is SHORT:  # called after its removal
            return
        if traced():
            if self._plain_traced():
                self.plain.begin(self._arguments(args, kwargs))
            return
        self._recompiled.check(module)
        run = self._run()
        self._drop_ended(run)
        captures, tasks = self._stacks()
        if tasks:
            tasks[-1].backbone_ran = True
        elif run is None:  # the backbone called by itself: a plain forward of its own
            self.results.last = _unended()
        captures.append(None)  # replaced below once the inputs are known; a failure or a skipped call leaves None
        try:  # every rank of a tensor-parallel model is here at once: the one place its head may gather weights
            self.plan.head.refresh()
            mixed = self.plan.head.mixed_adapters()
        except Exception as error:  # noqa: BLE001 - never into the host's forward
            self._fail("this forward", error)
            return
        if mixed is not None:
            self._fail("this forward", mixed)
            return
        if run is not None and run.failed:
            return
        try:
            bound = self._arguments(args, kwargs)
            if run is None and self._stray(bound, start(bound)[0]):
                return
            peft_calls = self._peft_calls()
            capture = open_capture(bound, peft_calls[-1] if peft_calls and peft_calls[-1][1] else None)
            if capture.input_ids is None and tasks and tasks[-1].ids:  # the model embedded its ids itself
                capture.built_embeds = type(self.plan.model).__name__
            if run is not None:
                run.before_forward(bound)
            captures[-1] = capture
        except Exception as error:  # noqa: BLE001 - never into the host's forward
            self._fail("this forward", error)

    def on_block_input(self, module: nn.Module, args: tuple, kwargs: dict = SHORT) -> None:
        if kwargs is SHORT:  # called after its removal
            return
        if traced():
            if self._plain_traced():
                hidden = args[0] if args else kwargs["hidden_states"]
                if self.plan.embedding == "layer_input":
                    self.plain.keep("embed", hidden.detach())
                if 0 in self._wanted:
                    self.plain.layer(0, hidden)
            return
        captures, tasks = self._stacks()
        if tasks:
            tasks[-1].blocks_ran = True
        if not captures and torch._C._current_graph_task_id() != -1:
            # backward running a checkpointed block again (transformers up to 5.22 checkpoint a block's __call__,
            # hooks included): not a forward, and the forward it belongs to was recorded when it ran
            return
        if not captures and self._backbone_running():
            self.results.last = RuntimeError(
                "the last forward in this thread started before the probe attached (its blocks ran under the probe, "
                "its start did not), so nothing was recorded for it; the forwards that start from now on are recorded")
            return
        if not captures:
            self.results.last = _without_traceback(RuntimeError(
                f"{type(self.plan.model).__name__} ran its blocks without calling "
                f"{type(self.backbone).__name__}.forward, so nxl_hooks saw no input_ids: set `backbone` (the module "
                f"that takes input_ids and runs the blocks) in the registry entry for "
                f"{self.plan.model.config.model_type!r}"))
            return
        capture = captures[-1]
        if capture is None:
            return
        try:
            hidden = args[0] if args else kwargs["hidden_states"]
            if hidden.requires_grad:
                hidden = hidden.detach()
            with torch.no_grad():
                if self.plan.embedding == "layer_input":
                    capture.embed_norm = embedding_norms(self.plan, hidden)
                if 0 in self._wanted:
                    capture.hidden[0] = hidden
        except Exception as error:  # noqa: BLE001
            self._fail("this forward", error)

    def _backbone_running(self) -> bool:
        """Whether the backbone's forward runs in this thread although its hooks did not run for it: it started
        before the probe attached (``nxl attach PID`` into a busy process, an attach from another thread), so its
        blocks reach the hooks with no capture open. Looked for only then: otherwise the blocks were called without
        the backbone, which the registry entry's ``backbone`` tells."""
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_locals.get("self") is self.backbone:
                return True
            frame = frame.f_back
        return False

    def on_word_embedding(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if traced():
            if self._plain_traced():
                self.plain.keep("embed", output.detach())
                self.plain.keep("embed_ids", args[0] if args and isinstance(module, nn.Embedding) else None)  # (below)
            return
        capture, calls = self._current(), self._peft_calls()
        if capture is None and not (calls and calls[-1][1]):  # the embedding called on its own, outside a forward
            return
        try:
            # the ids where the module is the embedding itself (a wrapper's LoRA adds to its rows)
            ids = args[0] if args and isinstance(module, nn.Embedding) else None
            norms = embedding_norms(self.plan, output, ids)
            if capture is None:  # PEFT prompt tuning embeds the ids before its backbone runs: open_capture takes them
                calls[-1] = (*calls[-1][:2], norms)
            else:
                capture.embed_norm = norms
        except Exception as error:  # noqa: BLE001
            self._fail("this forward", error)

    def _block_hook(self, index: int) -> Callable:
        # Decided once: this runs for every block of every forward, one-token decoding steps included. Its eager
        # path is the most frequent Python the probe adds to a decoding step (a 7B model's 32 blocks per token, on a
        # GPU whose step is bound by the host's Python): it reads this thread's capture in place, no method calls.
        wanted, last, local = index in self._wanted, index == self.plan.n_blocks, self._local
        checked, hands_on = index in self._checked, index + 1 in self._checked

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any = SHORT) -> None:
            if output is SHORT:  # called after its removal
                return
            if traced():
                if self._plain_traced():
                    if checked:
                        self.plain.given(index, args[0] if args else kwargs.get("hidden_states"))
                    if wanted:
                        self.plain.layer(index, _hidden(output))
                    if last:
                        self.plain.keep("last", _hidden(output).detach())
                return
            captures = getattr(local, "captures", None)  # as _current(), inline
            capture = captures[-1] if captures else None
            if capture is None:
                return
            try:
                if checked:  # inline: one identity test per block while nothing changed the states
                    handed, capture.handed = capture.handed, None
                    given = args[0] if args else kwargs.get("hidden_states")
                    if handed is not None and given is not handed and self._changed(module, index, handed, given):
                        return
                hidden = output[0] if isinstance(output, (tuple, list)) else output  # _hidden(), inline
                if hands_on:
                    capture.handed = hidden
                if hidden.requires_grad:  # under no_grad (serving, generate) there is nothing to detach from
                    hidden = hidden.detach()
                if last:
                    capture.last_hidden = hidden
                if wanted:
                    capture.hidden[index] = hidden
            except Exception as error:  # noqa: BLE001
                self._fail("this forward", error)

        return hook

    def _changed(self, block: nn.Module, index: int, kept: torch.Tensor, given: Any, by_value: bool = False) -> bool:
        """Whether block ``index`` was called on other hidden states than the probe kept as block ``index - 1``'s
        output, because a forward hook of the user's, registered after attaching (so run after the probe's),
        replaced that output: then the forward is not recorded, and says why. Told apart without a host read (a
        view of the same memory, a copy to another device as a pipeline across devices makes, passes), and
        ``by_value`` also by a host read where the memory differs (a compiled forward's graph may return one tensor
        as two outputs); a pre-hook of the user's on block ``index`` steers that block's input, after the layer
        before is what it is, so then the states are let pass."""
        try:
            if not isinstance(given, torch.Tensor) or given.device != kept.device or given.data_ptr() == kept.data_ptr():
                return False
            if by_value and given.shape == kept.shape and given.dtype == kept.dtype and torch.allclose(
                    given, kept, rtol=0, atol=0, equal_nan=True):  # (a NaN the model made is no change)
                return False
        except Exception:  # noqa: BLE001 - a tensor subclass without storage (a DTensor): nothing tells
            return False
        if any(not isinstance(hook, Owned) for hook in block._forward_pre_hooks.values()):
            return False
        layer = index - 1
        self._fail("this forward", RuntimeError(
            f"a hook changed block {layer}'s output (layer {layer}'s hidden states) after the probe read it, so the "
            "records would not be of what the model went on with: register such a hook before attaching, or with "
            "prepend=True"))
        return True

    def on_backbone_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        if traced():
            return
        captures, tasks = self._stacks()
        capture = captures.pop() if captures else None
        if capture is None:
            return
        run = self._run()
        if output is None:  # the model's own forward raised (an always_call hook): nothing to record
            if run is None:
                self.results.last = RuntimeError("the last forward raised inside the model, so nothing was recorded")
            return
        if run is not None:
            if capture.last_hidden is None and (why := self._replaced()) is not None:  # (else compiled blocks)
                run.fail("this call", why)
                return
            try:
                with torch.no_grad():
                    run.after_forward(capture)
            except Exception as error:  # noqa: BLE001
                run.fail("this call", self._replaced() or error)
        elif tasks and not tasks[-1].in_call and tasks[-1].blocks_ran:
            tasks[-1].capture = capture  # assembled when the task model returns, with its own logits
        elif not tasks:  # the backbone, or the task model's forward, called directly: the head gives its logits
            self.plain.discard()
            self._finish(capture, types.SimpleNamespace(logits=None))
        else:
            self._finish(capture, None)

    def _finish(self, capture: Capture, output: Any, keep: Any = None) -> None:
        if output is None:
            self.results.last = RuntimeError("the last forward raised inside the model, so nothing was recorded")
            return
        try:
            with torch.no_grad():
                self.results.last = assemble(self.plan, capture, output, keep)
        except Exception as error:  # noqa: BLE001
            self._fail("this forward", error)
