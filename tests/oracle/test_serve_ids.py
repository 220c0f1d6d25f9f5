"""Request ids across ``transformers serve``'s processes (transformers 5.25 and newer: each model runs in a process
of its own, which the API server hands numbered requests). In this process, without HTTP: the API server's side (its
middleware, its engine client) puts the client's id in a request's settings; the model process's runner, patched,
names the request's record by it; unpatched, it generates exactly as without it (a model process nxl_hooks never
reached is not harmed). The whole route, over HTTP and both processes: tests/process/test_serve.py."""

import asyncio
import inspect
import queue
import sys
import types

import pytest
import torch

import nxl_hooks as nxl
import tiny
from nxl_hooks.hooks.conventions import SERVE_HANDLERS
from nxl_hooks.hooks.engines import transformers_serve
from nxl_hooks.hooks.generate import REQUEST_ID, RequestNames
from oracle import check_call

utils = pytest.importorskip("transformers.cli.serving.utils", reason="transformers serve is not installed")
split = pytest.mark.skipif(not hasattr(utils, "GenerateRunner"), reason="up to transformers 5.24, serve runs its "
                           "models in the API server's own process (tests/process/test_serve.py)")


def _run(runner, request_id: int, settings: dict, results: queue.Queue, *, generate=None) -> list[int]:
    """Hand ``runner`` one request (its prompt: 6 tokens) as the model process's loop does; its generated tokens."""
    ids = torch.randint(1, tiny.GEN_VOCAB, (1, 6), generator=torch.Generator().manual_seed(request_id))
    (generate or type(runner).generate)(runner, request_id, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                                        settings, False)
    _, _, finished = results.get(timeout=120)
    ((done, tokens),) = finished
    assert done == request_id and isinstance(tokens, list), tokens
    return tokens


def _unpatched_after(monkeypatch) -> None:
    """What patch_serving and patch_engine_client patch, given back after the test."""
    model_manager = pytest.importorskip("transformers.cli.serving.model_manager")
    for cls, names in ((utils.RequestIdMiddleware, ["__call__"]), (model_manager.EngineClient, SERVE_HANDLERS),
                       *((cls, ["generate"]) for cls in transformers_serve._runners(utils))):
        for name in names:
            monkeypatch.setattr(cls, name, vars(cls)[name])


@pytest.fixture
def runner(monkeypatch):
    """A 5.25 ``GenerateRunner`` over a random Llama (no EOS), its results in a queue; what the patches patch given
    back after the test."""
    _unpatched_after(monkeypatch)
    model = tiny.generating_llama()
    model.generation_config.pad_token_id = tiny.GEN_PAD
    results: queue.Queue = queue.Queue()
    return utils.GenerateRunner(model, None, lambda *message: results.put(message)), results


SETTINGS = {"max_new_tokens": 4, "do_sample": False, "seed": None}


@split
def test_an_unpatched_model_process_generates_as_without_the_carried_id(runner):
    """The id goes as a key whose value is None: a model process nxl_hooks did not patch gives generate only the
    settings that are not None, so it generates the same tokens as without it (were the value given to generate,
    it would refuse an unknown setting)."""
    runner, results = runner
    original = inspect.unwrap(vars(utils.GenerateRunner)["generate"])
    plain = _run(runner, 3, dict(SETTINGS), results, generate=original)
    carried = transformers_serve.carry(dict(SETTINGS), "client-3")
    assert [key for key in carried if not isinstance(key, str)] == [("nxl_hooks.request_id", "client-3")]
    assert _run(runner, 3, carried, results, generate=original) == plain and len(plain) == 4


@split
def test_a_patched_model_process_names_its_generate_call_by_the_carried_id(runner):
    """Patched (as nxl run and nxl attach do), the runner takes the id out of the settings and the generate call it
    queues for its own thread is recorded under it, its steps equal to the oracle; a request without one gets an id
    of its own, and the host's tokens are unchanged."""
    runner, results = runner
    plain = _run(runner, 5, dict(SETTINGS), results, generate=inspect.unwrap(vars(utils.GenerateRunner)["generate"]))
    transformers_serve.patch_serving(utils)
    assert getattr(vars(utils.GenerateRunner)["generate"], "__nxl_patched__", False)
    with nxl.attach(runner.model, layers="all") as probe:
        named = _run(runner, 5, transformers_serve.carry(dict(SETTINGS), "client-5"), results)
        unnamed = _run(runner, 5, dict(SETTINGS), results)
    assert named == unnamed == plain
    first, second = probe.calls
    assert first.request_id == "client-5" and second.request_id not in ("client-5", "5")
    assert first.sequences[0, 6:].tolist() == named
    check_call(runner.model, first, 4)


def test_request_names_keep_the_newest_and_answer_an_unknown_id_with_itself():
    names = RequestNames()
    names.KEPT = 3
    for n in range(5):
        names.name(str(n), f"client-{n}")
    names.name("2", "client-2b")  # named again: the newest
    assert [names(str(n)) for n in range(5)] == ["0", "1", "client-2b", "client-3", "client-4"]
    assert names("other") == "other" and names(None) is None


@split
def test_the_api_server_sends_the_id_its_middleware_gave_the_request(monkeypatch):
    """The API server's middleware runs the handler with the request's id (the client's X-Request-ID, or the one it
    made and sends back), and its engine client's generate calls carry it in a copy of the handler's settings."""
    from transformers.cli.serving.model_manager import EngineClient

    _unpatched_after(monkeypatch)
    transformers_serve.patch_serving(utils)
    transformers_serve.patch_engine_client(sys.modules["transformers.cli.serving.model_manager"])
    seen, sent = [], []
    # an engine client as far as generate_streaming reads it: what it sends to the model's process is kept
    client = types.SimpleNamespace(_send_streaming_request=lambda method, args, *rest: sent.append(args[1]))

    async def handler(scope, receive, send):
        seen.append(REQUEST_ID.get())
        EngineClient.generate_streaming(client, {"input_ids": []}, settings)
        await send({"type": "http.response.start", "status": 200, "headers": []})

    middleware = utils.RequestIdMiddleware(handler)
    answered = []

    async def send(message):
        answered.append(dict(message.get("headers", [])).get(b"x-request-id"))

    settings = {"max_new_tokens": 2}
    for headers in ([(b"x-request-id", b"client-9")], []):
        asyncio.run(middleware({"type": "http", "headers": headers}, None, send))
    assert seen[0] == "client-9" and answered == [b"client-9", seen[1].encode()] and REQUEST_ID.get() is None
    assert [transformers_serve._taken(dict(each)) for each in sent] == seen and settings == {"max_new_tokens": 2}
    assert all(each.keys() - {("nxl_hooks.request_id", name)} == {"max_new_tokens"} for each, name in zip(sent, seen))


def test_a_runner_seen_with_another_queue_is_of_its_class_and_changes_nothing_of_it():
    """The runner its patched generate hands transformers' own: an instance of its class (so that a generate that
    calls ``super()`` still works), whose attributes are the runner's own but for the queue it was given."""
    class Base:
        def first(self):
            return self.queue

    class Runner(Base):
        def __init__(self):
            self.queue, self.calls = "its own", 0

        def first(self):
            self.calls += 1
            return super().first()

    runner = Runner()
    seen = transformers_serve._seen(runner, queue="given")
    assert isinstance(seen, Runner) and seen.first() == "given"
    assert runner.calls == 1 and runner.queue == "its own" and runner.first() == "its own"
