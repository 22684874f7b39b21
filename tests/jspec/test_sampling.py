"""The target's sampling distribution: equal to transformers' logits warpers, and what generate draws from."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import torch
from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

import jspec
from jspec.sampling import SamplingArrays, sampling_probs
from models.attention import KVCache
from models.config import ModelConfig
from models.llama import LlamaModel, init_params

ROWS = [  # temperature, top_k, top_p
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (0.9, 0, 0.8), (0.5, 7, 0.6), (1.0, 1, 1.0), (2.0, 40, 0.95),
]


def hf_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    scores = torch.tensor(logits)[None]
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, -1)[0].numpy()


def arrays(rows):
    t, k, p = zip(*rows)
    return SamplingArrays(jnp.asarray(t, jnp.float32), jnp.asarray(k, jnp.int32), jnp.asarray(p, jnp.float32))


def test_probs_match_transformers_warpers():
    logits = np.random.default_rng(0).normal(size=(len(ROWS), 50)).astype(np.float32) * 3
    got = np.asarray(sampling_probs(jnp.asarray(logits), arrays(ROWS)))
    for row, (t, k, p) in enumerate(ROWS):
        np.testing.assert_allclose(got[row], hf_probs(logits[row], t, k, p), atol=1e-6)


def test_unfiltered_rows_take_the_same_distribution_whatever_their_neighbours():
    """A row with top-k and top-p off gets the softmax of its scaled logits exactly, alone (the sort skipped) and
    beside a row that filters (the sort run): its tokens never depend on who else is in the batch."""
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(2, 4096)).astype(np.float32) * 4)
    alone = np.asarray(sampling_probs(logits[:1], arrays([(0.8, 0, 1.0)])))
    beside = np.asarray(sampling_probs(logits, arrays([(0.8, 0, 1.0), (0.8, 0, 0.5)])))
    np.testing.assert_array_equal(alone[0], beside[0])
    np.testing.assert_allclose(alone[0], np.asarray(jax.nn.softmax(logits[0] / 0.8)), rtol=1e-6)
    assert (beside[1] == 0).sum() > 0


def test_greedy_rows_are_one_hot_and_extra_axes_broadcast():
    logits = np.random.default_rng(1).normal(size=(2, 3, 9)).astype(np.float32)
    probs = np.asarray(sampling_probs(jnp.asarray(logits), arrays([(0.0, 0, 1.0), (0.8, 3, 1.0)])))
    np.testing.assert_array_equal(probs[0], np.eye(9)[logits[0].argmax(-1)])
    for t in range(3):
        np.testing.assert_allclose(probs[1, t], hf_probs(logits[1, t], 0.8, 3, 1.0), atol=1e-6)


def numpy_sampling_probs(logits, temperature, top_k, top_p):
    """Brute force for one row, in float64."""
    logits = np.asarray(logits, np.float64)
    vocab = len(logits)
    if temperature == 0:
        return np.eye(vocab)[np.argmax(logits)]
    z = logits / temperature
    if 0 < top_k < vocab:
        z = np.where(z >= np.sort(z)[::-1][top_k - 1], z, -np.inf)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if top_p < 1:
        kept, mass = [], 0.0
        for token in np.argsort(-probs, kind="stable"):
            kept.append(token)
            mass += probs[token]
            if mass >= top_p:
                break
        probs = np.where(np.isin(np.arange(vocab), kept), probs, 0.0)
    return probs / probs.sum()


@pytest.mark.parametrize("shape", [(6, 11), (6, 3, 7)])
def test_sampling_probs_matches_numpy(shape):
    rng = np.random.default_rng(len(shape))
    logits = rng.normal(0, 2, shape).astype(np.float32)
    temperature = np.array([0.0, 1.0, 0.7, 1.3, 2.0, 0.5], np.float32)
    top_k = np.array([3, 0, 2, 0, 4, 100], np.int32)
    top_p = np.array([0.5, 1.0, 1.0, 0.6, 0.9, 0.3], np.float32)
    probs = np.asarray(sampling_probs(jnp.asarray(logits), SamplingArrays(jnp.asarray(temperature), jnp.asarray(top_k), jnp.asarray(top_p))))
    for b in range(shape[0]):
        for idx in np.ndindex(shape[1:-1]):
            expected = numpy_sampling_probs(logits[(b,) + idx], temperature[b], top_k[b], top_p[b])
            np.testing.assert_allclose(probs[(b,) + idx], expected, atol=1e-6)


TINY = ModelConfig(vocab_size=6, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                   head_dim=8)


def exact_joint(params, prompt, sampling_row):
    """p(x1, x2 | prompt) by enumeration: [V, V]."""
    model, vocab = LlamaModel(TINY), TINY.vocab_size
    seqs = np.array([list(prompt) + [x] for x in range(vocab)])
    cache = KVCache.zeros(2, vocab, 16, 1, 8, jnp.float32)
    logits = model.apply({"params": params}, jnp.asarray(seqs), jnp.broadcast_to(jnp.arange(seqs.shape[1]),
                         seqs.shape), cache, jnp.zeros((vocab,), jnp.int32)).logits
    params_rows = arrays([sampling_row] * vocab)
    first = np.asarray(sampling_probs(logits[:1, -2], arrays([sampling_row])))[0]
    second = np.asarray(sampling_probs(logits[:, -1], params_rows))
    return first[:, None] * second


# slow: [sampling_row0] (two sampled tokens at temperature 1 follow the target's joint distribution, chi-square);
# default tier: [sampling_row1] (temperature, top-k and top-p)
@pytest.mark.parametrize("sampling_row", [pytest.param((1.0, 0, 1.0), marks=pytest.mark.slow), (0.7, 3, 0.9)])
def test_generated_pairs_follow_the_exact_target_distribution(sampling_row):
    params = init_params(TINY, jax.random.key(4))
    params = jax.tree.map(lambda a: a * 2.0 if a.ndim >= 2 else a, params)  # varied, non-uniform distributions
    prompt, rows = [1, 4, 2], 20000
    engine = jspec.SpecEngine(TINY, params, max_batch_size=rows, max_seq_len=16)
    t, k, p = sampling_row
    out = engine.generate([prompt] * rows, max_new_tokens=2, temperature=t, top_k=k, top_p=p, seed=11)
    pairs = np.array(out.token_ids)
    counts = np.zeros((6, 6))
    np.add.at(counts, (pairs[:, 0], pairs[:, 1]), 1)
    joint = exact_joint(params, prompt, sampling_row).astype(np.float64)
    expected = joint / joint.sum() * rows
    assert counts[expected == 0].sum() == 0, "sampled a token outside the top-k/top-p support"
    support = expected > 0
    assert support.sum() >= 5, "the test distribution is too peaked to test anything"
    pvalue = scipy.stats.chisquare(counts[support], expected[support]).pvalue
    assert pvalue > 1e-3, (pvalue, counts, expected)


def test_seeded_runs_repeat():
    params = init_params(TINY, jax.random.key(5))
    engine = jspec.SpecEngine(TINY, params, max_batch_size=4, max_seq_len=32)
    prompts = [[1, 2], [3, 4, 5], [0]]
    a = engine.generate(prompts, max_new_tokens=10, temperature=1.0, seed=7).token_ids
    b = engine.generate(prompts, max_new_tokens=10, temperature=1.0, seed=7).token_ids
    c = engine.generate(prompts, max_new_tokens=10, temperature=1.0, seed=8).token_ids
    assert a == b and a != c
