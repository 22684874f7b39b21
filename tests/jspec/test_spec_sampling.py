"""Speculative sampling is lossless: the first three generated tokens follow the exact target distribution.

A small vocabulary (V=5) lets the joint distribution of three tokens be enumerated exactly from the target
(125 cells); thousands of sequences are generated in one batch and compared by chi-square, for every tree kind
and several sampling settings. The EAGLE-3 drafts are deterministic (top-k), so this exercises the
sample-at-every-node walk of pallas_kernels.tree_verify.
"""

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.drafters.eagle3 import Eagle3Drafter
from jspec.train.eagle3_head import distill_eagle3_head, make_batch
from models.config import ModelConfig
from models.eagle3 import eagle3_config_from_hf, init_eagle3_params
from models.llama import init_params
from models.quantization import quantize_params
from tests.exact_distribution import assert_triples_follow, exact_triples, varied

VOCAB = 5
TARGET = ModelConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_layers=3, num_heads=2,
                     num_kv_heads=1, head_dim=8)
HEAD = eagle3_config_from_hf({"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2,
                              "num_key_value_heads": 1, "vocab_size": VOCAB})
PROMPT = [3, 1, 4]
ROWS = 12000
CASES = [  # tree kind, spec, (temperature, top_k, top_p)
    ("chain", jspec.SpecConfig(tree="chain", num_steps=3), (1.0, 0, 1.0)),
    ("static", jspec.SpecConfig(tree="static", tree_choices=((0,), (1,), (0, 0), (1, 0), (0, 0, 0))),
     (0.7, 0, 1.0)),
    ("dynamic", jspec.SpecConfig(tree="dynamic", num_steps=3, topk=2, num_draft_tokens=6), (1.0, 3, 1.0)),
    ("dynamic-top-p", jspec.SpecConfig(tree="dynamic", num_steps=3, topk=2, num_draft_tokens=6), (0.7, 0, 0.8)),
]
PENALTIES = dict(presence=0.4, frequency=0.3, repetition=1.5, bias={2: 0.7})  # the logits processors' case


@pytest.fixture(scope="module")
def models():
    """A target with varied distributions and a head distilled on its samples (so drafts get accepted)."""
    params = init_params(TARGET, jax.random.key(7))
    params = varied(params)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, 4).tolist() for _ in range(32)]
    plain = jspec.SpecEngine(TARGET, params, max_batch_size=32, max_seq_len=48)
    generated = plain.generate(prompts, max_new_tokens=40, temperature=1.0).token_ids
    sequences = np.array([p + g for p, g in zip(prompts, generated)], np.int32)
    batch = make_batch(params, TARGET, sequences, np.full(32, sequences.shape[1]))
    head, _ = distill_eagle3_head(init_eagle3_params(HEAD, jax.random.key(8)), params, batch, config=HEAD,
                                  steps=60, learning_rate=1e-2, unroll=2)
    return params, {"head": head, "d2t": jnp.zeros((VOCAB,), jnp.int32)}


# slow: EAGLE-3 chain and static tree sampling chi-square (deterministic drafts), the dynamic tree with top-p;
# default tier: [dynamic] (top-k; the same verify path, the Gumbel-max walk)
@pytest.mark.parametrize("name, spec, sampling_row",
                         [pytest.param(*case, marks=pytest.mark.slow) if case[0] != "dynamic" else case
                          for case in CASES], ids=[c[0] for c in CASES])
def test_first_three_tokens_follow_the_target(models, name, spec, sampling_row):
    params, head = models
    drafter = Eagle3Drafter(HEAD, TARGET, spec, 16)
    engine = jspec.SpecEngine(TARGET, params, drafter=drafter, drafter_params=head, max_batch_size=ROWS,
                              max_seq_len=16)
    t, k, p = sampling_row
    out = engine.generate([PROMPT] * ROWS, max_new_tokens=3, temperature=t, top_k=k, top_p=p, seed=5)
    assert out.stats.acceptance_length > 1.1, "drafts were never accepted: the test would prove nothing"
    assert_triples_follow(out.token_ids, exact_triples(TARGET, params, PROMPT, t, k, p), name, min_cells=0)


# slow: sampling under penalties follows the processed target (chi-square); default tier: test_logits_processors (greedy
# per-node processing equals plain decoding and transformers)
@pytest.mark.slow
def test_first_three_tokens_follow_the_penalized_target(models):
    """Presence, frequency and repetition penalties and a logit bias, at T=1 through a dynamic tree: every node is
    processed with its own path's history, so the tokens follow the processed target's distribution, enumerated
    with the penalties written out plainly (tests/exact_distribution.penalized)."""
    params, head = models
    spec = jspec.SpecConfig(tree="dynamic", num_steps=3, topk=2, num_draft_tokens=6)
    engine = jspec.SpecEngine(TARGET, params, drafter=Eagle3Drafter(HEAD, TARGET, spec, 16), drafter_params=head,
                              max_batch_size=ROWS, max_seq_len=16)
    out = engine.generate([PROMPT] * ROWS, max_new_tokens=3, temperature=1.0, seed=6,
                          presence_penalty=PENALTIES["presence"], frequency_penalty=PENALTIES["frequency"],
                          repetition_penalty=PENALTIES["repetition"], logit_bias=PENALTIES["bias"])
    assert out.stats.acceptance_length > 1.1, "drafts were never accepted: the test would prove nothing"
    joint = exact_triples(TARGET, params, PROMPT, 1.0, processors=PENALTIES)
    assert_triples_follow(out.token_ids, joint, "penalized", min_cells=0)
    unpenalized = exact_triples(TARGET, params, PROMPT, 1.0)
    assert np.abs(joint - unpenalized).sum() > 0.2  # the penalties change the distribution the test checks


# slow: sampled speculation on int8 weights follows the quantized target's exact distribution (chi-square);
# default tier: the float chi-square tests (the same verify walk) and the quantized greedy cases
@pytest.mark.slow
def test_a_quantized_target_is_followed_exactly():
    """int8 weights (the drafter's too) through a dynamic tree at T=1: the tokens follow the quantized target's
    distribution, enumerated from the same quantized weights."""
    params = varied(init_params(TARGET, jax.random.key(7)))
    head = {"head": init_eagle3_params(HEAD, jax.random.key(8)), "d2t": jnp.zeros((VOCAB,), jnp.int32)}
    spec = jspec.SpecConfig(tree="dynamic", num_steps=3, topk=2, num_draft_tokens=6)
    engine = jspec.SpecEngine(TARGET, params, drafter=Eagle3Drafter(HEAD, TARGET, spec, 16), drafter_params=head,
                              max_batch_size=ROWS, max_seq_len=16, quantization="int8")
    out = engine.generate([PROMPT] * ROWS, max_new_tokens=3, temperature=1.0, seed=8)
    quantized = quantize_params(params, "int8")
    joint = exact_triples(TARGET, quantized, PROMPT, 1.0)
    assert np.abs(joint - exact_triples(TARGET, params, PROMPT, 1.0)).max() > 0  # the quantized target differs
    assert_triples_follow(out.token_ids, joint, "int8", min_cells=0)


# slow: sampled speculation on a mixture-of-experts target follows its exact distribution (chi-square); default tier:
# the float chi-square [dynamic] (the same verify walk) and test_moe's greedy speculation on a MoE target
@pytest.mark.slow
def test_a_mixture_of_experts_target_is_followed_exactly():
    """A Qwen3-MoE target (4 experts, 2 a token) through a dynamic tree at T=1: 12,000 rows of 3 tokens
    (36,000 routed tokens a verify) follow the target's distribution, enumerated from the same weights."""
    moe = dataclasses.replace(TARGET, model_type="qwen3_moe", qk_norm=True, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=16, norm_topk_prob=True)
    params = varied(init_params(moe, jax.random.key(9)))
    head = {"head": init_eagle3_params(HEAD, jax.random.key(8)), "d2t": jnp.zeros((VOCAB,), jnp.int32)}
    spec = jspec.SpecConfig(tree="dynamic", num_steps=3, topk=2, num_draft_tokens=6)
    engine = jspec.SpecEngine(moe, params, drafter=Eagle3Drafter(HEAD, moe, spec, 16), drafter_params=head,
                              max_batch_size=ROWS, max_seq_len=16)
    out = engine.generate([PROMPT] * ROWS, max_new_tokens=3, temperature=1.0, seed=9)
    assert out.stats.acceptance_length > 1.1, "drafts were never accepted: the test would prove nothing"
    assert_triples_follow(out.token_ids, exact_triples(moe, params, PROMPT, 1.0), "moe", min_cells=0)
