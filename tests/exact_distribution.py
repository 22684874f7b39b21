"""The exact distribution of a tiny target's first three generated tokens, and the chi-square test of samples
against it: how every sampled speculative path is proven lossless (tests/jspec/test_*sampling*, test_draft_model).

A vocabulary of a handful of tokens lets p(x1, x2, x3 | prompt) be enumerated from the target itself (V^2 forward
rows); thousands of rows generated in one batch are then counted per cell.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import scipy.stats

from jspec.sampling import SamplingArrays, sampling_probs
from models.attention import KVCache
from models.config import ModelConfig
from models.llama import LlamaModel

# A target small enough to enumerate (216 cells), with the prompt the tests continue.
TINY = ModelConfig(vocab_size=6, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                   head_dim=8)
PROMPT = [1, 4, 2]


def varied(params):
    """The weights doubled: a random target's next-token distributions become far from uniform."""
    return jax.tree.map(lambda a: a * 2.0 if a.ndim >= 2 else a, params)


def exact_triples(config: ModelConfig, params, prompt: list[int], temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0) -> np.ndarray:
    """p(x1, x2, x3 | prompt) under the given sampling settings, by enumeration: f64[V, V, V], summing to 1."""
    vocab = config.vocab_size
    seqs = np.array([list(prompt) + [a, b] for a in range(vocab) for b in range(vocab)], np.int32)
    cache = KVCache.zeros(config.num_layers, len(seqs), seqs.shape[1], config.num_kv_heads, config.head_dim,
                          jnp.float32)
    logits = LlamaModel(config).apply({"params": params}, jnp.asarray(seqs),
                                      jnp.broadcast_to(jnp.arange(seqs.shape[1]), seqs.shape), cache,
                                      jnp.zeros((len(seqs),), jnp.int32)).logits
    n = len(seqs)
    rows = SamplingArrays(jnp.full((n,), temperature), jnp.full((n,), top_k, jnp.int32), jnp.full((n,), top_p))
    probs = np.asarray(sampling_probs(logits, rows), np.float64)  # [V*V, P+2, V]
    first = probs[0, len(prompt) - 1]
    second = probs[::vocab, len(prompt)]                          # given x1 = a (rows a*V + 0)
    third = probs[:, len(prompt) + 1].reshape(vocab, vocab, vocab)
    joint = first[:, None, None] * second[:, :, None] * third
    return joint / joint.sum()


def assert_triples_follow(token_ids, joint: np.ndarray, what: str = "", min_cells: int = 50) -> None:
    """Chi-square of the counts of each row's first three tokens against ``joint`` [V, V, V] (cells expecting < 5
    samples pooled into one); no sample may fall where ``joint`` is 0 (outside top-k / top-p)."""
    triples = np.array([t[:3] for t in token_ids])
    counts = np.zeros(joint.shape)
    np.add.at(counts, tuple(triples.T), 1)
    assert counts[joint == 0].sum() == 0, f"{what}: a token outside the sampling support was emitted"
    expected, counts = joint.ravel() / joint.sum() * len(triples), counts.ravel()
    big = expected >= 5
    assert big.sum() >= min_cells, "the test distribution is too peaked to test anything"
    observed, expected = np.append(counts[big], counts[~big].sum()), np.append(expected[big], expected[~big].sum())
    keep = expected > 0  # the pooled cell is empty when every cell expects 0 or >= 5 (top-k / top-p)
    pvalue = scipy.stats.chisquare(observed[keep], expected[keep]).pvalue
    assert pvalue > 1e-3, (what, pvalue)
