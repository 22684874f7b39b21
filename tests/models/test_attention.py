"""models/attention.py's grouped attention against jax.nn.dot_product_attention (softmax first, K/V heads
repeated by jax itself) on random inputs: GQA groups, arbitrary masks, a row that sees nothing, bf16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.attention import grouped_attention, masked_attention, recent_attention


def _inputs(seed, batch=2, num_new=5, slots=37, heads=8, kv_heads=2, head_dim=16, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(batch, num_new, heads, head_dim)), dtype)
    k = jnp.asarray(rng.normal(size=(batch, slots, kv_heads, head_dim)), dtype)
    v = jnp.asarray(rng.normal(size=(batch, slots, kv_heads, head_dim)), dtype)
    mask = rng.random((batch, num_new, slots)) < 0.6
    mask[:, :, 0] = True
    return q, k, v, jnp.asarray(mask)


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (6, 1)])
def test_equals_jax_dot_product_attention(heads, kv_heads):
    q, k, v, mask = _inputs(0, heads=heads, kv_heads=kv_heads)
    ours = grouped_attention(q, k, v, mask, scale=0.3)
    reference = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=0.3)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(reference), rtol=2e-5, atol=2e-6)


def test_row_that_sees_nothing_is_finite_as_jax():
    q, k, v, mask = _inputs(1)
    mask = mask.at[1, 2].set(False)
    ours = grouped_attention(q, k, v, mask, scale=0.25)
    reference = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=0.25)
    assert np.isfinite(np.asarray(ours)).all()
    np.testing.assert_allclose(np.asarray(ours), np.asarray(reference), rtol=2e-5, atol=2e-6)


def test_unread_nan_slots_never_reach_the_output():
    q, k, v, mask = _inputs(2)
    unread = np.zeros(mask.shape[2], bool)
    unread[[3, 20, 36]] = True
    mask = mask & ~jnp.asarray(unread)[None, None]
    clean = masked_attention(q, k, v, mask, scale=0.25)
    k_nan = k.at[:, unread].set(jnp.nan)
    v_nan = v.at[:, unread].set(jnp.nan)
    out = masked_attention(q, k_nan, v_nan, mask, scale=0.25)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(clean))


def test_bf16_within_rounding_of_float32():
    q, k, v, mask = _inputs(3, dtype=jnp.bfloat16)
    ours = grouped_attention(q, k, v, mask, scale=0.25)
    assert ours.dtype == jnp.bfloat16
    exact = jax.nn.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)), mask=mask[:, None],
                                         scale=0.25)
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(exact), atol=3e-2)


def _window_case(seed, cache_len, *, num_new, window, write_offset, cache_size, recent, kv_heads=2, heads=4):
    """Inputs as a drafter's window hands them to attention, and a float64 oracle: each query reads the
    ``recent`` committed slots before cache_len (fewer at the start) and the window slots its mask allows. Every
    other slot, older committed ones included, holds NaN."""
    rng = np.random.default_rng(seed)
    cache_len = np.asarray(cache_len, np.int32)
    batch, head_dim = len(cache_len), 8
    k = rng.standard_normal((batch, cache_size, kv_heads, head_dim))
    v = rng.standard_normal((batch, cache_size, kv_heads, head_dim))
    q = rng.standard_normal((batch, num_new, heads, head_dim))
    window_mask = None
    if window is not None:
        window_mask = rng.random((batch, num_new, window)) < 0.5
        window_mask[:, np.arange(num_new), write_offset + np.arange(num_new)] = True
    out = np.zeros_like(q)
    readable = np.zeros((batch, cache_size), bool)
    for b in range(batch):
        for t in range(num_new):
            seen_window = (np.flatnonzero(window_mask[b, t]) if window is not None
                           else np.arange(write_offset + t + 1))
            seen = np.concatenate([np.arange(max(0, cache_len[b] - recent), cache_len[b]), cache_len[b] + seen_window])
            readable[b, seen] = True
            for h in range(heads):
                scores = k[b, seen, h // (heads // kv_heads)] @ q[b, t, h] * 0.5
                weights = np.exp(scores - scores.max())
                out[b, t, h] = weights @ v[b, seen, h // (heads // kv_heads)] / weights.sum()
    k[~readable], v[~readable] = np.nan, np.nan
    arrays = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    mask = None if window_mask is None else jnp.asarray(window_mask)
    return arrays, jnp.asarray(cache_len), mask, out


@pytest.mark.parametrize("window,write_offset,num_new,cache_size", [
    (7, 3, 2, 64),     # a drafter's depth written inside its window: slices recent + 7 slots
    (None, 0, 5, 64),  # a commit (causal continuation): slices recent + 5 slots
    (None, 0, 5, 12),  # recent + T reaches the cache size: reads the whole cache (cache_len <= recent there)
])
def test_recent_attention_reads_only_the_recent_slots_and_the_window(window, write_offset, num_new, cache_size):
    recent = 6
    cache_lens = [3, 20, cache_size - (window or num_new) - 1] if cache_size > 12 else [2, 6]
    (q, k, v), cache_len, mask, expected = _window_case(0, cache_lens, num_new=num_new, window=window,
                                                        write_offset=write_offset, cache_size=cache_size,
                                                        recent=recent)
    out = recent_attention(recent)(q, k, v, None, None, cache_len, mask, write_offset, scale=0.5)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-4, atol=1e-5)


def test_recent_attention_needs_a_positive_span():
    with pytest.raises(ValueError, match="recent=0"):
        recent_attention(0)
