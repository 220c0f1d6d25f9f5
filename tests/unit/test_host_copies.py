"""The publisher's move of a batch of records to the host (:func:`nxl_hooks.hooks.publish.host_copies`): each device
storage the records view crosses in one copy, and every record gets back exactly its own values, strides and sharing.
On the CPU nothing crosses, so these tests make the tensors "cross" with a counting copy in place of ``.cpu()``. Then
(:func:`~nxl_hooks.hooks.publish.on_host`) a record kept holds its own scores, not its batch's, and a record that
cannot reach the host is lost alone, and said."""

from __future__ import annotations

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


def test_a_record_that_cannot_reach_the_host_is_lost_alone_and_said_in_its_calls_notes(caplog):
    """The publisher moves a batch of records together; when that fails for one of them (here its token texts), the
    others still reach the call, and the lost one is said in the log and in the call's notes."""
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
    hub.publish(call, steps, texts)
    hub.end(call, None)
    assert [step.step for step in call.steps] == [0, 2] and [step.readable for step in call.steps] == [["t5"], ["t9"]]
    assert any("the record of step 1 was lost (KeyError" in note for note in call.notes)
    assert "the record of step 1 was lost" in caplog.text
    hub.close()
