"""The DFlash and DSpark drafters (jspec/drafters/dflash.py) in the engine: greedy output equal to plain decoding
for a chain of the block, a per-position top-k static tree, and DSpark's Markov chain with its confidence cut;
forced acceptance commits whole blocks. Drafts are deterministic (top-k), verified as every such drafter's."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jspec
from jspec.drafters.dflash import DFlashDrafter
from jspec.train.dflash import block_metrics, init_from_target
from models.dflash import DFlashConfig, init_dflash_params
from models.config import ModelConfig
from models.llama import init_params
from tests import spec_fixtures as fx
from tests.exact_distribution import TINY, assert_triples_follow, exact_triples, varied

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


# slow: DSpark's best-first tree with Markov-biased children greedy = plain; default tier: test_dflash's [dynamic] (the
# same search), the DSpark chain test (the same bias)
@pytest.mark.slow
def test_dspark_dynamic_tree_greedy_equals_plain_decoding(target):
    """The best-first tree with each node's children biased by its own token (the Markov head)."""
    plain = fx.plain_engine(target).generate(RAGGED, max_new_tokens=33).token_ids
    assert dflash_engine(target, SPECS["dynamic"], model=DSPARK).generate(RAGGED, max_new_tokens=33).token_ids == plain


# --- sampling: the block's top-k drafts verified by the sample-at-every-node walk ------------------------------

SMALL = ModelConfig(vocab_size=6, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                    head_dim=8, model_type="qwen3", qk_norm=True)
SAMPLED = {  # name -> (draft model, spec, drafter kwargs, (temperature, top_k, top_p))
    "dflash-chain": (DFlashConfig(SMALL, block_size=4, mask_token_id=5, target_layer_ids=(0,),
                                  target_hidden_size=16), jspec.SpecConfig(tree="chain", num_steps=3), {},
                     (1.0, 0, 1.0)),
    "dflash-dynamic": (DFlashConfig(SMALL, block_size=4, mask_token_id=5, target_layer_ids=(0,),
                                    target_hidden_size=16),
                       jspec.SpecConfig(tree="dynamic", num_steps=3, topk=2, num_draft_tokens=6), {}, (1.0, 4, 1.0)),
    "dspark-cut": (DFlashConfig(SMALL, block_size=3, mask_token_id=5, target_layer_ids=(-1, 0),
                                target_hidden_size=16, layout="dspark", markov_rank=4, confidence_head=True),
                   jspec.SpecConfig(tree="chain", num_steps=3), dict(confidence_threshold=0.5, short_drafts=1),
                   (1.0, 0, 1.0)),
}


@pytest.fixture(scope="module")
def sampled_text():
    """(a tiny target with far-from-uniform distributions, i32[32, 44] of its sampled text)."""
    target = varied(init_params(TINY, jax.random.key(11)))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, TINY.vocab_size, 4).tolist() for _ in range(32)]
    plain = jspec.SpecEngine(TINY, target, max_batch_size=32, max_seq_len=48)
    generated = plain.generate(prompts, max_new_tokens=40, temperature=1.0, seed=0).token_ids
    return target, jnp.asarray([p + g for p, g in zip(prompts, generated)], jnp.int32)


def distilled(model: DFlashConfig, target, windows: jax.Array) -> dict:
    """A block drafter trained briefly (``block_metrics``' loss, full-batch Adam) on the target's sampled text, so
    its drafts are accepted often enough for the test to mean something."""
    loss = functools.partial(block_metrics, windows=windows, params_t=target, target=TINY, config=model,
                             num_anchors=16, gamma=7.0)
    optimizer = optax.adam(1e-2)

    @jax.jit
    def update(params, state):
        grads = jax.grad(lambda p: loss(p).loss)(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params = init_from_target(model, target, jax.random.key(5))
    state = optimizer.init(params)
    for _ in range(100):
        params, state = update(params, state)
    return params


# slow: DFlash chains and dynamic trees and DSpark under its confidence cut, sampled at T=1, follow the target's exact
# distribution (chi-square); default tier: test_spec_sampling (the same verify walk over deterministic drafts) and
# test_draft_model's shortened chain (rows drafting part of the chain)
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SAMPLED))
def test_sampled_tokens_follow_the_exact_target_distribution(sampled_text, name):
    """x1 from prefill, x2 and x3 from verify steps over the block's drafts: counts of (x1, x2, x3) over 12000
    rows against the target's enumerated joint (DSpark: under its confidence cut, rows drafting fewer tokens). The
    prompt is ten tokens of the drafter's training text: a context it drafts well from."""
    model, spec, kwargs, (temperature, top_k, top_p) = SAMPLED[name]
    target, windows = sampled_text
    prompt = np.asarray(windows[0, :10]).tolist()
    rows = 12000
    drafter = DFlashDrafter(model, TINY, spec, 16, **kwargs)
    engine = jspec.SpecEngine(TINY, target, drafter=drafter, drafter_params=distilled(model, target, windows),
                              max_batch_size=rows, max_seq_len=16)
    out = engine.generate([prompt] * rows, max_new_tokens=3, temperature=temperature, top_k=top_k, top_p=top_p,
                          seed=3)
    assert 1.3 < out.stats.acceptance_length < spec.max_depth + 1  # drafts both accepted and rejected
    assert_triples_follow(out.token_ids, exact_triples(TINY, target, prompt, temperature, top_k, top_p), name,
                          min_cells=40)
