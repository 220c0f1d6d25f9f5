"""The live readers of ``nxl run`` (``nxl tail``, ``/v1/stream``) cost nothing while none is connected: a watched
model's probe has a subscription only while a reader is there (a subscription makes every record as its token is,
where a probe read by nobody live scores a call's steps together); a reader that connects gets the steps made from
then on, and once the last one leaves, the probe has no subscriber again."""

from __future__ import annotations

import torch

import tiny
from nxl_hooks.apps.serve.controller import Controller
from nxl_hooks.apps.serve.settings import Settings


def _generate(model) -> None:
    ids = torch.randint(1, tiny.GEN_VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)


def test_the_live_feed_runs_only_while_a_reader_is_connected(tmp_path):
    controller = Controller(Settings(run_dir=tmp_path / "run"))
    model = tiny.generating_llama()
    try:
        controller.adopt(model, "tiny")
        (watch,) = controller.watches()
        probe = watch.probe
        assert probe is not None and watch.live is None and not probe._hub.live  # attached, read by nobody live
        _generate(model)
        reader = controller.subscribe()
        assert probe._hub.live  # the first reader: the probe's steps are read as they are made
        _generate(model)
        got = [reader.get(timeout=10) for _ in range(3)]
        assert all(item is not None for item in got) and [item.step.step for item in got] == [0, 1, 2]
        assert reader.get(timeout=0.2) is None  # only the steps made after it connected
        controller.unsubscribe(reader)
        assert watch.live is None and not probe._hub.live  # the last one left
        assert len(probe.calls) == 2 and all(len(call.steps) == 3 for call in probe.calls)  # kept all the same
    finally:
        controller.close()
