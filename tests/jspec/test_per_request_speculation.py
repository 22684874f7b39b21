"""A request's own draft length (``num_speculative_tokens``, vLLM's server-wide name, per request): each row's tree
is cut below that depth before verification, so a step accepts at most that many drafts; 0 commits one token a
step as plain decoding. Greedy output stays the target's whatever the cap, and one program serves every cap (an
array input)."""

from __future__ import annotations

import pytest

import jspec
from jspec.drafters.draft_model import DraftModelDrafter
from tests import spec_fixtures as fx

PROMPTS = [[5, 9, 5, 9, 12], [3, 1, 4, 1, 5]]


@pytest.fixture(scope="module")
def engines():
    params = fx.near_bigram_target()
    drafter = DraftModelDrafter(fx.TARGET, fx.TARGET, fx.SPECS["chain"], fx.MAX_SEQ_LEN)  # the target drafting
    speculative = jspec.SpecEngine(fx.TARGET, params, drafter=drafter, drafter_params=params, max_batch_size=4,
                                   max_seq_len=fx.MAX_SEQ_LEN)
    return speculative, fx.plain_engine(params).generate(PROMPTS, max_new_tokens=20).token_ids


def test_a_cap_bounds_acceptance_and_keeps_the_tokens(engines):
    engine, plain = engines
    uncapped = engine.generate(PROMPTS, max_new_tokens=20)
    assert uncapped.token_ids == plain and uncapped.stats.acceptance_length > 4  # every draft accepted
    for cap in (0, 1, 2):
        out = engine.generate(PROMPTS, max_new_tokens=20, num_speculative_tokens=cap)
        assert out.token_ids == plain, cap
        assert 1.0 + 0.5 * cap < out.stats.acceptance_length <= 1.0 + cap or cap == 0, (cap, out.stats)
        if cap == 0:
            assert out.stats.acceptance_length == 1.0


def test_a_bad_cap_is_refused_by_name(engines):
    engine, _ = engines
    with pytest.raises(ValueError, match="num_speculative_tokens=-1"):
        engine.generate(PROMPTS, max_new_tokens=4, num_speculative_tokens=-1)
