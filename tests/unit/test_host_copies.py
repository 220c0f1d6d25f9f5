"""The publisher's work on a batch of records. It makes them (scores them) off the generating thread, from a snapshot
of the call's feature cache that the call's later rewrites never touch; a batch that fails there is lost alone, and
said. It moves them to the host (:func:`nxl_hooks.hooks.publish.host_copies`): each device storage the records view
crosses in one copy, and every record gets back exactly its own values, strides and sharing. On the CPU nothing
crosses, so these tests make the tensors "cross" with a counting copy in place of ``.cpu()``. Then
(:func:`~nxl_hooks.hooks.publish.on_host`) a record kept holds its own scores, not its batch's, and a record that
cannot reach the host is lost alone, and said."""

from __future__ import annotations

import threading

import pytest
import torch

from nxl_hooks.hooks.publish import host_copies, on_host
from nxl_hooks.records.steps import Step


def _moved(tensors):
    copies = []

    def move(tensor):
        copies.append(tensor.numel())
        return tensor.clone()

    return host_copies(tensors, move, crosses=lambda tensor: True), copies


def test_views_of_one_storage_cross_in_one_copy_of_their_span_and_keep_their_values_and_sharing():
    base = torch.arange(2 * 3 * 10, dtype=torch.float32).view(2, 3, 10)
    views = [base[:, 1, :7], base[0, :, 2:9:3], base[1].narrow(1, 4, 6), base[:, 2, 5], base[1, 0, :0]]
    other = torch.arange(4, dtype=torch.int64)
    tensors = [*views, other, other[None].expand(3, 4)]
    out, copies = _moved(tensors)
    # base's views read elements 2 (base[0, 0, 2]) to 59 (base[1, 2, 9]): 58 of its 60 cross, once; other (both its
    # views) once
    assert sorted(copies) == [4, 58]
    for before, after in zip(tensors, out):
        assert after is not before and after.dtype == before.dtype and after.shape == before.shape
        assert after.stride() == before.stride() and torch.equal(after, before)
    assert len({t.untyped_storage().data_ptr() for t in out[:4]}) == 1  # still one storage, now a copy
    assert out[0].untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert out[5].untyped_storage().data_ptr() == out[6].untyped_storage().data_ptr()


def test_a_small_view_of_a_large_buffer_and_a_storage_read_as_two_dtypes_cross_view_by_view():
    big = torch.randn(1 << 20)
    small = [big[:3], big[-2:]]  # a span of the whole buffer, nearly all of it read by neither
    words = torch.arange(8, dtype=torch.int32)
    tensors = [*small, words, words.view(torch.float32)]
    out, copies = _moved(tensors)
    assert sorted(copies) == [2, 3, 8, 8]
    for before, after in zip(tensors, out):
        assert after.dtype == before.dtype and after.stride() == before.stride()
        assert torch.equal(after.view(torch.int32), before.view(torch.int32))


def test_tensors_that_do_not_cross_come_back_as_they_are():
    tensors = [torch.ones(3), torch.zeros(2, 2)[:, 0]]
    assert all(a is b for a, b in zip(host_copies(tensors), tensors))


def test_a_record_kept_holds_its_own_scores_not_its_batchs():
    """Records scored together are views of one stacked tensor (every step's rows, padded to the longest context): on
    the host, each record's scores become its own, so one record kept does not hold on to its batch's."""
    stacked = torch.randn(2, 16, 1, 4096)  # (layers, steps, batch, longest context)
    steps = [Step(call=0, step=index, position=4000 + index, token=torch.tensor([index]), target=torch.tensor([index]),
                  scores={"normxlogit": stacked[:, index, :, :4000 + index], "logat": stacked[:, index, :, :8]},
                  embed_norm=torch.rand(1, 4000 + index), mask=torch.ones(1, 4000 + index, dtype=torch.bool),
                  active=torch.ones(1, dtype=torch.bool), layers=[0, 1], n_blocks=2) for index in range(16)]
    before = [{name: value.clone() for name, value in step.scores.items()} for step in steps]
    on_host(steps)
    for step, expected in zip(steps, before):
        for name, value in step.scores.items():
            assert torch.equal(value, expected[name])
            assert value.untyped_storage().nbytes() == value.numel() * value.element_size()


def test_a_record_whose_texts_cannot_be_made_goes_on_without_them_said_in_its_calls_notes(caplog):
    """The publisher moves a batch of records together; when the tokenizer cannot make one record's token texts,
    that record goes on without them (it was lost: a gap in its call's steps, which a stream reader takes for
    damage), said in the log and in the call's notes."""
    from nxl_hooks.hooks.publish import Hub

    def texts(ids: list[int]) -> list[str]:
        if ids == [7]:
            raise KeyError("no text for token 7")
        return [f"t{token}" for token in ids]

    hub = Hub(on_step=None, sink=None, keep_steps=True)
    call = hub.begin([0], request_id="r", thread=None)
    steps = [Step(call=0, step=index, position=3 + index, token=torch.tensor([token]), target=torch.tensor([token]),
                  scores={"normxlogit": torch.ones(1, 1, 3 + index), "logat": torch.ones(1, 1, 3 + index)},
                  embed_norm=torch.ones(1, 3 + index), mask=torch.ones(1, 3 + index, dtype=torch.bool),
                  active=torch.ones(1, dtype=torch.bool), layers=[0], n_blocks=1)
             for index, token in enumerate((5, 7, 9))]
    batch = _Batch(steps)
    hub.publish(call, batch, texts)
    hub.end(call, None)
    hub.settle()  # (the call returns before its records are kept while nothing reads them live)
    assert [step.step for step in call.steps] == [0, 1, 2] and batch.lost_with is None
    assert [step.readable for step in call.steps] == [["t5"], None, ["t9"]]
    assert any("the token texts of step 1 could not be made (KeyError" in note for note in call.notes)
    assert "the token texts of step 1 could not be made" in caplog.text
    hub.close()


def test_a_record_that_cannot_reach_the_host_stops_its_calls_records_there(monkeypatch):
    """A record of a batch that cannot cross to the host is lost, and so are the ones after it (through its batch's
    ``lost``, from its step on: its call says it): the records before it reach the call, and no later one does, so
    that a call's steps never have a gap."""
    from nxl_hooks.hooks import publish

    crossing = publish.host_copies

    def failing(tensors, *args, **kwargs):
        if any(tensor.shape[-1] == 4 for tensor in tensors):  # step 1's (position 4)
            raise RuntimeError("device lost")
        return crossing(tensors, *args, **kwargs)

    monkeypatch.setattr(publish, "host_copies", failing)
    hub = publish.Hub(on_step=None, sink=None, keep_steps=True)
    call = hub.begin([0], request_id="r", thread=None)
    first, later = _Batch(_steps(0, 3)), _Batch(_steps(3, 1), call=None)
    later._call = first._call  # one call: a batch after the lost one is dropped
    hub.publish(call, first)
    hub.publish(call, later)
    hub.end(call, None)
    hub.settle()
    assert [step.step for step in call.steps] == [0]
    assert isinstance(first.lost_with, RuntimeError) and first.lost_at == 1
    hub.close()


class _Batch:
    """A :class:`~nxl_hooks.hooks.publish.Batch` of made records; ``fail``: what making them raises."""

    def __init__(self, steps: list[Step], fail: BaseException | None = None, elsewhere: bool = True,
                 nbytes: int = 0, call: dict | None = None) -> None:
        self.count, self.elsewhere, self.nbytes, self.devices = len(steps), elsewhere, nbytes, ()
        self.made = threading.Event()
        self._call = call if call is not None else {}  # what its call knows: "lost" once a batch of it was
        self._steps, self._fail = steps, fail
        self.made_in: str | None = None
        self.lost_with: BaseException | None = None
        self.lost_at: int | None = None  # the step its records were lost from (None: all)
        self.was_handed = 0  # how many of its records were handed on

    def records(self) -> list[Step]:
        self.made_in = threading.current_thread().name
        self.made.set()
        if self._fail is not None:
            raise self._fail
        return self._steps

    @property
    def dropped(self) -> bool:
        return self._call.get("lost", False)

    def handed(self, count: int) -> None:
        self.was_handed = count

    def lost(self, error: BaseException, step: int | None = None) -> None:
        self.lost_with, self.lost_at = error, step
        self._call["lost"] = True


def _steps(first: int, count: int) -> list[Step]:
    return [Step(call=0, step=index, position=3 + index, token=torch.tensor([index]), target=torch.tensor([index]),
                 scores={"normxlogit": torch.ones(1, 1, 3 + index), "logat": torch.ones(1, 1, 3 + index)},
                 embed_norm=torch.ones(1, 3 + index), mask=torch.ones(1, 3 + index, dtype=torch.bool),
                 active=torch.ones(1, dtype=torch.bool), layers=[0], n_blocks=1)
            for index in range(first, first + count)]


def test_the_publisher_makes_each_batch_and_one_that_fails_is_lost_alone():
    """A batch handed on is made into records in the publisher thread; one whose making raises is lost, told through
    its ``lost`` (its call says it), and the publisher goes on with the next. A batch that cannot be made elsewhere,
    or any under an ``on_step`` callback, is made in the calling thread, where what it raises is the caller's. Each
    batch is told it was handed on (its call's records reach it): not one whose making raised here; under a callback
    that raises, its records up to the one the callback raised on, and no later one."""
    from nxl_hooks.hooks.publish import Hub

    hub = Hub(on_step=None, sink=None, keep_steps=True)
    call = hub.begin([0], request_id="r", thread=None)
    broken, whole, here = (_Batch(_steps(0, 2), RuntimeError("no memory")), _Batch(_steps(2, 2)),
                           _Batch(_steps(4, 1), elsewhere=False))
    for batch in (broken, whole, here):
        hub.publish(call, batch)
    hub.end(call, None)
    hub.settle()  # (the call returns before its records are kept while nothing reads them live)
    assert [step.step for step in call.steps] == [2, 3, 4]
    assert (broken.made_in, whole.made_in, here.made_in) == ("nxl_hooks-publisher", "nxl_hooks-publisher",
                                                             "MainThread")
    assert isinstance(broken.lost_with, RuntimeError) and whole.lost_with is None and call.notes == []
    hub.close()
    seen = []
    hub = Hub(on_step=seen.append, sink=None, keep_steps=False)
    call = hub.begin([0], request_id="r", thread=None)
    mine, failing = _Batch(_steps(0, 2)), _Batch(_steps(2, 1), RuntimeError("no memory"))
    hub.publish(call, mine)
    with pytest.raises(RuntimeError, match="no memory"):
        hub.publish(call, failing)
    hub.end(call, None)
    hub.settle()  # (the call returns before its records are kept while nothing reads them live)
    assert mine.made_in == "MainThread" and [step.step for step in seen] == [0, 1]
    assert all(batch.was_handed for batch in (broken, whole, here, mine)) and not failing.was_handed
    hub.close()

    def refusing(step: Step) -> None:
        seen.append(step.step)
        if step.step == 1:
            raise ValueError("the callback broke")

    seen = []
    hub = Hub(on_step=refusing, sink=None, keep_steps=True)
    call = hub.begin([0], request_id="r", thread=None)
    given = _Batch(_steps(0, 3))  # scored together (a compiled call's steps): the callback breaks at the second
    with pytest.raises(ValueError, match="the callback broke"):
        hub.publish(call, given)
    hub.end(call, None)
    hub.settle()  # (the call returns before its records are kept while nothing reads them live)
    assert seen == [0, 1] and given.was_handed == 2 and [step.step for step in call.steps] == [0, 1]
    hub.close()


def test_a_snapshot_of_the_feature_cache_stays_as_it_was_when_the_call_rewrites_positions():
    """A batch of steps scored in the publisher thread reads the feature cache as it was when it was handed on:
    positions the call rewrites afterwards (a use_cache=False forward recomputes them all) go to a new buffer, never
    into what the snapshot reads; appends past it, and rewrites nothing holds, stay in place."""
    from nxl_hooks.hooks.generate import _Growing

    cache = _Growing()
    cache.append(torch.arange(6.0).view(1, 6))
    held = cache.snapshot(6, kept=True)
    before, storage = held.clone(), held.untyped_storage().data_ptr()
    cache.append(torch.full((1, 2), 7.0))  # past what the snapshot reads: in place
    assert cache.view().untyped_storage().data_ptr() == storage
    cache.truncate(2)
    cache.append(torch.full((1, 5), -1.0))  # rewrites positions 2..6
    assert torch.equal(held, before) and held.untyped_storage().data_ptr() == storage
    assert torch.equal(cache.view(), torch.tensor([[0.0, 1.0, -1.0, -1.0, -1.0, -1.0, -1.0]]))
    moved = cache.view().untyped_storage().data_ptr()
    assert moved != storage
    cache.truncate(3)
    cache.append(torch.zeros(1, 1))  # nothing holds the new buffer: rewritten in place
    assert cache.view().untyped_storage().data_ptr() == moved and float(cache.view()[0, 3]) == 0.0


def test_a_call_that_rewrites_every_position_keeps_one_buffer_size():
    """A use_cache=False call hands on a snapshot, then rewrites every position, at every token: the rewrite takes a
    buffer of the same capacity (it does not double each time), and a snapshot nobody keeps (a batch scored at once)
    costs no new buffer at all."""
    from nxl_hooks.hooks.generate import _Growing

    for kept in (True, False):
        cache, buffers = _Growing(), set()
        for n in range(1, 200):
            cache.truncate(0)
            cache.append(torch.full((1, n), float(n)))
            cache.snapshot(n, kept=kept)
            buffers.add(cache.view().untyped_storage().data_ptr())
        assert cache.view().untyped_storage().nbytes() <= 2 * 199 * 4 + 16 * 4
        assert torch.equal(cache.view(), torch.full((1, 199), 199.0))
        if not kept:
            assert len(buffers) <= 5  # grown 16 -> 32 -> ... -> 256, never replaced otherwise


def test_a_batch_to_be_scored_is_not_held_back_and_a_publisher_behind_scores_none_more():
    """A batch still to be scored reaches the publisher at once, even while nothing reads records live (made
    records are held back then, up to HELD, and go on together): the publisher scores it while the generating thread
    goes on. Past UNSCORED_BYTES kept by the batches waiting there, the calling thread scores a batch itself."""
    from nxl_hooks.hooks.publish import UNSCORED_BYTES, Hub

    hub = Hub(on_step=None, sink=None, keep_steps=True)
    call = hub.begin([0], request_id="r", thread=None)
    early = _Batch(_steps(0, 2))
    hub.publish(call, early)
    assert early.made.wait(10) and early.made_in == "nxl_hooks-publisher"  # before the call's end
    large = _Batch(_steps(2, 1), nbytes=UNSCORED_BYTES + 1)
    hub.publish(call, large)
    assert large.made_in == "MainThread"
    hub.end(call, None)
    hub.settle()  # (the call returns before its records are kept while nothing reads them live)
    assert [step.step for step in call.steps] == [0, 1, 2] and hub._unscored_bytes == 0
    hub.close()


def test_records_made_here_after_a_batch_lost_in_the_publisher_are_dropped_and_an_interrupt_stays_the_callers():
    """A call whose batch waits in the publisher, then is lost there, is not recorded from that batch on: a later
    batch of it made in the calling thread meanwhile (past UNSCORED_BYTES) is dropped, not delivered after the gap.
    After the hub closed, a batch is made in the calling thread: an interrupt raised making it is the caller's."""
    from nxl_hooks.hooks.publish import Hub

    hub = Hub(on_step=None, sink=None, keep_steps=True)
    call, state = hub.begin([0], request_id="r", thread=None), {}
    hub.publish(call, _Batch(_steps(0, 2), RuntimeError("no memory"), call=state))
    later = _Batch(_steps(2, 2), elsewhere=False, call=state)
    hub.publish(call, later)
    hub.end(call, None)
    hub.settle()  # (the call returns before its records are kept while nothing reads them live)
    assert later.made_in == "MainThread" and state["lost"] and call.steps == []
    hub.close()
    interrupted = _Batch(_steps(0, 1), KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        hub.publish(call, interrupted)
    assert isinstance(interrupted.lost_with, KeyboardInterrupt)
