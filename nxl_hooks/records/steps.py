"""Per-token records of a ``generate`` call (or of one request under continuous batching).

    with nxl.attach(model, tokenizer=tok) as probe:
        model.generate(**enc, max_new_tokens=32)
    probe.steps[0].scores["normxlogit"]  # (len(layers), batch, context_len); .normxlogit reads the same
    probe.calls[-1].request_id           # which request the records belong to
    call = probe.calls[-1]; call.text    # the generated text; call.model, call.started, call.ended
    call.attribution(call.steps[0]).top(3)   # ranked as everywhere: without special and chat-template tokens
"""

from __future__ import annotations

import math
import time as _time
import weakref
from dataclasses import dataclass, field

import torch

from ..method.registry import DEFAULT
from ..method.select import special_flags
from .attribution import Attribution, by_method, layers_text
from .tokens import plain_text, printable, unseen, untexted, whole_characters
from .view import Choice, StepView, ranking

__all__ = ["GenerationCall", "STEP_TENSORS", "Step"]

_NOW = object()  # Step's time when none is given: the moment it is made

#: The tensors of a step record, as the sink stores them (scores of methods beyond DEFAULT as ``scores.<method>``).
STEP_TENSORS = ("token", "target", *DEFAULT, "embed_norm", "mask", "active")


@dataclass(eq=False, init=False)  # records compare by identity: tensor fields have no single truth value
class Step:
    """The attribution of one emitted token: what the context before it contributed to it, per layer.

    ``step.scores["normxlogit"][step.layers.index(l), b, i]``: token i's NormXLogit, at layer l, for row b's emitted
    token (``step.normxlogit`` reads the same; other methods' scores sit beside it in ``scores``).
    Rows are generate's rows (``num_return_sequences`` rows per prompt). A row that has finished (an EOS
    token, a stop string, a stopping criterion) keeps getting records until the whole batch stops, as generate
    keeps padding it: those records explain the pad token generate emitted and have ``active`` False; the pad
    positions have ``mask`` False.
    Records scored together share one copy of their tokens, active rows, probabilities, norms, masks and (when every
    method is pointwise) scores, each holding views of it: ``.clone()`` one before changing it in place.
    """

    call: int  #: index of the generate call under this probe (``GenerationCall.index``)
    step: int  #: 0 for the first new token
    position: int  #: index of the emitted token in the full sequence (prompt, left padding included)
    token: torch.Tensor  #: int64 (batch,): the token id generate emitted (sampled or argmax)
    target: torch.Tensor  #: int64 (batch,) the explained id (= token unless attach(target=...)), or (batch, k)
    #: method name -> float32 (len(layers), batch, position[, k]): every position before the token; "normxlogit"
    #: and "logat" (HoT(h_i^l)[target]) always, then the other methods the probe computed
    scores: dict[str, torch.Tensor]
    embed_norm: torch.Tensor  #: float32 (batch, position)
    mask: torch.Tensor  #: bool (batch, position): False on left padding and on pad tokens after a row finished
    active: torch.Tensor  #: bool (batch,): False where the row had already finished before this step
    layers: list[int]
    n_blocks: int | None  #: the model's block count, for negative layer indices
    probability: torch.Tensor | None  #: float32, shaped like ``target``: the model's own softmax probability
    #: of each explained id at this step (before any logits processor or sampling temperature)
    readable: list[str] | None  #: (batch,) the emitted token of each row as people read it ('␣Paris')
    #: per row, the readable texts of the call's tokens (prompt, then emitted), shared by the call's steps and
    #: read up to ``position``; set by :meth:`GenerationCall.link` (None where the texts are not known)
    context: list[list[str]] | None = field(repr=False)
    #: when the record was made, in seconds since the epoch (``time.time()``); None in older files
    time: float | None
    #: the call the step belongs to, set by :meth:`GenerationCall.link` (weak: a kept step does not keep its call's
    #: other steps), so that its repr ranks as ``call.attribution(step).top()``
    _call: "weakref.ReferenceType[GenerationCall] | None" = field(repr=False)

    def __init__(self, call: int, step: int, position: int, token: torch.Tensor, target: torch.Tensor,
                 normxlogit: torch.Tensor | None = None, logat: torch.Tensor | None = None,
                 embed_norm: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                 active: torch.Tensor | None = None, layers: list[int] | None = None, n_blocks: int | None = None,
                 probability: torch.Tensor | None = None, readable: list[str] | None = None,
                 context: list[list[str]] | None = None, time: float | None = _NOW, *,
                 scores: dict[str, torch.Tensor] | None = None) -> None:
        """``Step(..., scores={"normxlogit": ..., "logat": ...})``; ``normxlogit`` / ``logat`` given on their own
        (as before ``scores``) go into the mapping. ``time`` defaults to now."""
        self.call, self.step, self.position, self.token, self.target = call, step, position, token, target
        self.scores = by_method(scores, normxlogit=normxlogit, logat=logat)
        self.embed_norm, self.mask, self.active, self.layers = embed_norm, mask, active, layers
        self.n_blocks, self.probability, self.readable, self.context = n_blocks, probability, readable, context
        self.time = _time.time() if time is _NOW else time
        self._call = None

    def __getstate__(self) -> dict:
        """Pickled (multiprocessing, ``copy``) without the link to its call, a weak reference no pickle holds: it
        ranks as a step read alone until a call links it again."""
        return {**self.__dict__, "_call": None}

    def _linked(self) -> "GenerationCall | None":
        """The call :meth:`GenerationCall.link` linked this step to, while it lives."""
        return self._call() if self._call is not None else None

    normxlogit = Attribution.normxlogit
    logat = Attribution.logat
    methods = Attribution.methods
    method_scores = Attribution.method_scores

    def __repr__(self) -> str:
        """A summary, never the tensors: the emitted token(s) (with its probability where it is an explained id),
        the explained target where it is another id (``attach(target=...)``: named, with its probability), context
        length, layers and the top context positions of row 0 at the last layer for that target, ranked as
        ``step.to_attribution().top()`` ranks them (no special or chat-template token while its call is linked
        and alive). Row 0 ended before this step (``active`` False): it says so, with generate's padding token, and
        nothing it would explain (as :class:`GenerationCall`'s repr and ``generation_html`` leave its padding out).
        ``print(step)``"""
        batch, call = self.token.shape[0], self._linked()
        if self.active is not None and not bool(self.active[0]):
            going = int(self.active[1:].sum())
            return (f"<Step call {self.call} step {self.step}: row 0 had ended (generate's padding: token "
                    f"'{self.names(call, 0)[-1]}', id {int(self.token[0])}); {going} of the {batch - 1} other row(s) "
                    f"still generating, at position {self.position}, layers {layers_text(self.layers)}>")
        token, own, explained, chance = self._chances(0, 0)

        def shown(probability: float | None) -> str:
            return "" if probability is None else f", p {probability:.3g}"

        names = self.names(call, 0)
        target = (f"; explaining target '{self._text_of(call, 0, explained, names)}' (id {explained}{shown(chance)})"
                  if explained != token else "")
        top = self.to_attribution().top(3, layer=self.layers[-1])
        return (f"<Step call {self.call} step {self.step}: token '{names[-1]}' (id {token}{shown(own)})"
                + (f" and {batch - 1} more row(s)" if batch > 1 else "")
                + f" at position {self.position}, layers {layers_text(self.layers)}{target}; top context positions"
                f" at L{self.layers[-1]}: " + ", ".join(f"{p} {score:.4g}" for p, _, score in top) + ">")

    def to_attribution(self, tokens: list[list[str]] | None = None, special: torch.Tensor | None = None,
                       readable: list[list[str]] | None = None, template: torch.Tensor | None = None) -> Attribution:
        """This step as an :class:`Attribution` (prediction position = ``position - 1``), e.g. for ``.top()``.

        ``tokens`` / ``special`` / ``readable`` / ``template``: the context's token pieces, special-token flags,
        readable texts and chat-template flags per row, when known (``call.context_template(step.position)``);
        ``readable`` defaults to the context's texts the step was recorded with (without texts and ``tokens``, to
        ``#ID`` / ``@N`` as :meth:`names` and :meth:`view` name them), ``special`` and ``template`` to its linked
        call's flags (so that ``top()`` ranks as ``call.attribution(step)``: no special token)."""
        batch, call = self.token.shape[0], self._linked()
        if call is not None:
            special = call.context_special(self.position) if special is None else special
            template = call.context_template(self.position) if template is None else template
        if readable is None and (self.context is not None or tokens is None):
            # the context as the view names it, '#ID' / '@N' where the record holds no texts (else top() and the repr
            # named a token by its position), by the one rule of names(); given pieces show when it has none
            ids = call.context_ids(self.position) if call is not None and self.context is None else None
            readable = [self.names(call, row, ids)[:-1] for row in range(batch)]
        return Attribution(
            scores=self.scores,
            embed_norm=self.embed_norm,
            layers=list(self.layers),
            target=self.target,
            mask=self.mask,
            position=torch.full((batch,), self.position - 1, dtype=torch.long),
            example=torch.arange(batch),
            tokens=tokens,
            # what the call's probe explains (its model, quantization, versions), so a saved step says what made it
            meta={**((call.meta or {}) if call is not None else {}), "call": self.call, "step": self.step,
                  "n_blocks": self.n_blocks},
            special=special,
            readable=readable,
            template=template,
            probability=self.probability,
            target_text=self._target_texts(call),
        )

    def _target_texts(self, call: "GenerationCall | None") -> list[list[str]] | None:
        """Each row's explained ids as read (:attr:`Attribution.target_text`), where every one is known
        (:meth:`target_names`), else None; the emitted token named as :meth:`names` names it ('#ID' without texts)."""
        if self.target.dim() == 1 and torch.equal(self.target, self.token):
            return [[self.token_name(row)] for row in range(self.token.shape[0])]
        texts = self.target_names(call.target_texts if call is not None else None)
        return texts if all(text is not None for row in texts for text in row) else None

    def target_names(self, fixed: "dict[int, str] | None") -> list[list[str | None]]:
        """The one rule naming a step's explained ids, per row (batch, k): the emitted token's readable text where
        the id is that token, else the fixed target's text its call recorded (``fixed``:
        :attr:`GenerationCall.target_texts`), else None (not known)."""
        rows = self.target.reshape(self.token.shape[0], -1).tolist()
        return [[self.readable[row] if self.readable and id_ == int(self.token[row]) else (fixed or {}).get(id_)
                 for id_ in ids] for row, ids in enumerate(rows)]


    def view(self, call: "GenerationCall | None" = None, *, k: int = 5, row: int = 0, label: int = 0,
             names: list[str] | None = None, special: torch.Tensor | None = None,
             model: str | None = None, target: str | None = None, all_positions: bool = False) -> StepView:
        """This step as every live reader shows it (:class:`~nxl_hooks.records.view.StepView`): row ``row``'s
        token and, per layer, the ``k`` context tokens that drove target ``label`` most. ``call``: the step's call,
        which knows its request, prompt, special and chat-template tokens. ``names``: the texts of positions
        ``0 .. position`` (the context, then the emitted token), default the record's readable texts (``#ID`` where
        unknown); ``special``: bool (batch, position), the context's special tokens, default ``call.special_ids``';
        ``target``: the text of the explained id where it is not the emitted token (``attach(target=...)``),
        default the text ``call`` recorded of it (:attr:`GenerationCall.target_texts`), else as the context names
        that id, else ``#ID`` (the record holds no text of it); ``all_positions``: every
        real context token ranks (:meth:`~nxl_hooks.Attribution.top`).
        ``probe.calls[-1].steps[0].view(probe.calls[-1], k=3).to_json()``"""
        batch = self.token.shape[0]
        token, own, explained, probability = self._chances(row, label)
        if names is None:
            names = self.names(call, row)
        if special is None and call is not None:
            special = call.context_special(self.position)
        template = call.context_template(self.position) if call is not None else None  # the template does not rank
        shown = whole_characters(names[: self.position + 1])  # what was there when the token was made, never later
        res = self.to_attribution(tokens=[names[: self.position]] * batch, special=special, template=template,
                                  readable=[shown[:-1]] * batch)
        other = explained != token  # the scores explain another id: the view names it
        if other and target is None:
            target = self._text_of(call, row, explained, names)
        return StepView(step=self.step, position=self.position, token_id=token, token=shown[-1], probability=own,
                        active=bool(self.active[row]),
                        scores={name: ranking(res, k, row, label, name, all_positions=all_positions)
                                for name in self.scores},
                        request_id=call.request_id if call is not None else None, model=model,
                        choice=call.choice if call is not None else None,
                        target_id=explained if other else None, target=target if other else None,
                        target_probability=probability if other else None)

    def _chances(self, row: int, label: int) -> tuple[int, float | None, int, float | None]:
        """(row ``row``'s emitted token, its probability, the explained id ``label``, that id's probability): the
        record has the model's probability of the explained ids only, so the token's is known where it is one of
        them; a NaN probability is None."""
        batch, token = self.token.shape[0], int(self.token[row])
        targets = self.target.reshape(batch, -1)[row].tolist()
        probabilities = [None] * len(targets) if self.probability is None else [
            None if math.isnan(p) else p for p in self.probability.reshape(batch, -1)[row].tolist()]
        own = probabilities[targets.index(token)] if token in targets else None
        return token, own, targets[label], probabilities[label]

    def _text_of(self, call: "GenerationCall | None", row: int, id_: int, names: list[str]) -> str:
        """How a view names explained id ``id_``: the text its call recorded of a fixed target
        (:attr:`GenerationCall.target_texts`), else the text of ``names`` where row ``row``'s context holds it, else
        ``#ID`` (the record holds no text of it)."""
        fixed = call.target_texts if call is not None else None
        if fixed and id_ in fixed:
            return fixed[id_]
        ids = call.context_ids(self.position) if call is not None else None
        known = ids[row].tolist() if ids is not None else []
        return names[known.index(id_)] if id_ in known else untexted(id_)

    def names(self, call: "GenerationCall | None", row: int, ids: torch.Tensor | None = None) -> list[str]:
        """Texts of positions 0 .. position from the record: its readable texts, else ``#ID`` (``@N`` where even
        the id is not known: a call read from a trimmed sink). ``ids``: ``call.context_ids(step.position)`` where the
        caller holds it already (naming every row, it is made once)."""
        own = self.token_name(row)
        if self.context is not None:
            return [*self.context[row][: self.position], own]
        if ids is None and call is not None:
            ids = call.context_ids(self.position)
        known = ids[row].tolist() if ids is not None else [-1] * self.position
        return [untexted(i) if i >= 0 else unseen(n) for n, i in enumerate(known)] + [own]

    def token_name(self, row: int) -> str:
        """The emitted token of row ``row`` as every output names it: its readable text, else ``#ID``."""
        return self.readable[row] if self.readable else untexted(self.token[row])


@dataclass(eq=False)
class GenerationCall:
    """One ``generate`` call (or continuous-batching request) under a probe: its prompt, its step records and,
    once it returned, its output. ``call = probe.calls[-1]; call.attribution(call.steps[0]).top(3)``"""

    index: int  #: counts the probe's calls from 0, in the order they started
    layers: list[int]
    prompt_ids: torch.Tensor | None = None  #: int64 (batch, prompt_len) as the first forward saw it
    prompt_mask: torch.Tensor | None = None  #: bool (batch, prompt_len)
    readable: list[list[str]] | None = None  #: the prompt's tokens as people read them, per row (with a tokenizer)
    steps: list[Step] = field(default_factory=list)  #: empty with attach(keep_steps=False)
    sequences: torch.Tensor | None = None  #: generate's output ids, set when the call returned
    #: True once generate returned and the record holds its every step: False while it runs, where it raised, was
    #: not recorded (resuming a filled KV cache, which returns normally) or stopped being recorded (``error`` says
    #: why), or the probe detached mid-call; read from disk, as its end frame says (False without one)
    complete: bool = False
    request_id: str | None = None  #: the request this call served (X-Request-ID, the server's id, or a generated one)
    thread: str | None = None  #: the name of the thread that ran it
    error: str | None = None  #: why recording stopped early (the call itself ran on, unharmed)
    _context: list[list[str]] | None = field(default=None, init=False, repr=False)  # what link() hands out
    #: what else went wrong with its records, e.g. that the sink stopped and they are in memory only
    notes: list[str] = field(default_factory=list)

    prompt_template: torch.Tensor | None = None  #: bool (batch, prompt_len): True on the chat template's own tokens
    #: of the prompt (markers, system prompt; :mod:`nxl_hooks.method.chat`), which do not rank; None when unknown
    #: the tokenizer's special token ids (:func:`~nxl_hooks.method.select.special_ids`), which do not rank; None
    #: without a tokenizer (or in older files)
    special_ids: list[int] | None = None
    model: str | None = None  #: the model's name (its folder or hub id, else its class); None in older files
    #: the readable text of each fixed target id (``attach(target=...)``), recorded once with the prompt; None for the
    #: model's own prediction, without a tokenizer, or in older files. ``call.target_texts[348]`` -> '␣Paris'
    target_texts: dict[int, str] | None = None
    #: what its tokenizer's decode puts between tokens besides their readable texts (:func:`~.tokens.separator`): a
    #: space for a word-level tokenizer without a decoder or a WordPiece one, else "" (also in older files)
    separator: str = ""
    #: a WordPiece tokenizer's continuation prefix (``##``: such a token joins the one before it, its prefix left
    #: out) and whether its decoder cleans up each token's text (:func:`~.tokens.continuation`); "" and False for
    #: any other tokenizer (also in older files)
    continuation: str = ""
    cleanup: bool = False
    #: whether its tokenizer's decode cleans up the spaces before punctuation in the joined text
    #: (:func:`~.tokens.clean_up_spaces`); False in older files
    clean_up_spaces: bool = False
    #: when the call started and ended (returned, or stopped being recorded), in seconds since the epoch; both
    #: None in older files, ``ended`` None while it runs
    started: float | None = field(default_factory=_time.time)
    ended: float | None = None
    #: what its probe explains, as every call frame records it (``probe.describe()``): the model, its dtype and
    #: quantization, the head kind, methods and package versions; None without a probe's, as in a hand-made call
    meta: dict | None = None
    #: which of its request's choices the call generated, where the server says (vLLM; :class:`~.view.Choice`): a
    #: request with ``n`` > 1 or several prompts is several calls under one request id; None elsewhere and in older
    #: files
    choice: Choice | None = None

    def __repr__(self) -> str:
        """A summary, never the tensors: request, prompt size, steps, state and row 0's generated text (as its tokenizer
        decodes it, up to its end token: generate's padding after it left out, as :attr:`texts` leaves it out),
        control and format characters shown escaped (:func:`~nxl_hooks.records.tokens.printable`). ``print(call)``"""
        prompt = "?" if self.prompt_mask is None else f"{self.prompt_mask.shape[0]} x {self.prompt_mask.shape[1]}"
        prompt += " embeddings (no token ids or texts)" if self.prompt_embedded else " tokens"
        made = self.made(0)
        names = [step.token_name(0) for step in made[:40]]
        # joined as its tokenizer's decode joins them (a word-level one's words read 'w32w17' run together before)
        text = (plain_text(names, self.separator, self.continuation, self.cleanup, self.clean_up_spaces)
                if all(step.readable for step in made[:40]) else "".join(names))
        # its error shown escaped: a file's end frame may hold any text (an escape sequence, a bidi override)
        state = "complete" if self.complete else ("stopped: " + printable(self.error) if self.error else "running")
        return (f"<GenerationCall {self.index} request {self.request_id!r}"
                f"{self.choice.label() if self.choice else ''}: prompt {prompt}, "
                f"{len(self.steps)} step(s), {state}, layers {layers_text(self.layers)}"
                + (", chat template located" if self.prompt_template is not None else "")
                + f"; generated '{printable(text)}" + ("…" if len(made) > 40 else "") + "'>")

    @property
    def texts(self) -> list[str] | None:
        """The generated text of each row: its steps' tokens joined as its tokenizer's decode joins them
        (:attr:`separator`, :attr:`continuation`, :attr:`clean_up_spaces`; a row's padding after its end left out);
        None without readable texts (no tokenizer).
        ``call.texts[1]``"""
        if not self.steps or any(step.readable is None for step in self.steps):
            return None
        rows = range(len(self.steps[0].readable))
        return [plain_text([step.readable[row] for step in self.made(row)], self.separator, self.continuation,
                           self.cleanup, self.clean_up_spaces) for row in rows]

    def made(self, row: int) -> list[Step]:
        """The steps that made a token of ``row``: a row that ended (its end token) before the batch did is padded by
        generate until then, and those steps (``step.active`` False) explain a pad token it did not generate."""
        return [step for step in self.steps if bool(step.active[row])]

    @property
    def text(self) -> str | None:
        """The generated text of row 0 (:attr:`texts` for every row). ``probe.calls[-1].text``"""
        texts = self.texts
        return texts[0] if texts else None

    def context_ids(self, length: int) -> torch.Tensor | None:
        """int64 (batch, length): the token ids of a step's context (``length`` = ``step.position``): the prompt's,
        then each kept step's token, -1 where not known (the whole prompt where it came as embeddings:
        :attr:`prompt_embedded`); None when the prompt itself is not known."""
        prompt = self.prompt_ids if self.prompt_ids is not None else self.prompt_mask
        if prompt is None:
            return None
        ids = torch.full((prompt.shape[0], length), -1, dtype=torch.long)
        if self.prompt_ids is not None:
            ids[:, : self.prompt_ids.shape[1]] = self.prompt_ids[:, :length]
        for step in self.steps:  # in order of position
            if step.position >= length:
                break
            ids[:, step.position] = step.token
        return ids

    @property
    def prompt_embedded(self) -> bool:
        """Whether the prompt ran as embeddings (``generate(inputs_embeds=...)``): the record holds no token ids and no
        texts of it (its positions read ``@N``), and ``sequences``, generate's output, then holds only the new tokens
        (unless ``input_ids`` came beside the embeddings: they begin it). Its notes say so too."""
        return self.prompt_mask is not None and self.prompt_ids is None

    def attribution(self, step: Step) -> Attribution:
        """``step`` as an :class:`Attribution` that knows its context's special and chat-template tokens, so that
        ``top()`` ranks what every output of the library ranks (:func:`~nxl_hooks.method.select.rankable`).
        ``call.attribution(call.steps[-1]).top(3)``"""
        linked = step._linked()
        # another call's step would rank by this call's prompt: its special and template tokens at other positions
        # (a shallow copy of a call shares the original's steps, linked to the original)
        if linked is not None and linked is not self and not any(own is step for own in self.steps):
            raise ValueError("this step is another call's, whose prompt is its context: rank it with that call's "
                             "attribution(step), or step.to_attribution()")
        return step.to_attribution(special=self.context_special(step.position),
                                   template=self.context_template(step.position))

    def context_special(self, length: int) -> torch.Tensor | None:
        """bool (batch, length): the special-token flags of a step's context (``length`` = ``step.position``); None
        when the prompt's ids are not known. ``step.to_attribution(special=call.context_special(n))``"""
        ids = self.context_ids(length)
        return None if ids is None else special_flags(ids, self.special_ids)

    def norm_spread(self, row: int = 0) -> float:
        """The one coefficient of variation of the embedding norms every view of this call prints (terminal, HTML):
        over the tokens that rank in its first step's context, the prompt's (:meth:`Attribution.norm_spread`); NaN
        without steps. ``flat_norms(call.norm_spread())``"""
        return self.attribution(self.steps[0]).norm_spread(row) if self.steps else float("nan")

    def context_template(self, length: int) -> torch.Tensor | None:
        """bool (batch, length): the chat-template flags of a step's context (``length`` = ``step.position``): the
        prompt's, then False on every generated token. ``step.to_attribution(template=call.context_template(n))``"""
        if self.prompt_template is None:
            return None
        flags = self.prompt_template.bool()[:, :length]
        return torch.cat([flags, flags.new_zeros(flags.shape[0], length - flags.shape[1])], 1)

    def __setstate__(self, state: dict) -> None:
        """Unpickled: its steps, which come without their link (:meth:`Step.__getstate__`), ranked as its own again;
        a step still linked (a shallow ``copy.copy`` shares the original's steps) stays its call's."""
        self.__dict__.update(state)
        for step in self.steps:
            if step._linked() is None:
                self.claim(step)

    def claim(self, step: Step) -> None:
        """Make ``step`` this call's before :meth:`link` gives it its texts (in another thread, later): an
        ``on_step`` callback's ``step.to_attribution()`` leaves out the call's special and template tokens."""
        step._call = weakref.ref(self)

    def link(self, step: Step) -> None:
        """Give ``step`` the readable texts of its context (the prompt's, then each earlier step's token; ``@N``
        where a step was not seen, a rotated file deleted it, or the prompt came as embeddings) and add its own
        token's: ``step.to_attribution().top(3)`` then names tokens by their text. Called once per step, in order,
        by the probe's hub and by :func:`~nxl_hooks.records.reader.read_stream`."""
        self.claim(step)
        # a prompt given as embeddings has no texts: its positions read @N, its steps' tokens their own texts
        prompt = [[]] * len(step.readable) if self.prompt_embedded and step.readable is not None else self.readable
        if prompt is None or step.readable is None or len(step.readable) != len(prompt):
            return
        if self._context is None:
            self._context = [list(row) for row in prompt]
        for row, text in zip(self._context, step.readable):
            row.extend(map(unseen, range(len(row), step.position)))
            del row[step.position:]
            row.append(text)
        step.context = self._context
