"""models/attention.py's grouped attention against jax.nn.dot_product_attention (softmax first, K/V heads
repeated by jax itself) on random inputs: GQA groups, arbitrary masks, a row that sees nothing, bf16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.attention import grouped_attention, masked_attention


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
