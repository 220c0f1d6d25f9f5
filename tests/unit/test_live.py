"""The live readers of ``nxl run`` (``nxl tail``, ``/v1/stream``) cost nothing while none is connected: a watched
model's probe has a subscription only while a reader is there (a subscription makes every record as its token is,
where a probe read by nobody live scores a call's steps together); a reader that connects gets the steps made from
then on, and once the last one leaves, the probe has no subscriber again."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

import torch

import tiny
from nxl_hooks.apps.commands import tail
from nxl_hooks.apps.serve import endpoint
from nxl_hooks.apps.serve.client import Endpoint
from nxl_hooks.apps.serve.controller import Controller
from nxl_hooks.apps.serve.runs import socket_path
from nxl_hooks.apps.serve.settings import Settings
from nxl_hooks.hooks.generate import REQUEST_ID
from nxl_hooks.records.view import StepView


def _generate(model, new: int = 3) -> None:
    ids = torch.randint(1, tiny.GEN_VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                   do_sample=False)


@contextlib.contextmanager
def _recorded(tmp_path) -> Iterator[tuple[Controller, torch.nn.Module]]:
    """A controller (run folder ``tmp_path/run``) that records the tiny generating Llama, as under nxl run, closed
    on the way out: ``with _recorded(tmp_path) as (controller, model):``."""
    controller = Controller(Settings(run_dir=tmp_path / "run"))
    model = tiny.generating_llama()
    try:
        controller.adopt(model, "tiny")
        yield controller, model
    finally:
        controller.close()


def test_the_live_feed_runs_only_while_a_reader_is_connected(tmp_path):
    with _recorded(tmp_path) as (controller, model):
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


def test_the_stream_sends_every_step_of_a_call_that_took_the_id_of_one_gone(tmp_path, monkeypatch):
    """/v1/stream under --keep-calls 1: a call that left memory frees its id() for the next call, which the stream
    took for the same call and skipped the steps it had "sent" (CI: a request lost its first 2 steps, those of the
    warm-up call before it). The reuse of an address is up to the allocator: id() here answers the same for every
    object, as a reused one does, so the test does not depend on it."""
    monkeypatch.setattr(endpoint, "id", lambda _: 0, raising=False)
    controller = Controller(Settings(run_dir=tmp_path / "run", keep_calls=1))
    model = tiny.generating_llama()
    try:
        controller.adopt(model, "tiny")
        assert controller.endpoint is not None
        live = Endpoint(socket_path=socket_path(tmp_path / "run", os.getpid()))
        opened, steps = threading.Event(), []

        def read() -> None:
            for event, data in live.events("/v1/stream?k=1", timeout=60, on_open=opened.set):
                steps.append((event, data["step"]))
                if len(steps) == 2 + 3 + 4:
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert opened.wait(60)
        for new in (2, 3, 4):
            _generate(model, new)
        reader.join(timeout=60)
        assert steps == [("step", n) for new in (2, 3, 4) for n in range(new)]
    finally:
        controller.close()


def _stream_with_step_2_held(tmp_path, monkeypatch, request_id: str, run, *, released_before_the_end: bool) -> list:
    """(event, step or steps) a ``/v1/stream?request_id=`` reader got while ``run(model)`` ran under that id, the
    live feed's thread held on the first step 2 it hands out: until ``run`` returned (``released_before_the_end``),
    else until the stream ended."""
    controller = Controller(Settings(run_dir=tmp_path / "run"))
    model = tiny.generating_llama()
    release = threading.Event()
    try:
        controller.adopt(model, "tiny")
        publish = controller.live.publish

        def held(watch, call, step):
            if step.step == 2:
                release.wait(60)
            publish(watch, call, step)

        monkeypatch.setattr(controller.live, "publish", held)
        live = Endpoint(socket_path=socket_path(tmp_path / "run", os.getpid()))
        opened, events = threading.Event(), []

        def read() -> None:
            for event, data in live.events(f"/v1/stream?request_id={request_id}&k=1", timeout=60,
                                           on_open=opened.set):
                events.append((event, data["step"] if event == "step" else data.get("steps")))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert opened.wait(60)
        token = REQUEST_ID.set(request_id)
        try:
            run(model)
        finally:
            REQUEST_ID.reset(token)
        if released_before_the_end:
            release.set()
        reader.join(timeout=60)
        assert not reader.is_alive()
        return events
    finally:
        release.set()
        controller.close()


def test_a_request_stream_sends_every_step_before_its_end(tmp_path, monkeypatch):
    """/v1/stream?request_id=: the call ends (in the publisher) once its steps are kept, while its last step may still
    be on its way through the live feed's thread: the stream ended without it (`end` said 3 steps after 2 were sent).
    Here the feed's thread is held on the last step until the stream has ended."""
    events = _stream_with_step_2_held(tmp_path, monkeypatch, "held", lambda model: _generate(model, 3),
                                      released_before_the_end=False)
    assert events == [("step", 0), ("step", 1), ("step", 2), ("end", 3)]


def test_a_request_stream_follows_one_call_of_its_id(tmp_path, monkeypatch):
    """Two calls under one request id: a reader by the id got both calls' steps merged (0, 1, 2, 0, 1, 2, 3), with no
    way to tell them apart, and an `end` counting the first. It follows one call (here the first, the next to start
    when it connected) and ends with it. The feed is held on the first call's last step while the second runs, so
    the second's steps reach the reader before the first call's stream can end."""

    def two_calls(model) -> None:
        _generate(model, 3)
        _generate(model, 4)  # while the first call's last step is held in the feed

    events = _stream_with_step_2_held(tmp_path, monkeypatch, "dup", two_calls, released_before_the_end=True)
    assert events == [("step", 0), ("step", 1), ("step", 2), ("end", 3)]


def test_a_request_that_scores_then_generates_is_found_by_its_generation_call(tmp_path):
    """A request id that served a plain forward (scoring the prompt), then a generate call: the forward was listed
    after the call (records were calls, then forwards) and found for the id, so /frames said "was a forward" and a
    stream by the id waited forever. Records are in the order they started; the stream and /frames take the
    generation call; a stream whose id served only a forward so far waits for its generation call (a classifier's
    request, which never generates, ends at once)."""
    with _recorded(tmp_path) as (controller, model):
        live = Endpoint(socket_path=socket_path(tmp_path / "run", os.getpid()))
        ids = torch.randint(1, tiny.GEN_VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
        token = REQUEST_ID.set("mix")
        try:
            with torch.no_grad():
                model(input_ids=ids)
            scored = REQUEST_ID.set("scored")
            with torch.no_grad():
                model(input_ids=ids)
            REQUEST_ID.reset(scored)
            _generate(model, 3)
        finally:
            REQUEST_ID.reset(token)
        requests = live.json("GET", "/v1/requests")["requests"]
        listed = [(each["request_id"], each["kind"]) for each in requests]
        assert listed == [("mix", "forward"), ("scored", "forward"), ("mix", "generate")]  # oldest first
        assert tail.end_line(requests[1]) == "scored: a plain forward of tiny, which generates no tokens"
        assert live.get("GET", "/v1/requests/mix/frames")[0] == 200
        assert live.json("GET", "/v1/requests/mix?k=1")["kind"] == "generate"

        def stream(request_id: str, then=None) -> list:
            events, opened = [], threading.Event()

            def read() -> None:
                for event, data in live.events(f"/v1/stream?request_id={request_id}&k=1", timeout=60,
                                               on_open=opened.set):
                    events.append((event, data.get("step", data.get("kind"))))

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            assert opened.wait(60)
            if then is not None:
                then()
            reader.join(timeout=60)  # (it waited for a step that never comes)
            return events

        assert stream("mix") == [("step", 0), ("step", 1), ("step", 2), ("end", "generate")]

        def generate_scored() -> None:
            again = REQUEST_ID.set("scored")
            try:
                _generate(model, 2)
            finally:
                REQUEST_ID.reset(again)

        # a causal LM's request may generate after scoring its prompt: a reader that came between waits for it
        assert stream("scored", then=generate_scored) == [("step", 0), ("step", 1), ("end", "generate")]
        classifier = tiny.build_model("bert")
        controller.adopt(classifier, "bert")
        judged = REQUEST_ID.set("judged")
        try:
            with torch.no_grad():
                classifier(input_ids=ids % classifier.config.vocab_size)
        finally:
            REQUEST_ID.reset(judged)
        assert stream("judged") == [("end", "forward")]  # a classifier's request never generates: said, not awaited


def test_tail_last_shows_every_step_of_a_later_request_that_uses_the_id_again(tmp_path, capsys):
    """nxl tail --last 1 hid the steps a later request using the same id had in common (by step number) with the
    request --last showed: it told steps apart by request id, not by call."""
    import argparse
    import queue

    with _recorded(tmp_path) as (controller, model):
        live = Endpoint(socket_path=socket_path(tmp_path / "run", os.getpid()))
        token = REQUEST_ID.set("dup")
        try:
            _generate(model, 2)
            past = tail.last_requests([live], 1, 1)  # its 2 steps, then its end
            opened, items = threading.Event(), queue.Queue()

            def read() -> None:  # what nxl tail's follower hands on: the stream's steps as it reads them
                for event, data in live.events("/v1/stream?k=1", timeout=60, on_open=opened.set):
                    items.put(tail.Shown(StepView.from_json(data), (data.get("model"), data.get("call_started"))))
                    if items.qsize() == 3:
                        return

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            assert opened.wait(60)
            _generate(model, 3)
        finally:
            REQUEST_ID.reset(token)
        reader.join(timeout=60)
        items.put(tail.Closed())
        args = argparse.Namespace(layer=None, method="normxlogit", request_id=None, last=1, count=None)
        assert tail._show(items, args, 1, past) == 1  # (the stream closed)
        steps = [line.split()[1] for line in capsys.readouterr().out.splitlines() if not line.endswith("tokens")]
        assert steps == ["0", "1", "0", "1", "2"]


def test_tail_last_shows_each_listed_call_of_an_id_not_its_newest_record(tmp_path):
    """nxl tail --last N read each listed request back by its id alone, which gave the id's newest record: two
    calls under one id showed the later one twice (the earlier one's steps never), and a plain forward run after a
    generate under its id (scoring the output) made tail fail with "error: 'steps'". Each is read by its start."""
    with _recorded(tmp_path) as (controller, model):
        live = Endpoint(socket_path=socket_path(tmp_path / "run", os.getpid()))
        token = REQUEST_ID.set("dup")
        try:
            _generate(model, 2)
            _generate(model, 4)
            with torch.no_grad():  # the output scored under the same id: a plain forward, newest of the three
                model(input_ids=torch.ones(1, 6, dtype=torch.long))
        finally:
            REQUEST_ID.reset(token)
        listed = live.json("GET", "/v1/requests")["requests"]
        assert [(each["kind"], each.get("steps")) for each in listed] == [("generate", 2), ("generate", 4),
                                                                          ("forward", None)]
        past = tail.last_requests([live], 2, 1)
        shown = [(type(item).__name__, item.view.step if isinstance(item, tail.Shown) else item.summary["steps"])
                 for item in past]
        assert shown == [("Shown", 0), ("Shown", 1), ("Ended", 2), *[("Shown", n) for n in range(4)], ("Ended", 4)]
        assert [item.call[1] for item in past if isinstance(item, tail.Shown)] == [listed[0]["started"]] * 2 + [
            listed[1]["started"]] * 4
        status, body = live.get("GET", "/v1/requests/dup?started=soon")
        assert status == 400 and "give the request's started time as /v1/requests lists it" in body.decode()

        class Older:  # an endpoint of an nxl_hooks before ?started=: the id's newest record whatever is asked
            name = "older"

            def json(self, method: str, path: str) -> dict:
                return live.json(method, path.replace(f"&started={listed[0]['started']!r}", "").replace(
                    f"&started={listed[1]['started']!r}", ""))

        past = tail.last_requests([Older()], 2, 1)
        assert [type(item).__name__ for item in past] == ["Fault", "Fault"]
        assert "request dup (started " in past[0].text and "answered with another record of that id" in past[0].text


def _tail_on_a_stalled_stdout(monkeypatch, closing: list) -> tuple[list, list]:
    """nxl tail (a queue of 4) on a terminal that takes no line while its one endpoint sends steps 0 to 9, then the
    ``closing`` events: what tail.run returned, and the lines printed once the terminal takes them again."""
    import argparse

    from nxl_hooks.apps.serve import client

    bound, sent, stalled, release, printed = 4, threading.Event(), threading.Event(), threading.Event(), []

    def step(n: int) -> dict:
        return StepView(step=n, position=5 + n, token_id=7, token="a", probability=0.5, active=True,
                        scores={"normxlogit": {1: ()}}, request_id="r").to_json()

    class Stream:  # an endpoint that sends 10 steps, then the closing events
        name = "run"

        def events(self, path, timeout=None, on_open=None, on_connect=None):
            on_open()
            yield "step", step(0)
            assert stalled.wait(60)  # the printer holds step 0 in a print that does not return
            for n in range(1, 10):
                yield "step", step(n)
            sent.set()
            yield from closing

        def status(self, timeout=None):
            return {"pid": 1, "models": []}

    def stalled_print(*args, **kwargs):  # stdout that takes no line until released
        stalled.set()
        assert release.wait(60)
        printed.append(" ".join(map(str, args)))

    monkeypatch.setattr(client, "endpoints", lambda run, token_file: [Stream()])
    monkeypatch.setattr(tail, "LIVE_QUEUE", bound, raising=False)
    monkeypatch.setattr(tail, "print", stalled_print, raising=False)
    args = argparse.Namespace(run=None, token_file=None, request_id=None, k=1, last=None, layer=None,
                              method="normxlogit", count=None)
    done = []
    runner = threading.Thread(target=lambda: done.append(tail.run(args)), daemon=True)
    runner.start()
    assert sent.wait(60)  # steps 1-9 were handed on while step 0's line was stuck
    release.set()
    runner.join(60)
    return done, printed


def test_tail_on_a_stalled_stdout_holds_a_bounded_queue_and_says_how_many_steps_it_dropped(monkeypatch, capsys):
    """A terminal that stops taking lines: nxl tail queued every step the endpoint sent (without bound, while the
    endpoint saw a reader keeping up). At most the bound waits; the steps past it are not shown, and one line says
    how many, summed with those the endpoint itself dropped, before the request's end."""
    done, printed = _tail_on_a_stalled_stdout(
        monkeypatch, [("dropped", {"dropped": 2}), ("end", {"request_id": "r", "steps": 12})])
    assert done == [0]
    steps = [int(line.split()[1]) for line in printed if line.startswith("r ")]
    assert steps == [0, 1, 2, 3, 4]  # step 0 (being printed) and the bound's 4; 5 to 9 dropped
    assert printed[len(steps)] == "! run: 7 step(s) not shown: nxl tail fell behind (the run's records keep them)"
    assert printed[len(steps) + 1:] == ["r: ended after 12 tokens"]
    capsys.readouterr()


def test_tail_says_the_steps_it_dropped_when_the_stream_closes_without_an_end(monkeypatch, capsys):
    """The program exits while nxl tail's stalled stdout has dropped steps: the stream closes with no end event, and
    the line saying how many were not shown was lost with it."""
    done, printed = _tail_on_a_stalled_stdout(monkeypatch, [])
    steps = [int(line.split()[1]) for line in printed if line.startswith("r ")]
    assert steps == [0, 1, 2, 3, 4]
    assert printed[len(steps):] == ["! run: 5 step(s) not shown: nxl tail fell behind (the run's records keep them)"]
    assert done == [1]  # the stream ended before its request did
    capsys.readouterr()


def test_tail_leaves_no_thread_reading_or_polling_the_program_once_it_returns(monkeypatch, capsys):
    """``nxl tail --count 1`` on a program that goes on generating: once ``tail.run`` returns, its follower stops
    reading the stream and its fault watcher stops asking for the program's status (the watcher polled the status
    flat out from then on, as long as the program lived: its wait had been ended)."""
    import argparse
    import time

    from nxl_hooks.apps.serve import client

    asked, read = [], []

    class Busy:  # a program that never stops generating
        name = "run"

        def events(self, path, timeout=None, on_open=None, on_connect=None):
            on_open()
            for n in range(100000):
                read.append(n)
                yield "step", StepView(step=n, position=5 + n, token_id=7, token="a", probability=0.5, active=True,
                                       scores={"normxlogit": {1: ()}}, request_id="r").to_json()
                time.sleep(0.01)

        def status(self, timeout=None):
            asked.append(1)
            return {"pid": 1, "models": []}

    monkeypatch.setattr(client, "endpoints", lambda run, token_file: [Busy()])
    before = set(threading.enumerate())
    args = argparse.Namespace(run=None, token_file=None, request_id=None, k=1, last=None, layer=None,
                              method="normxlogit", count=1)
    assert tail.run(args) == 0
    ours = [thread for thread in set(threading.enumerate()) - before
            if thread.name.endswith(("(follow)", "(watch_faults)"))]
    for thread in ours:
        thread.join(5)
    assert not [thread.name for thread in ours if thread.is_alive()]
    settled = len(asked), len(read)
    time.sleep(0.3)
    assert (len(asked), len(read)) == settled
    assert capsys.readouterr().out.startswith("r ")


def test_tail_hangs_up_a_quiet_stream_once_it_returns(tmp_path, monkeypatch, capsys):
    """``nxl tail --count 1`` on a real endpoint whose program makes one token, then goes quiet: once ``tail.run`` returns, its
    follower ends and the endpoint's stream with it (the follower waited in a read of the quiet stream, whose
    keepalives are no events, as long as the program lived: a thread and a connection per call, and one of the
    endpoint's MAX_STREAMS taken)."""
    import argparse

    with _recorded(tmp_path) as (controller, model):
        subscribe, subscribed = controller.live.subscribe, threading.Event()

        def counted(request_id=None):
            reader = subscribe(request_id)
            subscribed.set()
            return reader

        monkeypatch.setattr(controller.live, "subscribe", counted)
        generating = threading.Thread(target=lambda: subscribed.wait(60) and _generate(model, 1), daemon=True)
        generating.start()
        before = set(threading.enumerate())
        args = argparse.Namespace(run=str(socket_path(tmp_path / "run", os.getpid())), token_file=None,
                                  request_id=None, k=1, last=None, layer=None, method="normxlogit", count=1)
        assert tail.run(args) == 0
        generating.join(60)
        followers = [thread for thread in set(threading.enumerate()) - before if thread.name.endswith("(follow)")]
        for thread in followers:
            thread.join(10)
        assert not [thread.name for thread in followers if thread.is_alive()]
        (server,) = controller.endpoint._servers
        with server.streams_changed:
            assert server.streams_changed.wait_for(lambda: server.streams == 0, 10)
    capsys.readouterr()


def test_endpoints_started_and_stopped_in_one_process_register_one_exit_handler(tmp_path, monkeypatch):
    """The socket files' exit handler is registered once per process, however many endpoints start and stop in it
    (``nxl attach`` / ``nxl detach`` again and again in a server): each start after a stop registered it again,
    one more handler per endpoint, each run at exit."""
    registered = []

    class Exit:  # as atexit keeps its handlers: unregister takes every registration of the function
        register = staticmethod(registered.append)

        @staticmethod
        def unregister(function):
            registered[:] = [each for each in registered if each != function]

    monkeypatch.setattr(endpoint, "atexit", Exit)
    for n in range(3):
        controller = Controller(Settings(run_dir=tmp_path / f"run{n}"))
        controller._ensure_endpoint()
        assert controller.endpoint is not None
        controller.close()
    assert registered == [endpoint._clean_up]


def test_tail_that_returns_with_its_queue_full_leaves_no_follower_waiting_for_room(monkeypatch, capsys):
    """``nxl tail --count 1`` behind a slow stdout: it returns with its queue full of steps it will not show, while
    the follower waits for room to hand on what is never dropped (the line of steps not shown, the request's end).
    It waited for that room as long as the process lived; now it sees the stop and ends."""
    import argparse
    import queue
    import types

    from nxl_hooks.apps.serve import client

    printing, waiting, printed = threading.Event(), threading.Event(), []

    class Watched(queue.Queue):  # says when a put is about to wait for room
        def put(self, item, block=True, timeout=None):
            if block and self.full():
                waiting.set()
            super().put(item, block, timeout)

    def step(n: int) -> dict:
        return StepView(step=n, position=5 + n, token_id=7, token="a", probability=0.5, active=True,
                        scores={"normxlogit": {1: ()}}, request_id="r").to_json()

    class Stream:  # step 0; once it is being printed, nine more (two fill the queue), then the request's end
        name = "run"

        def events(self, path, timeout=None, on_open=None, on_connect=None):
            on_open()
            yield "step", step(0)
            assert printing.wait(60)
            for n in range(1, 10):
                yield "step", step(n)
            yield "end", {"request_id": "r", "steps": 10}

        def status(self, timeout=None):
            return {"pid": 1, "models": []}

    def slow_print(*args, **kwargs):  # the first line is taken once the follower waits for room
        printing.set()
        assert waiting.wait(60)
        printed.append(" ".join(map(str, args)))

    monkeypatch.setattr(client, "endpoints", lambda run, token_file: [Stream()])
    monkeypatch.setattr(tail, "LIVE_QUEUE", 2, raising=False)
    monkeypatch.setattr(tail, "queue", types.SimpleNamespace(Queue=Watched, Empty=queue.Empty, Full=queue.Full))
    monkeypatch.setattr(tail, "print", slow_print, raising=False)
    before = set(threading.enumerate())
    args = argparse.Namespace(run=None, token_file=None, request_id=None, k=1, last=None, layer=None,
                              method="normxlogit", count=1)
    assert tail.run(args) == 0
    assert len(printed) == 1 and printed[0].startswith("r ")
    ours = [thread for thread in set(threading.enumerate()) - before
            if thread.name.endswith(("(follow)", "(watch_faults)"))]
    for thread in ours:
        thread.join(10)
    assert not [thread.name for thread in ours if thread.is_alive()]
    capsys.readouterr()


def test_tail_whose_last_requests_fail_leaves_nothing_running(monkeypatch):
    """``nxl tail --last N`` whose look at the last requests fails (a request gone between the list and its read:
    a one-line error): its follower and fault watcher, started before it, went on reading and polling."""
    import argparse

    import pytest

    from nxl_hooks.apps.options import CliError
    from nxl_hooks.apps.serve import client

    asked = []

    class Quiet:  # a program that is subscribed to and makes nothing
        name = "run"

        def events(self, path, timeout=None, on_open=None, on_connect=None):
            on_open()
            yield from ()

        def status(self, timeout=None):
            asked.append(1)
            return {"pid": 1, "models": []}

    def gone(targets, n, k):
        raise CliError("run: no request 'r' (it was forgotten)")

    monkeypatch.setattr(client, "endpoints", lambda run, token_file: [Quiet()])
    monkeypatch.setattr(tail, "last_requests", gone)
    before = set(threading.enumerate())
    args = argparse.Namespace(run=None, token_file=None, request_id=None, k=1, last=2, layer=None,
                              method="normxlogit", count=None)
    with pytest.raises(CliError):
        tail.run(args)
    ours = [thread for thread in set(threading.enumerate()) - before if thread.name.endswith("(watch_faults)")]
    for thread in ours:
        thread.join(10)
    assert not [thread.name for thread in ours if thread.is_alive()]
