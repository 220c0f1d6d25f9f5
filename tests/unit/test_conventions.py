"""hooks/conventions.py: where a forward's tokens sit, from what the installed transformers actually passes
(``cache`` or ``past_key_values``, ``cache_position`` or none), checked against the count of tokens fed so far."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import DynamicCache

import tiny
from nxl_hooks.hooks.conventions import CACHE_NAMES, Positions, UnfollowedForward, find_cache, positions, token_mask


@pytest.fixture(scope="module")
def model():
    return tiny.build_model("llama")


def _seen_positions(model, held: bool = False, **generate) -> list[Positions]:
    """positions() of every backbone forward of one generate call, read from the arguments the backbone got;
    ``held``: told the tokens of the forwards before, as the call's record holds them."""
    seen = []

    def hook(module, args, kwargs):
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
        bound.update(bound.pop("kwargs", {}) or {})
        seen.append(positions(bound, sum(p.new for p in seen) if held else None))

    handle = model.base_model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        model.generate(torch.tensor([[1, 5, 7, 9]]), max_new_tokens=3, do_sample=False, pad_token_id=0, **generate)
    finally:
        handle.remove()
    return seen


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_positions_are_the_tokens_fed_before(model, cache):
    """Whatever this transformers passes (5.24: cache=, position_ids; before: past_key_values=, cache_position),
    forward k starts where the tokens of forwards 0..k-1 end: 4-token prompt, then one token at 4 and at 5."""
    options = {"cache_implementation": "static"} if cache == "static" else {}
    seen = _seen_positions(model, **options)
    assert [(p.past, p.new) for p in seen] == [(0, 4), (4, 1), (5, 1)]
    assert seen[1].source in ("cache_position", "cache")


def _keyword(model) -> str:
    """The keyword the model's forward takes its cache under (5.24: cache; before: past_key_values, or Mamba's
    cache_params)."""
    parameters = inspect.signature(model.forward).parameters
    return next(name for name in (*CACHE_NAMES, "cache_params") if name in parameters)


def test_the_cache_is_found_by_what_it_is_under_any_keyword(model):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 5, 7]]), **{_keyword(model): cache}, use_cache=True)
    assert cache.get_seq_length() == 3
    ids = torch.tensor([[9]])
    for keyword in (*CACHE_NAMES, "kv_state_of_a_future_version"):
        arguments = {"input_ids": ids, keyword: cache}
        assert find_cache(arguments) is cache
        assert positions(arguments) == Positions(3, 1, "cache")
    # cache_position, where the model writes, comes first
    assert positions({"input_ids": ids, "cache": cache, "cache_position": torch.tensor([3])}) == Positions(
        3, 1, "cache_position")


def test_without_a_cache_positions_start_at_zero_unless_position_ids_say_otherwise():
    ids = torch.tensor([[1, 5, 7, 9], [0, 0, 5, 6]])
    left_padded = torch.tensor([[0, 1, 2, 3], [0, 0, 0, 1]])  # a left-padded row starts at 0 (1 in older versions)
    assert positions({"input_ids": ids, "position_ids": left_padded}) == Positions(0, 4, "no cache")
    assert positions({"inputs_embeds": torch.zeros(2, 4, 8)}) == Positions(0, 4, "no cache")
    with pytest.raises(UnfollowedForward, match="position_ids start at 7 in every row.*no KV cache"):
        positions({"input_ids": ids[:, :1], "position_ids": torch.tensor([[7], [9]])})
    with pytest.raises(UnfollowedForward, match="neither input_ids nor inputs_embeds"):
        positions({"attention_mask": torch.ones(1, 3)})


def test_the_padding_of_new_tokens_is_read_from_a_2d_or_4d_mask():
    """A left-padded row: real tokens from position 2. The 2-D mask, a boolean 4-D causal mask and an additive
    4-D one (generate's static-cache shape, with a key dimension longer than the sequence) say the same."""
    real = torch.tensor([[False, False, True, True], [True, True, True, True]])
    causal = torch.ones(4, 6, dtype=torch.bool).tril()  # 4 queries, 6 cache slots
    boolean = (causal[None, None] & torch.cat([real, torch.ones(2, 2, dtype=torch.bool)], 1)[:, None, None])
    additive = torch.zeros(boolean.shape).masked_fill(~boolean, torch.finfo(torch.float32).min)
    for mask in (real.long(), boolean, additive):
        assert torch.equal(token_mask(mask, 0, 4), real)
    assert torch.equal(token_mask(boolean[:, :, 3:], 2, 2), real[:, 2:])  # one query's row, positions 2..3
    assert token_mask(None, 0, 4) is None
    with pytest.raises(UnfollowedForward, match="does not cover positions 4..7"):
        token_mask(boolean[..., :3], 4, 4)  # fewer keys than the forward has tokens


def test_the_padding_of_new_tokens_is_read_from_a_sliding_windows_mask():
    """A sliding window of 3 over 8 positions, row 0 left-padded by 2: the prompt's last query sees only positions 5..7,
    yet positions 2..4 are real (each sees itself); once the window is full a decoding step's mask holds only the
    window's keys, ending at its own token; a dict of masks by layer type (Gemma 2) is read by its full-attention one."""
    real = torch.ones(2, 8, dtype=torch.bool)
    real[0, :2] = False
    position = torch.arange(8)
    window = (position[:, None] >= position[None]) & (position[:, None] - position[None] < 3)  # (queries, keys)
    sliding = window[None, None] & real[:, None, None]
    assert torch.equal(token_mask(sliding, 0, 8), real)
    full_window = sliding[:, :, 7:, 5:]  # position 7 decoding: its keys are positions 5..7
    assert torch.equal(token_mask(full_window, 7, 1), real[:, 7:])
    causal = (position[:, None] >= position[None])[None, None] & real[:, None, None]
    layers = {"sliding_attention": sliding[:, :, 4:, 2:], "full_attention": causal[:, :, 4:]}
    assert torch.equal(token_mask(layers, 4, 4), real[:, 4:])
    assert torch.equal(token_mask({"full_attention": causal}, 0, 8), real)


def test_a_cache_of_recurrent_states_holds_the_positions_of_the_record_that_filled_it():
    """A state-space model's cache (Mamba: recurrent states only) counts no positions before transformers 5.25
    (get_seq_length raises on it) and generate passes no cache_position: empty, it holds none; once it has taken
    tokens in, it holds those of the record whose forwards filled it (``held``: a generate call's), read with no
    device read. With no record to ask (or one that holds nothing: the cache was filled before it), where a forward
    continuing it starts is unknown, and said. From 5.25 it counts them (a device tensor), whatever filled it."""
    mamba = tiny.generating_state_space("mamba")
    seen = _seen_positions(mamba, held=True)
    assert [(p.past, p.new, p.source) for p in seen] == [(0, 4, "cache"), (4, 1, "cache"), (5, 1, "cache")]
    cache = DynamicCache(config=mamba.config)
    ids = torch.tensor([[1, 5, 7]])
    assert positions({"input_ids": ids, "cache": cache}) == Positions(0, 3, "cache")
    with torch.no_grad():
        mamba(input_ids=ids, **{_keyword(mamba): cache}, use_cache=True)
    assert positions({"input_ids": ids[:, :1], "cache": cache}, held=3) == Positions(3, 1, "cache")
    try:
        counted = cache.get_seq_length()
    except ValueError:  # (transformers < 5.25: "can only be called on Attention layers")
        counted = None
    if counted is not None:  # the cache's own count, not the record's: a cache filled before any record is followed
        assert isinstance(counted, torch.Tensor) and int(counted) == 3
        for held in (None, 0, 7):
            assert positions({"input_ids": ids[:, :1], "cache": cache}, held) == Positions(3, 1, "cache")
        return
    for held in (None, 0):
        with pytest.raises(UnfollowedForward, match=r"its cache \(DynamicCache\) holds recurrent states .* took in "
                                                    r"tokens of forwards nxl_hooks did not follow, and does not count"):
            positions({"input_ids": ids[:, :1], "cache": cache}, held)
