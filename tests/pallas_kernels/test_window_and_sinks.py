"""Sliding windows and attention sinks in the tree-attention kernels (gpt-oss, Gemma-3): every form (the Triton
kernel in the Pallas interpreter, the Mosaic TPU kernel in Pallas's TPU interpreter, the dense and paged references)
against ``models.attention.dense_attention`` (checked against a per-query reference in tests/models/test_paged_kv),
over ragged prefixes longer than the window, trees, GQA, NaN in every slot no query may read, and over rows whose
window starts pages or blocks after position 0, so the kernels' skipped blocks are ones nobody reads."""

import jax.numpy as jnp
import numpy as np
import pytest

from models.attention import dense_attention
from pallas_kernels.paged_tree_attention import paged_tree_attention
from pallas_kernels.tree_attention import tree_attention
from tests.pallas_kernels.test_paged_tree_attention import paged_inputs

SCALE = 0.25


def _expected(q, dense_k, dense_v, cache_len, k_new, v_new, mask, window, sinks):
    """dense_attention over the prefix with the tree written at cache_len (its NaN past the length untouched)."""
    rows = jnp.arange(q.shape[0])[:, None]
    width = dense_k.shape[1] + q.shape[1]
    pad = ((0, 0), (0, width - dense_k.shape[1]), (0, 0), (0, 0))
    place = cache_len[:, None] + jnp.arange(q.shape[1])[None]
    k = jnp.pad(dense_k, pad, constant_values=jnp.nan).at[rows, place].set(k_new)
    v = jnp.pad(dense_v, pad, constant_values=jnp.nan).at[rows, place].set(v_new)
    return dense_attention(q, k, v, k_new, v_new, cache_len, mask, 0, scale=SCALE, window=window, sinks=sinks)


@pytest.mark.parametrize("impl,window,with_sinks", [
    (impl, window, sinks) for impl in ("reference", "interpret", "tpu_interpret")
    for window, sinks in ((20, True), (7, False))] + [("interpret", None, True), ("tpu_interpret", None, True)])
def test_every_form_reads_the_window_and_the_sinks(impl, window, with_sinks):
    (q, k_pages, v_pages, table, lengths, k_new, v_new, mask), (dense_k, dense_v) = paged_inputs(
        11, cache_len=(70, 0, 45), num_tokens=6, q_heads=4, kv_heads=2, head_dim=32, pages_per_row=5,
        mask_kind="tree", dtype=jnp.float32)
    sinks = jnp.asarray([1.5, -0.5, 0.0, 3.0], jnp.float32) if with_sinks else None
    want = np.asarray(_expected(q, dense_k, dense_v, lengths, k_new, v_new, mask, window, sinks))
    kwargs = dict(scale=SCALE, impl=impl, window=window, sinks=sinks)
    paged = paged_tree_attention(q, k_pages, v_pages, table, lengths, k_new, v_new, mask, **kwargs)
    np.testing.assert_allclose(np.asarray(paged), want, atol=2e-5, rtol=2e-5)
    dense = tree_attention(q, dense_k, dense_v, lengths, k_new, v_new, mask, block_k=16, **kwargs)
    np.testing.assert_allclose(np.asarray(dense), want, atol=2e-5, rtol=2e-5)
    if window is not None:  # the window binds here: reading everything is another answer
        unwindowed = np.asarray(_expected(q, dense_k, dense_v, lengths, k_new, v_new, mask, None, sinks))
        assert np.abs(unwindowed - want).max() > 1e-2


def test_a_window_must_be_a_static_positive_int():
    (q, k_pages, v_pages, table, lengths, k_new, v_new, mask), _ = paged_inputs(
        1, cache_len=(5,), num_tokens=2, q_heads=2, kv_heads=2, head_dim=16, pages_per_row=1, mask_kind="chain",
        dtype=jnp.float32)
    with pytest.raises(ValueError, match="window=0: expected a positive int"):
        paged_tree_attention(q, k_pages, v_pages, table, lengths, k_new, v_new, mask, window=0, impl="reference")
    with pytest.raises(ValueError, match=r"sinks of shape \(3,\): expected one per query head, \(2,\)"):
        paged_tree_attention(q, k_pages, v_pages, table, lengths, k_new, v_new, mask, sinks=jnp.zeros(3),
                             impl="reference")


def test_the_engine_routes_a_window_and_sinks_to_the_kernels(monkeypatch):
    """``jspec.attention.target_attention`` (what a verify pass calls) with the Triton kernel in the interpreter:
    a dense cache's verify pass and a paged one each run their kernel, with the window and the sinks, and equal
    dense_attention."""
    import jspec.attention
    from jspec.attention import target_attention
    from models.paged_kv import PagedKV

    calls = []
    for name in ("tree_attention", "paged_tree_attention"):
        kernel = getattr(jspec.attention, name)
        monkeypatch.setattr(jspec.attention, name, lambda *a, _k=kernel, _n=name, **kw: (
            calls.append((_n, kw["window"], kw["sinks"] is not None)), _k(*a, **kw))[1])

    (q, k_pages, v_pages, table, lengths, k_new, v_new, mask), (dense_k, dense_v) = paged_inputs(
        12, cache_len=(50, 21), num_tokens=4, q_heads=4, kv_heads=2, head_dim=32, pages_per_row=4,
        mask_kind="tree", dtype=jnp.float32)
    sinks = jnp.asarray([0.5, 2.0, -1.0, 0.0], jnp.float32)
    want = np.asarray(_expected(q, dense_k, dense_v, lengths, k_new, v_new, mask, 9, sinks))
    rows = jnp.arange(2)[:, None]
    place = lengths[:, None] + jnp.arange(4)[None]
    k_cache = jnp.pad(dense_k, ((0, 0), (0, 4), (0, 0), (0, 0))).at[rows, place].set(k_new)
    v_cache = jnp.pad(dense_v, ((0, 0), (0, 4), (0, 0), (0, 0))).at[rows, place].set(v_new)
    kwargs = dict(scale=SCALE, impl="interpret", window=9, sinks=sinks)
    dense = target_attention(q, k_cache, v_cache, k_new, v_new, lengths, mask, 0, **kwargs)
    paged = target_attention(q, PagedKV(k_pages, table), PagedKV(v_pages, table), k_new, v_new, lengths, mask, 0,
                             **kwargs)
    for got in (dense, paged):
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)
    assert calls == [("tree_attention", 9, True), ("paged_tree_attention", 9, True)]
