"""Speculative sampling is lossless: the first three generated tokens follow the exact target distribution.

A small vocabulary (V=5) lets the joint distribution of three tokens be enumerated exactly from the target
(125 cells); thousands of sequences are generated in one batch and compared by chi-square, for every tree kind
and several sampling settings. The EAGLE-3 drafts are deterministic (top-k), so this exercises the
sample-at-every-node walk of pallas_kernels.tree_verify.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

import jspec
from jspec.drafters.eagle3 import Eagle3Drafter
from jspec.sampling import SamplingArrays, sampling_probs
from jspec.train.eagle3_head import distill_eagle3_head, make_batch
from models.attention import KVCache
from models.config import ModelConfig
from models.eagle3 import eagle3_config_from_hf, init_eagle3_params
from models.llama import LlamaModel, init_params

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


def exact_three_token_distribution(params, sampling_row) -> np.ndarray:
    """p(x1, x2, x3 | PROMPT) as f64[V, V, V] by enumerating all V^2 two-token continuations."""
    seqs = np.array([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)], np.int32)
    n, width = seqs.shape
    cache = KVCache.zeros(TARGET.num_layers, n, width, 1, 8, jnp.float32)
    logits = LlamaModel(TARGET).apply({"params": params}, jnp.asarray(seqs),
                                      jnp.broadcast_to(jnp.arange(width), seqs.shape), cache,
                                      jnp.zeros((n,), jnp.int32)).logits  # [V^2, width, V]
    t, k, p = sampling_row
    rows = SamplingArrays(jnp.full((n,), t), jnp.full((n,), k, jnp.int32), jnp.full((n,), p))
    probs = np.asarray(sampling_probs(logits[:, -3:], rows), np.float64).reshape(VOCAB, VOCAB, 3, VOCAB)
    p1 = probs[0, 0, 0]                    # after PROMPT
    p2 = probs[:, 0, 1]                    # [x1, x2] after PROMPT + x1
    p3 = probs[:, :, 2]                    # [x1, x2, x3]
    joint = p1[:, None, None] * p2[:, :, None] * p3
    return joint / joint.sum()


@pytest.fixture(scope="module")
def models():
    """A target with varied distributions and a head distilled on its samples (so drafts get accepted)."""
    params = init_params(TARGET, jax.random.key(7))
    params = jax.tree.map(lambda a: a * 2.0 if a.ndim >= 2 else a, params)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, 4).tolist() for _ in range(32)]
    plain = jspec.SpecEngine(TARGET, params, max_batch_size=32, max_seq_len=48)
    generated = plain.generate(prompts, max_new_tokens=40, temperature=1.0).token_ids
    sequences = np.array([p + g for p, g in zip(prompts, generated)], np.int32)
    batch = make_batch(params, TARGET, sequences, np.full(32, sequences.shape[1]))
    head, _ = distill_eagle3_head(init_eagle3_params(HEAD, jax.random.key(8)), params, batch, config=HEAD,
                                  steps=60, learning_rate=1e-2, unroll=2)
    return params, {"head": head, "d2t": jnp.zeros((VOCAB,), jnp.int32)}


@pytest.mark.parametrize("name, spec, sampling_row", CASES, ids=[c[0] for c in CASES])
def test_first_three_tokens_follow_the_target(models, name, spec, sampling_row):
    params, head = models
    drafter = Eagle3Drafter(HEAD, TARGET, spec, 16)
    engine = jspec.SpecEngine(TARGET, params, drafter=drafter, drafter_params=head, max_batch_size=ROWS,
                              max_seq_len=16)
    t, k, p = sampling_row
    out = engine.generate([PROMPT] * ROWS, max_new_tokens=3, temperature=t, top_k=k, top_p=p, seed=5)
    samples = np.array(out.token_ids)
    counts = np.zeros((VOCAB,) * 3)
    np.add.at(counts, tuple(samples.T), 1)
    expected = exact_three_token_distribution(params, sampling_row) * ROWS
    assert counts[expected == 0].sum() == 0, "a token outside the top-k/top-p support was emitted"
    assert out.stats.acceptance_length > 1.1, "drafts were never accepted: the test would prove nothing"
    # merge sparse cells so every bin expects >= 5 samples
    order = np.argsort(expected.ravel())
    small = expected.ravel()[order] < 5
    obs, exp = counts.ravel()[order], expected.ravel()[order]
    obs = np.append(obs[~small], obs[small].sum())
    exp = np.append(exp[~small], exp[small].sum())
    keep = exp > 0
    pvalue = scipy.stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue
    assert pvalue > 1e-3, (name, pvalue)
