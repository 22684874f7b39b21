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


def penalized(logits: np.ndarray, prompt: list[int], output: list[int], presence: float = 0.0,
              frequency: float = 0.0, repetition: float = 1.0, bias: dict[int, float] | None = None) -> np.ndarray:
    """One position's logits f[V] after vLLM's penalties and logit_bias, written out plainly (the oracle of
    jspec.logits_processors): repetition on the tokens of prompt and output, then frequency and presence on the
    output's, then the bias."""
    logits = np.array(logits, np.float64)
    counts = np.bincount(np.asarray(output, np.int64), minlength=len(logits)).astype(np.float64)
    repeated = (counts > 0) | np.isin(np.arange(len(logits)), prompt)
    logits = np.where(repeated, np.where(logits > 0, logits / repetition, logits * repetition), logits)
    logits = logits - frequency * counts - presence * (counts > 0)
    for token, value in (bias or {}).items():
        logits[token] += value
    return logits


def exact_triples(config: ModelConfig, params, prompt: list[int], temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0, processors: dict | None = None) -> np.ndarray:
    """p(x1, x2, x3 | prompt) under the given sampling settings, by enumeration: f64[V, V, V], summing to 1.
    processors: :func:`penalized`'s keyword arguments, applied at each position with its own output so far."""
    vocab = config.vocab_size
    seqs = np.array([list(prompt) + [a, b] for a in range(vocab) for b in range(vocab)], np.int32)
    cache = KVCache.for_model(config, len(seqs), seqs.shape[1], jnp.float32, per_layer=not config.uniform_layers)
    logits = LlamaModel(config).apply({"params": params}, jnp.asarray(seqs),
                                      jnp.broadcast_to(jnp.arange(seqs.shape[1]), seqs.shape), cache,
                                      jnp.zeros((len(seqs),), jnp.int32)).logits
    n = len(seqs)
    if processors:
        logits = np.asarray(logits, np.float64).copy()
        for row, seq in enumerate(seqs):
            for i in range(3):  # the positions predicting x1, x2, x3: the output so far is seq's first i new tokens
                at = len(prompt) - 1 + i
                logits[row, at] = penalized(logits[row, at], prompt, list(seq[len(prompt):len(prompt) + i]),
                                            **processors)
        logits = jnp.asarray(logits, jnp.float32)
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
