"""Mixture-of-experts targets (models/moe.py): the grouped experts equal a loop over experts, and speculation on a
MoE target is lossless (greedy, float32) with every drafter kind, int8 weights included. (Logits against
transformers, and n-gram speculation returning transformers' greedy tokens: test_llama_vs_hf.)"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.drafters.draft_model import DraftModelDrafter
from jspec.drafters.eagle3 import Eagle3Drafter
from jspec.drafters.ngram import NgramDrafter
from models.llama import init_params
from models.moe import combine, route
from models.quantization import quantize_params
from tests import spec_fixtures as fx

MOE = dataclasses.replace(fx.TARGET, model_type="qwen3_moe", qk_norm=True, num_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=16, norm_topk_prob=True)


def test_grouped_experts_equal_a_loop_over_experts():
    """Tokens routed unevenly (some experts get none, one gets most) through ragged_dot = each expert on its rows,
    weighted; and the experts held in two shards (expert parallelism) add up to the same."""
    rng = np.random.default_rng(0)
    n, k, h, i, e = 11, 3, 8, 6, 6
    x = rng.normal(size=(n, h)).astype(np.float32)
    experts = rng.choice([0, 0, 0, 2, 3, 5], size=(n, k)).astype(np.int32)  # experts 1 and 4 get nothing
    weights = rng.uniform(size=(n, k)).astype(np.float32)
    gate, up = rng.normal(size=(2, e, h, i)).astype(np.float32)
    down = rng.normal(size=(e, i, h)).astype(np.float32)
    want = np.zeros_like(x)
    for t in range(n):
        for j in range(k):
            g, u = x[t] @ gate[experts[t, j]], x[t] @ up[experts[t, j]]
            want[t] += weights[t, j] * ((g / (1 + np.exp(-g)) * u) @ down[experts[t, j]])
    args = [jnp.asarray(a) for a in (x, weights, experts)]
    np.testing.assert_allclose(np.asarray(combine(*args, gate, up, down)), want, rtol=1e-5, atol=1e-5)
    halves = sum(np.asarray(combine(*args, gate[s], up[s], down[s], first_expert=s.start))
                 for s in (slice(0, 3), slice(3, 6)))
    np.testing.assert_allclose(halves, want, rtol=1e-5, atol=1e-5)
    # two tokens (6 assignments, fewer than the experts): the routed experts gathered, the others unused
    few = [a[:2] for a in args]
    junk = np.where(np.isin(np.arange(e), experts[:2]), 0.0, 1e3).astype(np.float32)[:, None, None]
    np.testing.assert_allclose(np.asarray(combine(*few, gate + junk, up + junk, down + junk)), want[:2], rtol=1e-5,
                               atol=1e-5)


def test_routing_keeps_the_top_k_and_renormalises():
    logits = jnp.asarray([[0.0, 2.0, 1.0, -1.0]])
    weights, experts = route(logits, 2, normalize=True)
    assert experts.tolist() == [[1, 2]]
    probs = np.exp([2.0, 1.0]) / np.exp([0.0, 2.0, 1.0, -1.0]).sum()
    np.testing.assert_allclose(np.asarray(weights), [probs / probs.sum()], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(route(logits, 2, normalize=False)[0]), [probs], rtol=1e-6)


def near_bigram_moe() -> dict:
    params = init_params(MOE, jax.random.key(0))
    params["layers"]["self_attn"]["o_proj"]["kernel"] = params["layers"]["self_attn"]["o_proj"]["kernel"] * 0.05
    params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 6.0  # near-bigram: drafts get accepted
    return params


@pytest.fixture(scope="module")
def moe_params():
    return near_bigram_moe()


def drafters(params):
    chain = fx.SPECS["chain"]
    return {"ngram-chain": (NgramDrafter(chain, fx.MAX_SEQ_LEN), {}),
            "eagle3-dynamic": (Eagle3Drafter(fx.HEAD, MOE, fx.SPECS["dynamic"], fx.MAX_SEQ_LEN), fx.random_head()),
            "draft-model-chain": (DraftModelDrafter(MOE, MOE, chain, fx.MAX_SEQ_LEN), params)}


# slow: the near-bigram MoE (drafts accepted) in int8 with EAGLE-3's dynamic tree and the draft model's chain;
# default tier: test_llama_vs_hf's converted Qwen3-MoE speculating transformers' tokens (n-gram),
# test_int8_experts_are_quantized_and_the_router_is_not, test_quantized_engine's int8 speculation on a dense target
@pytest.mark.slow
def test_speculation_on_an_int8_moe_target_equals_plain_decoding(moe_params):
    """(In float32, EAGLE-3 on a MoE: test_moe_mesh's one-device engines, test_moe_drafters.)"""
    prompts = [[5, 9, 5, 9, 5, 9, 12], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [7]]
    kwargs = dict(max_batch_size=4, max_seq_len=fx.MAX_SEQ_LEN, quantization="int8")
    plain = jspec.SpecEngine(MOE, moe_params, **kwargs).generate(prompts, max_new_tokens=24).token_ids
    for name in ("eagle3-dynamic", "draft-model-chain"):  # (n-gram on a MoE: test_llama_vs_hf, default tier)
        drafter, drafter_params = drafters(moe_params)[name]
        out = jspec.SpecEngine(MOE, moe_params, drafter=drafter, drafter_params=drafter_params,
                               **kwargs).generate(prompts, max_new_tokens=24)
        assert out.token_ids == plain, name
        if name == "draft-model-chain":  # the target drafting for itself: every draft accepted
            assert out.stats.acceptance_length > 4.0, out.stats


# slow: gpt-oss's int8 experts (with their biases) under EAGLE-3's dynamic tree; default tier: as above
@pytest.mark.slow
def test_speculation_on_an_int8_gpt_oss_target_equals_plain_decoding():
    from tests.models.test_windowed_speculation import WINDOWED, near_bigram
    config = WINDOWED["gpt_oss"]
    params = near_bigram(config)
    prompts = [[5, 9, 5, 9, 5, 9, 12], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [7]]
    kwargs = dict(max_batch_size=4, max_seq_len=fx.MAX_SEQ_LEN, quantization="int8")
    plain = jspec.SpecEngine(config, params, **kwargs).generate(prompts, max_new_tokens=24).token_ids
    drafter = Eagle3Drafter(fx.HEAD, config, fx.SPECS["dynamic"], fx.MAX_SEQ_LEN)
    out = jspec.SpecEngine(config, params, drafter=drafter, drafter_params=fx.random_head(), **kwargs)
    assert out.generate(prompts, max_new_tokens=24).token_ids == plain


def test_int8_experts_are_quantized_and_the_router_is_not(moe_params):
    quantized = quantize_params(moe_params, "int8")["layers"]["mlp"]
    assert quantized["experts"]["gate_proj"]["kernel"].qvalue.dtype == jnp.int8
    assert quantized["experts"]["gate_proj"]["kernel"].scale.shape == (MOE.num_layers, MOE.num_experts, 1, 16)
    assert quantized["gate"]["kernel"].dtype == jnp.float32
