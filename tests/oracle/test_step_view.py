"""The live view is one typed subscriber: a generated token reaches the endpoint's server-sent events, ``nxl tail``
and the generation HTML page as one step view (``StepView``), whose ranking is the oracle's; the live subscription
is bounded, drops its oldest records (counted) and never holds up the generation."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import threading

import pytest
import tiny as tiny_models
import torch
from oracle import llama, normxlogit, prefix_logits
from transformers import AutoModelForCausalLM

import nxl_hooks as nxl
from nxl_hooks.apps.commands import tail
from nxl_hooks.apps.serve.client import endpoints
from nxl_hooks.apps.serve.controller import Controller
from nxl_hooks.apps.serve.settings import Settings
from nxl_hooks.hooks.generate import REQUEST_ID
from nxl_hooks.hooks.subscription import Subscription
from nxl_hooks.records.html import generation_html
from nxl_hooks.records.tokens import readable, visible
from nxl_hooks.records.view import Ranked, StepView

K = 3


def _html_views(page: str) -> list[StepView]:
    """The step views a generation page carries in its data block, one per row."""
    block = re.search(r'<script type="application/json" id="nxl-data">(.*?)</script>', page, re.S).group(1)
    return [StepView.from_json(step) for step in json.loads(block)["steps"]]


def _tail_entries(line: str) -> list[tuple[int, str, str]]:
    """(position, text, score as printed) of a tail line's ranked context tokens."""
    return [(int(p), text, score) for p, text, score in re.findall(r"(\d+):'(.*?)' (\S+)", line.split("  L", 1)[1])]


def test_the_endpoint_tail_and_the_html_read_one_step_view_ranked_as_the_oracle(tmp_path):
    path = tiny_models.save_model(tmp_path / "lm", "llama")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = tiny_models.tokenizer()
    run = tmp_path / "run"
    controller = Controller(Settings(run_dir=run))
    controller.adopt(model, str(path))
    try:
        (endpoint,) = endpoints(str(run))
        opened, events = threading.Event(), []

        def listen() -> None:
            for event, data in endpoint.events(f"/v1/stream?k={K}&request_id=view-1", timeout=60,
                                               on_open=opened.set):
                events.append((event, data))
                if event == "end":
                    return

        reader = threading.Thread(target=listen, daemon=True)
        reader.start()
        assert opened.wait(30)
        ids = torch.tensor([tokenizer(" the film was good and the plot", add_special_tokens=False)["input_ids"]])
        token = REQUEST_ID.set("view-1")
        try:
            with torch.no_grad():
                model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
        finally:
            REQUEST_ID.reset(token)
        reader.join(60)
        call = controller.watches()[0].probe.calls[-1]
    finally:
        controller.close()

    steps = [data for event, data in events if event == "step"]
    assert [event for event, _ in events] == ["step"] * 4 + ["end"] and len(call.steps) == 4
    sse = [StepView.from_json(data) for data in steps]
    html = _html_views(generation_html(call, k=K))
    sequence = call.sequences
    hand, special = llama(reference), set(tokenizer.all_special_ids)
    for data, live, page, step in zip(steps, sse, html, call.steps):
        # the endpoint's JSON is the view's own, with the NormXLogit ranking under "top" for older readers too, and
        # when its call started (which tells apart the calls of a request id used again)
        assert data.pop("call_started") == call.started
        assert data == live.to_json() and data["top"] == data["scores"]["normxlogit"]
        assert (live.request_id, live.model, live.step, live.token_id) == ("view-1", str(path), step.step,
                                                                          int(step.token[0]))
        # the HTML page carries the very same view for the row (it knows no model name)
        assert dataclasses.replace(page, model=live.model) == live
        # nxl tail prints that view: its token, and the ranked context tokens of the layer asked for
        layer, ranked = live.ranked(1)
        shown = tail.line(live, 1, 500)
        assert shown.split()[:4] == ["view-1", str(live.step), f"@{live.position}", f"'{live.token}'"]
        assert f"  L{layer}: " in shown and layer == 1
        assert _tail_entries(shown) == [(e.position, e.text, f"{e.score:.3g}") for e in ranked]
        # and the ranking is the oracle's: NormXLogit of the uncached prefix, best first
        position = live.position
        logits, embeddings = prefix_logits(reference, hand, sequence[:, :position],
                                           torch.ones(1, position, dtype=torch.bool))
        _, expected = normxlogit(logits, embeddings, torch.tensor([live.token_id]))
        eligible = [i for i in range(position) if i != position - 1 and int(sequence[0, i]) not in special]
        live_names = [visible(tokenizer.decode([int(i)])) for i in sequence[0, :position]]
        for layer, entries in live.scores["normxlogit"].items():
            scores = expected[layer, 0].detach()
            shown_scores = torch.tensor([e.score for e in entries])
            # each entry's score is the oracle's at its position, and they are the oracle's K best, best first
            # (a token the context holds twice may tie with itself at layer 0: compared by value)
            torch.testing.assert_close(shown_scores, scores[[e.position for e in entries]], rtol=1e-4, atol=1e-5)
            best = sorted((float(scores[i]) for i in eligible), reverse=True)[:K]
            torch.testing.assert_close(shown_scores, torch.tensor(best), rtol=1e-4, atol=1e-5)
            assert all(e.position in eligible and e.text == live_names[e.position] for e in entries)
        probability = torch.softmax(logits[-1, 0, position - 1].detach().float(), -1)[live.token_id]
        assert live.probability == pytest.approx(float(probability), rel=1e-4, abs=1e-6)


def test_a_step_view_reads_an_older_endpoints_json_and_refuses_what_is_not_one():
    old = {"step": 2, "position": 9, "token_id": 7, "token": "␣film", "probability": 0.5, "active": True,
           "top": {"0": [[3, "␣the", 0.25], [1, "a", None]]}, "request_id": "r", "model": "m"}
    view = StepView.from_json(old)
    assert view.ranked() == (0, (Ranked(3, "␣the", 0.25), Ranked(1, "a", None)))
    assert StepView.from_json(view.to_json()) == view
    with pytest.raises(ValueError, match="not a step view"):
        StepView.from_json({"step": 1})
    with pytest.raises(ValueError, match="method 'logat' is not in this step view: it has normxlogit"):
        view.ranked(method="logat")


def test_a_subscription_is_bounded_drops_its_oldest_counted_and_says_so_once(caplog):
    feed: Subscription[int] = Subscription(size=2)
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"):
        for item in range(5):
            feed.put(item)  # never waits, though nobody reads
    feed.end()
    assert list(feed) == [3, 4] and feed.dropped == 3
    assert len([r for r in caplog.records if "fell 2 records behind" in r.getMessage()]) == 1
    assert feed.get(timeout=0) is None  # ended and drained: never blocks


def _generating() -> tuple[torch.nn.Module, torch.Tensor]:
    return tiny_models.generating_llama(), torch.tensor([[1, 5, 7, 9]])


def test_an_unread_subscription_never_holds_up_generation_and_keeps_the_newest_steps():
    model, ids = _generating()
    with nxl.attach(model, layers=[0, 2]) as probe:
        steps = probe.subscribe(follow=True, size=2)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=6, do_sample=False)
        assert steps.dropped == 4 and steps.size == 2
        steps.close()
        kept = list(steps)
        assert [s.step for s in kept] == [4, 5]  # the newest: the oldest were dropped
        assert [s.step for s in probe.steps] == list(range(6))  # every record is still kept
    assert [int(s.token[0]) for s in probe.steps] == out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("keep_steps, kept", [(True, "probe.calls keeps them"), (False, "nothing else keeps them")])
def test_a_subscription_that_drops_records_says_only_where_they_are_still_kept(caplog, tmp_path, keep_steps, kept):
    """Its line said the sink and probe.calls keep every record, also where neither did: the records it dropped
    were gone for good."""
    model, ids = _generating()
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"), nxl.attach(model, keep_steps=keep_steps) as probe:
        steps = probe.subscribe(follow=True, size=2)
        with torch.no_grad():
            model.generate(ids, max_new_tokens=4, do_sample=False)
        steps.close()
    assert steps.dropped == 2 and len(probe.steps) == (4 if keep_steps else 0)
    assert [r.getMessage() for r in caplog.records if r.name == "nxl_hooks"] == [
        "nxl_hooks: a live reader fell 2 records behind; its oldest records are dropped (counted in its "
        f"subscription's dropped); {kept}"]
    with caplog.at_level(logging.WARNING, logger="nxl_hooks"), nxl.attach(model, sink=tmp_path / "r.nxl") as probe:
        steps = probe.subscribe(follow=True, size=2)
        with torch.no_grad():
            model.generate(ids, max_new_tokens=4, do_sample=False)
        steps.close()
    assert caplog.records[-1].getMessage().endswith("dropped); probe.calls and the sink keep them")


def test_probe_stream_is_deprecated_and_still_holds_every_step():
    model, ids = _generating()
    with nxl.attach(model, layers=[0]) as probe:
        with pytest.warns(DeprecationWarning, match="probe.subscribe"):
            steps = probe.stream(follow=True)
        with torch.no_grad():
            model.generate(ids, max_new_tokens=5, do_sample=False)
        steps.close()
        assert steps.size is None and [s.step for s in steps] == list(range(5)) and steps.dropped == 0


def test_tail_reports_steps_the_live_feed_dropped():
    assert tail.faults({"live_dropped": 7}) == ["7 step(s) not handed to live readers: the live feed fell behind "
                                                "(the records keep them)"]


def _strict_json(text: str) -> dict:
    """``text`` parsed as browsers and JSON clients do: NaN and Infinity are no JSON."""
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_nan_and_infinite_scores_are_null_in_the_step_view_and_the_page():
    """A NaN or ±inf score reaches readers as null: json.dumps wrote NaN / Infinity, which the endpoint's clients and
    the page's JSON.parse refuse (the page's layer picker then never worked)."""
    model, ids = _generating()
    with nxl.attach(model, layers=[0, 2]) as probe:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=2, do_sample=False)
    call = probe.calls[-1]
    step = call.steps[1]  # context: positions 0..4, of which 0..3 rank (4 is where the token is predicted)
    scores = step.scores["normxlogit"].clone()
    scores[1, 0, 0], scores[1, 0, 1], scores[0, 0, 2] = float("inf"), float("-inf"), float("nan")
    step.scores["normxlogit"] = scores
    view = _strict_json(json.dumps(step.view(call, k=5).to_json()))["scores"]["normxlogit"]
    by_layer = {layer: {position: score for position, _, score in ranked} for layer, ranked in view.items()}
    assert by_layer["2"][0] is None and by_layer["2"][1] is None and by_layer["0"][2] is None
    assert by_layer["2"][3] == pytest.approx(float(scores[1, 0, 3]))  # the finite scores as they were
    assert by_layer["0"][0] == pytest.approx(float(scores[0, 0, 0]))
    page = generation_html(call, k=5)
    data = _strict_json(re.search(r'<script type="application/json" id="nxl-data">(.*?)</script>', page, re.S)[1])
    layer_2, layer_0 = data["values"][1][1], data["values"][1][0]  # row of step 1; layers [0, 2]
    assert layer_2[:2] == [None, None] and layer_0[2] is None
    assert layer_2[3] == pytest.approx(float(scores[1, 0, 3]), rel=1e-5)
    assert {p: score for p, _, score in data["steps"][1]["scores"]["normxlogit"]["2"]} == by_layer["2"]


class _Watched:
    """A watched model as the endpoint's readout reads it: its tokens named by ``tokenizer``."""

    name = slug = "tiny"

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.texts = tokenizer, self

    def text(self, token_id: int) -> str:
        return readable(self.tokenizer, token_id)

    def special(self, ids: list[int]) -> list[bool]:
        return [i in self.tokenizer.all_special_ids for i in ids]


def test_a_fixed_target_is_named_beside_the_token_each_with_its_own_probability():
    """With attach(target=...) the scores explain the target, not the emitted token: the view said the token with
    the target's probability and never named the target (the endpoint, nxl tail and the page all read it)."""
    from nxl_hooks.apps.serve.readout import step_view

    model, tokenizer = tiny_models.build_model("llama"), tiny_models.tokenizer()
    ids = tokenizer("the film was", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        own = model(ids).logits[0, -1].softmax(-1)  # the first step's distribution, by hand
    token = int(own.argmax())
    film, good = tokenizer.convert_tokens_to_ids(["film", "good"])
    assert token not in (film, good)

    def first_step(target: list[int]) -> tuple[nxl.GenerationCall, nxl.Step]:
        with torch.no_grad(), nxl.attach(model, layers="all", tokenizer=tokenizer, target=target) as probe:
            model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
        return probe.calls[-1], probe.calls[-1].steps[0]

    call, step = first_step([film, token])  # the token is one of the explained ids: its probability is known
    view = step.view(call, label=0)
    assert (view.token_id, view.token, view.target_id, view.target) == (token, readable(tokenizer, token), film, "film")
    assert view.probability == pytest.approx(float(own[token]), rel=1e-4)
    assert view.target_probability == pytest.approx(float(own[film]), rel=1e-4)
    assert StepView.from_json(json.loads(json.dumps(view.to_json()))) == view
    assert f"'{view.token}'→'film'" in tail.line(view, None, 500)
    assert f"0: {view.token} · p {float(own[token]):.3g} · explains film (p {float(own[film]):.3g})" in (
        generation_html(call))
    itself = step.view(call, label=1)  # label 1 explains the token: no target named
    assert (itself.target_id, itself.target, itself.target_probability) == (None, None, None)
    assert itself.probability == pytest.approx(float(own[token]), rel=1e-4)

    call, step = first_step([good])  # not in the context (named by its recorded text); the token's probability unknown
    view = step.view(call)
    assert (view.probability, view.target_id, view.target) == (None, good, "good")  # the text the call recorded
    assert view.target_probability == pytest.approx(float(own[good]), rel=1e-4)

    live = step_view(_Watched(tokenizer), call, step)  # the endpoint names the target by the model's tokenizer
    assert (live.target_id, live.target, live.probability) == (good, "good", None)


def test_a_call_view_names_each_position_by_its_own_token_when_its_first_steps_are_gone():
    """A call whose first steps are not kept (a sink whose first rotated file was deleted): the endpoint's readout
    put the kept steps' tokens right after the prompt, so generated positions were named by other tokens."""
    from nxl_hooks.apps.serve.readout import call_view

    model, tokenizer = tiny_models.build_model("llama"), tiny_models.tokenizer()
    ids = tokenizer("the film was", return_tensors="pt")["input_ids"]
    with torch.no_grad(), nxl.attach(model, layers="all", tokenizer=tokenizer) as probe:
        sequence = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)[0].tolist()
    call = probe.calls[-1]
    call.steps = call.steps[2:]  # kept: the tokens at positions prompt + 2 ..
    known = set(range(ids.shape[1])) | {step.position for step in call.steps}
    last = call_view(_Watched(tokenizer), call, k=20)["steps"][-1]
    named = {position: text for ranked in last["scores"]["normxlogit"].values() for position, text, _ in ranked}
    # what ranks: every context token but the special ones and the prediction position (the last step's - 1)
    assert set(named) == {p for p in range(len(sequence) - 2) if sequence[p] not in tokenizer.all_special_ids}
    assert {p for p in named if p >= ids.shape[1]} >= {ids.shape[1], ids.shape[1] + 1}  # the steps not kept too
    for position, text in named.items():
        assert text == (readable(tokenizer, sequence[position]) if position in known else f"@{position}")


def test_a_negative_layer_counts_from_the_last_recorded_and_an_unknown_one_is_refused():
    """``nxl tail --layer -2`` showed the last layer, as did a layer the program does not record."""
    import argparse
    import queue

    from nxl_hooks.apps.options import CliError

    ranked = {layer: (Ranked(layer, "x", float(layer)),) for layer in (0, 2, 3)}  # each layer tells itself apart
    view = StepView(step=0, position=4, token_id=1, token="a", probability=None, active=True,
                    scores={"normxlogit": ranked})
    assert [view.ranked(layer)[0] for layer in (None, -1, -2, -3, 0, 2)] == [3, 3, 2, 0, 0, 2]
    assert view.ranked(-2)[1] == ranked[2]
    for layer in (1, 4, -4):
        with pytest.raises(ValueError, match=rf"layer {layer} was not recorded: this step view has layers 0, 2, 3 "
                                             r"\(or -3..-1, counted from the last\)"):
            view.ranked(layer)
    assert "  L2: 2:'x' 2" in tail.line(view, -2, 200)
    args = argparse.Namespace(layer=1, method="normxlogit", request_id=None, last=None, count=None)
    with pytest.raises(CliError, match="--layer 1: layer 1 was not recorded"):  # the command: one line, exit 2
        tail._show(queue.Queue(), args, 0, [tail.Shown(view)])
