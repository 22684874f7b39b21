"""A target whose sliding window binds, served: its window layers' K/V live in a pool of their own, and a request
holds only the pages its window still reads (``jspec.serve.kv_cache_coordinator``). Requests much longer than the
window, prefilled whole, from a prefix-cache hit and in pieces, decoded with n-gram speculation four at a time
while freed window pages pass from one request to another, each equal ``generate`` alone."""

from __future__ import annotations

import jax
import pytest

import jspec
from jspec.drafters.ngram import NgramDrafter
from jspec.serve.slots import SlotEngine
from tests import spec_fixtures as fx
from tests.jspec.serve.test_slots import serve_all
from tests.models.test_windowed_speculation import WINDOWED, near_bigram

# slow (a windowed MoE target's server programs compile); default tier: test_kv_cache_coordinator's window group,
# test_windowed_families' logits and trees against transformers
pytestmark = pytest.mark.slow
MAX_SEQ_LEN, PAGE = 64, 4
PREFIX = [(7 * i) % 50 + 3 for i in range(20)]


def test_requests_past_the_window_hold_its_pages_only_and_equal_generate_alone():
    config = WINDOWED["gpt_oss"]  # window 8 in layers 0 and 2
    engine = jspec.SpecEngine(config, near_bigram(config), drafter=NgramDrafter(fx.SPECS["chain"], MAX_SEQ_LEN),
                              drafter_params={}, max_batch_size=4, max_seq_len=MAX_SEQ_LEN)
    slots = SlotEngine(engine, max_seq_len=MAX_SEQ_LEN, steps_per_chunk=2, adapt=False, row_buckets=(4,),
                       block_size=PAGE, max_num_batched_tokens=16)
    slots.warm_up()
    layout = slots.layout
    assert layout.window == 8 and layout.num_groups == 2 and layout.window_pages < layout.num_pages
    held = []
    advance = slots.blocks.advance

    def recorded(pages, window_pages, query, num_slots):
        advanced = advance(pages, window_pages, query, num_slots)
        if advanced:
            held.append(sum(map(bool, window_pages)))
            assert not any(window_pages[:slots.blocks.first_window_page(query)])
        return advanced

    slots.blocks.advance = recorded
    slots.start()
    try:
        first = [{"prompt_ids": PREFIX + [9, 4], "max_tokens": 30}]
        rest = [{"prompt_ids": PREFIX + [11, 2, 30], "max_tokens": 28},  # a hit on the first's pages
                {"prompt_ids": [(5 * i) % 40 + 1 for i in range(37)], "max_tokens": 20},  # prefilled in pieces
                {"prompt_ids": [5, 9, 5, 9, 12], "max_tokens": 40},
                {"prompt_ids": [3, 1, 4, 1, 5, 9, 2, 6], "max_tokens": 36},
                {"prompt_ids": [7] * 3, "max_tokens": 44}]
        served = serve_all(slots, first) + serve_all(slots, rest)
        assert slots.metrics.prefix_hits._value.get() > 0
    finally:
        slots.shutdown(10)
    for request, sink in zip(first + rest, served):
        alone = engine.generate([request["prompt_ids"]], max_new_tokens=request["max_tokens"]).token_ids[0]
        assert sink.tokens == alone, request["prompt_ids"]
    per_row = slots.runner.window_pages_per_row(layout)
    assert held and max(held) <= per_row < layout.pages_per_row, (max(held), per_row, layout.pages_per_row)
    assert slots.blocks.window.num_used_pages == slots.blocks.full.num_used_pages == 0
    jax.clear_caches()
