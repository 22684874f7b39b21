"""The DFlash and DSpark drafters (jspec/drafters/dflash.py) in the engine: greedy output equal to plain decoding
for a chain of the block, a per-position top-k static tree, and DSpark's Markov chain with its confidence cut;
forced acceptance commits whole blocks. Drafts are deterministic (top-k), verified as every such drafter's."""

from __future__ import annotations

import jax
import pytest

import jspec
from jspec.drafters.dflash import DFlashDrafter
from models.dflash import DFlashConfig, init_dflash_params
from models.config import ModelConfig
from tests import spec_fixtures as fx

RAGGED = [[5, 9, 13], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41], [7] * 6]
LAYER = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=8, model_type="qwen3", qk_norm=True)
MODEL = DFlashConfig(LAYER, block_size=5, mask_token_id=63, target_layer_ids=(0, 2), target_hidden_size=32)
DSPARK = DFlashConfig(LAYER, block_size=4, mask_token_id=63, target_layer_ids=(-1, 2), target_hidden_size=32,
                      layout="dspark", markov_rank=8, confidence_head=True, confidence_with_markov=True)
SPECS = {"chain": jspec.SpecConfig(tree="chain", num_steps=4),
         "dynamic": jspec.SpecConfig(tree="dynamic", num_steps=4, topk=3, num_draft_tokens=10),
         "static": jspec.SpecConfig(tree="static", tree_choices=((0,), (1,), (0, 0), (0, 1), (0, 0, 0)))}


@pytest.fixture(scope="module")
def target():
    return fx.near_bigram_target()


def dflash_engine(target, spec, max_batch_size=4, model=MODEL, **drafter_kwargs):
    drafter = DFlashDrafter(model, fx.TARGET, spec, fx.MAX_SEQ_LEN, **drafter_kwargs)
    return jspec.SpecEngine(fx.TARGET, target, drafter=drafter,
                            drafter_params=init_dflash_params(model, jax.random.key(3)),
                            max_batch_size=max_batch_size, max_seq_len=fx.MAX_SEQ_LEN)


@pytest.mark.parametrize("tree", ["chain", "static", "dynamic"])
def test_greedy_output_equals_plain_decoding(target, tree):
    plain = fx.plain_engine(target).generate(RAGGED, max_new_tokens=33).token_ids
    engine = dflash_engine(target, SPECS[tree])
    out = engine.generate(RAGGED, max_new_tokens=33)
    assert out.token_ids == plain
    assert out.stats.num_verify_steps > 0


def test_forced_acceptance_commits_the_whole_block(target):
    engine = dflash_engine(target, SPECS["chain"]).forcing_acceptance(4)
    out = engine.generate(RAGGED, max_new_tokens=1 + 3 * 5)
    assert out.stats.acceptance_length == 5 and all(len(t) == 16 for t in out.token_ids)


def test_a_tree_deeper_than_the_block_is_refused():
    with pytest.raises(ValueError, match="depth 5 is deeper than the dflash block drafts"):
        DFlashDrafter(MODEL, fx.TARGET, jspec.SpecConfig(tree="chain", num_steps=5), fx.MAX_SEQ_LEN)


def test_dspark_greedy_output_equals_plain_decoding_under_its_confidence_cut(target):
    """Every slot drafts (a chain of block_size = 4) through the Markov scan; cut at a confidence of 0.5, rows
    propose nothing or only a short chain at times, and the output is still plain decoding's."""
    plain = fx.plain_engine(target).generate(RAGGED, max_new_tokens=33).token_ids
    chain = jspec.SpecConfig(tree="chain", num_steps=4)
    engine = dflash_engine(target, chain, model=DSPARK, confidence_threshold=0.5, short_drafts=2)
    assert engine.generate(RAGGED, max_new_tokens=33).token_ids == plain
    with pytest.raises(ValueError, match="not tree='static'"):
        DFlashDrafter(DSPARK, fx.TARGET, SPECS["static"], fx.MAX_SEQ_LEN)


def test_dspark_dynamic_tree_greedy_equals_plain_decoding(target):
    """The best-first tree with each node's children biased by its own token (the Markov head)."""
    plain = fx.plain_engine(target).generate(RAGGED, max_new_tokens=33).token_ids
    assert dflash_engine(target, SPECS["dynamic"], model=DSPARK).generate(RAGGED, max_new_tokens=33).token_ids == plain
