"""One seed per prompt: a prompt's tokens depend only on (prompt, sampling parameters, seed), alone or among
others, greedy and sampled, for plain decoding and every drafter (the property serving relies on: a request's key
comes from its seed and its own positions, never its row or the loop's step count). A one-prompt call with an
integer seed s draws exactly as seed=[s]."""

from __future__ import annotations

import pytest

import jspec
from jspec.drafters.draft_model import DraftModelDrafter
from jspec.drafters.ngram import NgramDrafter
from tests import spec_fixtures as fx

PROMPT = [3, 9, 27, 17, 51]
OTHERS = [[1, 2, 3, 4, 5, 6, 7], [60, 61, 62], [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5]]


@pytest.fixture(scope="module")
def params_t():
    return fx.near_bigram_target()


def engines(params_t) -> dict:
    return {
        "plain": fx.plain_engine(params_t),
        "eagle3-dynamic": fx.spec_engine(params_t, fx.random_head(), "dynamic"),
        # a draft model samples its drafts at temperature > 0 (recursive rejection sampling)
        "draft-model": jspec.SpecEngine(fx.TARGET, params_t, drafter=DraftModelDrafter(
            fx.TARGET, fx.TARGET, fx.SPECS["chain"], fx.MAX_SEQ_LEN), drafter_params=params_t, max_batch_size=4,
            max_seq_len=fx.MAX_SEQ_LEN),
        "ngram": jspec.SpecEngine(fx.TARGET, params_t, drafter=NgramDrafter(fx.SPECS["chain"], fx.MAX_SEQ_LEN),
                                  drafter_params={}, max_batch_size=4, max_seq_len=fx.MAX_SEQ_LEN),
    }


# slow: plain decoding, an EAGLE-3 dynamic tree and a draft model: per-prompt seeds draw the same alone or in a
# crowd; default tier: [ngram]
@pytest.mark.parametrize("name", [pytest.param("plain", marks=pytest.mark.slow),
                                  pytest.param("eagle3-dynamic", marks=pytest.mark.slow),
                                  pytest.param("draft-model", marks=pytest.mark.slow), "ngram"])
def test_a_prompt_draws_the_same_tokens_alone_or_in_a_crowd(params_t, name):
    engine = engines(params_t)[name]
    for temperature in (0.0, 1.0):
        kwargs = dict(max_new_tokens=24, temperature=temperature)
        alone = engine.generate([PROMPT], seed=[1234], **kwargs).token_ids[0]
        assert engine.generate([PROMPT], seed=1234, **kwargs).token_ids[0] == alone
        for position in range(4):
            crowd = OTHERS[:position] + [PROMPT] + OTHERS[position:]
            seeds = [7, 8, 9][:position] + [1234] + [7, 8, 9][position:]
            assert engine.generate(crowd, seed=seeds, **kwargs).token_ids[position] == alone, (temperature, position)
        if temperature > 0:  # and the seed matters
            assert engine.generate([PROMPT], seed=[99], **kwargs).token_ids[0] != alone


def test_one_integer_seed_still_gives_rows_their_own_draws(params_t):
    """seed=s for a batch of identical prompts: rows draw independently (fold_in(key(s), row))."""
    out = fx.plain_engine(params_t).generate([PROMPT] * 4, max_new_tokens=16, temperature=1.0, seed=5).token_ids
    assert len({tuple(tokens) for tokens in out}) > 1


@pytest.mark.parametrize("seed, message", [([1, 2], "2 values for 1 prompts"), ([-1], "one integer in"),
                                           ([2 ** 32], "one integer in"), ("3", "expected an integer")])
def test_bad_seeds_are_refused(params_t, seed, message):
    with pytest.raises(ValueError, match=message):
        fx.plain_engine(params_t).generate([PROMPT], seed=seed, temperature=1.0, max_new_tokens=8)
