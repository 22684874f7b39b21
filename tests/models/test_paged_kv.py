"""models/paged_kv.py: attention over a paged cache against jax.nn.dot_product_attention over the same K/V laid out
densely (pages in shuffled order, the null page in padding, NaN in pages nobody may read, ragged lengths, GQA, tree
and causal masks, float32 and bf16), and its writes and moves against the dense buffer's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.attention import dense_attention
from models.paged_kv import PagedKV, move_paged, paged_attention, read_paged, write_paged

PAGE = 4


def _paged_case(seed, *, batch=3, num_new=5, heads=8, kv_heads=2, head_dim=16, pages_per_row=6, dtype=jnp.float32):
    """A pool whose rows own shuffled pages, NaN everywhere no row may read -> (q, k_cache, v_cache, k_new, v_new,
    cache_len, dense prefix k, v [B, P * PAGE, Hkv, D])."""
    rng = np.random.default_rng(seed)
    cache_len = rng.integers(1, pages_per_row * PAGE - num_new, size=batch).astype(np.int32)
    cache_len[0] = 1
    num_pages = 1 + batch * pages_per_row + 3
    order = rng.permutation(np.arange(1, num_pages))
    table = np.zeros((batch, pages_per_row), np.int32)
    k_pool = np.full((num_pages, PAGE, kv_heads, head_dim), np.nan, np.float32)
    v_pool = np.full_like(k_pool, np.nan)
    dense_k = rng.normal(size=(batch, pages_per_row * PAGE, kv_heads, head_dim)).astype(np.float32)
    dense_v = rng.normal(size=dense_k.shape).astype(np.float32)
    taken = 0
    for b in range(batch):
        used = -(-int(cache_len[b]) // PAGE)  # the rest of the row's table: the null page (NaN too)
        table[b, :used] = order[taken:taken + used]
        taken += used
        for column in range(used):
            k_pool[table[b, column]] = dense_k[b, column * PAGE:(column + 1) * PAGE]
            v_pool[table[b, column]] = dense_v[b, column * PAGE:(column + 1) * PAGE]
            past = np.arange(column * PAGE, (column + 1) * PAGE) >= cache_len[b]
            k_pool[table[b, column], past] = np.nan  # the last page's slots past the length: unread
            v_pool[table[b, column], past] = np.nan
    q = rng.normal(size=(batch, num_new, heads, head_dim))
    k_new = rng.normal(size=(batch, num_new, kv_heads, head_dim))
    v_new = rng.normal(size=(batch, num_new, kv_heads, head_dim))
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return (cast(q), PagedKV(cast(k_pool), jnp.asarray(table)), PagedKV(cast(v_pool), jnp.asarray(table)),
            cast(k_new), cast(v_new), jnp.asarray(cache_len), cast(dense_k), cast(dense_v))


def _tree_mask(seed, batch, num_new):
    rng = np.random.default_rng(seed)
    mask = np.eye(num_new, dtype=bool)[None].repeat(batch, 0)
    for b in range(batch):
        for node in range(1, num_new):
            parent = rng.integers(0, node)
            mask[b, node] |= mask[b, parent]
    return jnp.asarray(mask)


def _oracle(q, dense_k, dense_v, k_new, v_new, cache_len, mask, scale):
    """jax.nn.dot_product_attention over concat(prefix, new) with the prefix's length mask beside ``mask``."""
    batch, num_new = q.shape[:2]
    slots = dense_k.shape[1]
    committed = jnp.arange(slots)[None, None] < cache_len[:, None, None]
    full = jnp.concatenate([jnp.broadcast_to(committed, (batch, num_new, slots)), mask], axis=2)
    keys = jnp.concatenate([dense_k, k_new], axis=1).astype(jnp.float32)
    values = jnp.concatenate([dense_v, v_new], axis=1).astype(jnp.float32)
    return jax.nn.dot_product_attention(q.astype(jnp.float32), keys, values, mask=full[:, None], scale=scale)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)])
@pytest.mark.parametrize("heads,kv_heads,masked", [(8, 2, "tree"), (4, 4, "causal"), (6, 1, "tree")])
def test_paged_attention_equals_dense_attention_over_the_same_tokens(dtype, tol, heads, kv_heads, masked):
    q, k_cache, v_cache, k_new, v_new, cache_len, dense_k, dense_v = _paged_case(
        3, heads=heads, kv_heads=kv_heads, dtype=dtype)
    batch, num_new = q.shape[:2]
    mask = _tree_mask(4, batch, num_new) if masked == "tree" else None
    ours = paged_attention(q, k_cache, v_cache, k_new, v_new, cache_len, mask, 0, scale=0.3)
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((num_new, num_new), bool)), (batch, num_new, num_new))
    reference = _oracle(q, dense_k, dense_v, k_new, v_new, cache_len, causal if mask is None else mask, 0.3)
    assert ours.dtype == dtype and np.isfinite(np.asarray(ours, np.float32)).all()
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(reference), rtol=tol, atol=tol)


def _window_sink_oracle(q, dense_k, dense_v, k_new, v_new, cache_len, mask, scale, window, sinks):
    """Per query, in numpy, as transformers' eager gpt-oss attention reads it: the keys at positions > its position
    - window among the prefix and its tree ancestors, scores with the head's sink logit appended, softmax, the sink's
    share dropped."""
    q, dense_k, dense_v, k_new, v_new, mask = (np.asarray(a, np.float64) if a.dtype != bool else np.asarray(a)
                                               for a in (q, dense_k, dense_v, k_new, v_new, mask))
    batch, num_new, heads, _ = q.shape
    group = heads // k_new.shape[2]
    out = np.zeros(q.shape)
    for b in range(batch):
        length = int(cache_len[b])
        depth = mask[b].sum(1) - 1
        for i in range(num_new):
            position = length + depth[i]
            prefix = [p for p in range(length) if p > position - window]
            nodes = [j for j in range(num_new) if mask[b, i, j] and depth[i] - depth[j] < window]
            keys = np.concatenate([dense_k[b, prefix], k_new[b, nodes]])
            values = np.concatenate([dense_v[b, prefix], v_new[b, nodes]])
            for h in range(heads):
                scores = np.append(keys[:, h // group] @ q[b, i, h] * scale, sinks[h])
                weights = np.exp(scores - scores.max())
                out[b, i, h] = (weights[:-1] / weights.sum()) @ values[:, h // group]
    return out


@pytest.mark.parametrize("masked", ["tree", "causal"])
def test_sliding_window_and_sinks_paged_and_dense_equal_a_per_query_reference(masked):
    """A window of 6 positions (shorter than most rows' prefixes) and a sink per head: paged_attention and
    dense_attention (the prefix and the new tokens in one buffer) both equal the per-query reference."""
    q, k_cache, v_cache, k_new, v_new, cache_len, dense_k, dense_v = _paged_case(7, heads=4, kv_heads=2)
    batch, num_new = q.shape[:2]
    mask = _tree_mask(8, batch, num_new) if masked == "tree" else None
    full = jnp.broadcast_to(jnp.tril(jnp.ones((num_new, num_new), bool)), (batch, num_new, num_new))
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
    want = _window_sink_oracle(q, dense_k, dense_v, k_new, v_new, cache_len, full if mask is None else mask, 0.3,
                               6, sinks)
    paged = paged_attention(q, k_cache, v_cache, k_new, v_new, cache_len, mask, 0, scale=0.3, window=6, sinks=sinks)
    np.testing.assert_allclose(np.asarray(paged), want, rtol=2e-5, atol=2e-5)
    rows = jnp.arange(batch)[:, None]
    cache_k = jnp.pad(dense_k, ((0, 0), (0, num_new), (0, 0), (0, 0))).at[rows, cache_len[:, None] + jnp.arange(
        num_new)].set(k_new)
    cache_v = jnp.pad(dense_v, ((0, 0), (0, num_new), (0, 0), (0, 0))).at[rows, cache_len[:, None] + jnp.arange(
        num_new)].set(v_new)
    dense = dense_attention(q, cache_k, cache_v, k_new, v_new, cache_len, mask, 0, scale=0.3, window=6, sinks=sinks)
    np.testing.assert_allclose(np.asarray(dense), want, rtol=2e-5, atol=2e-5)
    unwindowed = paged_attention(q, k_cache, v_cache, k_new, v_new, cache_len, mask, 0, scale=0.3, sinks=sinks)
    assert np.abs(np.asarray(unwindowed) - want).max() > 1e-2  # the window binds in this case


def test_paged_attention_refuses_a_window_it_cannot_read_from_the_new_tokens():
    q, k_cache, v_cache, k_new, v_new, cache_len, _, _ = _paged_case(5)
    wide = jnp.ones((q.shape[0], q.shape[1], q.shape[1] + 2), bool)
    with pytest.raises(ValueError, match="window of T=5"):
        paged_attention(q, k_cache, v_cache, k_new, v_new, cache_len, wide, 0, scale=0.3)
    with pytest.raises(ValueError, match="write_offset"):
        paged_attention(q, k_cache, v_cache, k_new, v_new, cache_len, None, jnp.int32(0), scale=0.3)


def test_writes_and_moves_through_the_table_match_the_dense_buffer():
    rng = np.random.default_rng(6)
    batch, pages_per_row, heads, dim = 3, 4, 2, 8
    table = np.zeros((batch, pages_per_row + 1), np.int32)  # one column past each row's pages: the null page
    table[:, :pages_per_row] = rng.permutation(np.arange(1, 1 + batch * pages_per_row)).reshape(batch, -1)
    paged = PagedKV(jnp.zeros((1 + batch * pages_per_row, PAGE, heads, dim)), jnp.asarray(table))
    dense = jnp.zeros((batch, pages_per_row * PAGE, heads, dim))
    start = jnp.asarray([0, 5, 9], jnp.int32)
    new = jnp.asarray(rng.normal(size=(batch, 6, heads, dim)), jnp.float32)
    paged = write_paged(paged, new, start)
    rows = jnp.arange(batch)[:, None]
    dense = dense.at[rows, start[:, None] + jnp.arange(6)].set(new)
    source = start[:, None] + jnp.asarray([[0, 2, 5], [0, 1, 3], [0, 4, 5]])  # an accepted path, root first
    target = start[:, None] + jnp.arange(3)
    paged = move_paged(paged, source, target)
    dense = dense.at[rows, target].set(dense[rows, source])
    positions = jnp.broadcast_to(jnp.arange(pages_per_row * PAGE), (batch, pages_per_row * PAGE))
    np.testing.assert_array_equal(np.asarray(read_paged(paged, positions)), np.asarray(dense))
    # A position past the table reads and writes the null page, and only it.
    spilled = write_paged(paged, jnp.ones((batch, 1, heads, dim)), jnp.full((batch,), (pages_per_row + 3) * PAGE))
    np.testing.assert_array_equal(np.asarray(spilled.pages[1:]), np.asarray(paged.pages[1:]))
