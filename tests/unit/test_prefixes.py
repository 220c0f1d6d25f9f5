"""The shared-prefix rows of continuous batching (nxl_hooks/hooks/engines/prefixes.py): found by tokens, a running
request's first, the kept ones least recently used first out, within their byte budget. The engine's use of them
is checked against the uncached oracle in tests/oracle/test_batching.py."""

import torch

from nxl_hooks.hooks.engines.prefixes import Rows, SharedPrefixes


def _rows(n: int, mark: float) -> Rows:
    """n positions whose features say which rows they are (``mark``) and which position."""
    features = (mark + torch.arange(n, dtype=torch.float32))[None, :, None, None].expand(1, n, 2, 3).contiguous()
    return Rows(features, torch.full((1, n), mark), torch.ones(1, n, dtype=torch.bool))


def test_rows_are_found_by_the_tokens_of_their_positions():
    shared = SharedPrefixes(budget=1 << 20)
    shared.keep([1, 2, 3, 4, 5, 6], _rows(5, 100.0))  # the last token never ran: 5 positions
    found = shared.find([1, 2, 3, 9], 3)
    assert found.n == 3 and torch.equal(found.features[0, :, 0, 0], torch.tensor([100.0, 101.0, 102.0]))
    assert shared.find([1, 2, 7, 4], 3) is None  # another token inside the prefix
    assert shared.find([1, 2, 3, 4, 5, 6], 6) is None  # more positions than the request ran
    assert shared.find([1, 2], 3) is None  # a prompt shorter than the prefix asked for


def test_a_running_request_is_looked_at_before_the_kept_ones():
    shared = SharedPrefixes(budget=1 << 20)
    shared.keep([1, 2, 3, 4], _rows(4, 100.0))
    live = [([8, 8, 8, 8], _rows(4, 300.0)), ([1, 2, 3, 4, 5], _rows(5, 200.0))]
    assert shared.find([1, 2, 3], 3, live).embed[0, 0] == 200.0
    assert shared.find([1, 2, 3], 3, live[:1]).embed[0, 0] == 100.0


def test_kept_rows_stay_within_the_budget_least_recently_used_first_out():
    one = _rows(4, 0.0).nbytes()
    shared = SharedPrefixes(budget=2 * one)
    shared.keep([1, 1, 1, 1], _rows(4, 1.0))
    shared.keep([2, 2, 2, 2], _rows(4, 2.0))
    assert shared.find([1, 1], 2).embed[0, 0] == 1.0  # used: the other is now the least recently used
    assert not shared.let_go
    shared.keep([3, 3, 3, 3], _rows(4, 3.0))
    assert shared.find([2, 2], 2) is None and shared.let_go  # (a request that misses them is told they were)
    assert shared.find([1, 1], 2).embed[0, 0] == 1.0 and shared.find([3, 3], 2).embed[0, 0] == 3.0
    nothing = SharedPrefixes(budget=0)
    nothing.keep([1, 1, 1, 1], _rows(4, 1.0))
    assert nothing.find([1, 1], 2) is None and nothing.let_go
    shared.clear()
    assert shared.find([1, 1], 2) is None


def test_a_view_keeps_its_whole_storage_and_counts_it():
    buffer = torch.zeros(1, 64, 2, 3)
    rows = Rows(buffer.narrow(1, 0, 4), torch.zeros(1, 64).narrow(1, 0, 4), torch.ones(1, 64, dtype=torch.bool)[:, :4])
    assert rows.nbytes() == 64 * 2 * 3 * 4 + 64 * 4 + 64
