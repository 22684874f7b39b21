"""paged_tree_attention: the Pallas kernels (the Triton form in the Pallas interpreter and the Mosaic TPU form in
Pallas's TPU interpreter here; the GPU lowering where one is present) against the paged reference, and the paged
reference against the dense one on the cache the pages hold: ragged lengths, pages in shuffled order, the null page
in each table's padding, NaN in every slot no row may read, GQA, chains and trees, float32 and bf16."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_tree_attention import gather_pages, paged_tree_attention, paged_tree_attention_reference
from pallas_kernels.tree_attention import tree_attention_reference
from tests.pallas_kernels.stacked import stacked
from tests.pallas_kernels.test_tree_attention import TOLERANCES, tree_masks

IMPLS = ["interpret", "tpu_interpret", pytest.param("pallas", marks=pytest.mark.gpu),
         pytest.param("tpu", marks=pytest.mark.tpu)]
PAGE_SIZE = 16


def paged_inputs(seed, *, cache_len, num_tokens, q_heads, kv_heads, head_dim, pages_per_row, mask_kind, dtype):
    """(q, k_pages, v_pages, page_table, cache_len, k_new, v_new, mask) and the dense (k_cache, v_cache) the pages
    hold: each row's pages drawn without replacement from a shuffled pool, page 0 the null page (NaN) in every
    table's padding, NaN at every position past a row's length."""
    rng = np.random.default_rng(seed)
    batch = len(cache_len)
    lengths = np.asarray(cache_len, np.int32)
    cache_size = pages_per_row * PAGE_SIZE
    dense_k = rng.standard_normal((batch, cache_size, kv_heads, head_dim), dtype=np.float32)
    dense_v = rng.standard_normal((batch, cache_size, kv_heads, head_dim), dtype=np.float32)
    unused = np.arange(cache_size)[None, :] >= lengths[:, None]
    dense_k[unused] = np.nan
    dense_v[unused] = np.nan
    num_pages = 1 + batch * pages_per_row + 3  # the null page, every row's, and three nobody reads
    order = rng.permutation(np.arange(1, num_pages))
    k_pages = np.full((num_pages, PAGE_SIZE, kv_heads, head_dim), np.nan, np.float32)
    v_pages = np.full_like(k_pages, np.nan)
    table = np.zeros((batch, pages_per_row), np.int32)
    taken = 0
    for b in range(batch):
        for j in range(-(-int(lengths[b]) // PAGE_SIZE)):
            page = order[taken]
            taken += 1
            table[b, j] = page
            k_pages[page] = dense_k[b, j * PAGE_SIZE:(j + 1) * PAGE_SIZE]
            v_pages[page] = dense_v[b, j * PAGE_SIZE:(j + 1) * PAGE_SIZE]
    q = rng.standard_normal((batch, num_tokens, q_heads, head_dim), dtype=np.float32)
    k_new = rng.standard_normal((batch, num_tokens, kv_heads, head_dim), dtype=np.float32)
    v_new = rng.standard_normal((batch, num_tokens, kv_heads, head_dim), dtype=np.float32)
    mask = tree_masks(rng, batch, num_tokens, mask_kind)

    def cast(x):
        return jnp.asarray(x, dtype)

    paged = (cast(q), cast(k_pages), cast(v_pages), jnp.asarray(table), jnp.asarray(lengths), cast(k_new),
             cast(v_new), jnp.asarray(mask))
    return paged, (cast(dense_k), cast(dense_v))


CASES = [  # (cache_len per row, T, Hq, Hkv, head_dim, pages per row, mask kind)
    ((37, 0, 64, 5), 8, 8, 2, 32, 4, "tree"),    # ragged, an empty prefix, a row of whole pages, GQA 4
    ((130, 17), 1, 4, 4, 64, 9, "chain"),        # one query (a decode step), MHA, more pages than a split
    ((48, 96, 3), 6, 6, 2, 16, 6, "chain"),      # GQA 3: stacked rows not a power of two
]


# slow: the kernel in either interpreter (the Triton form, the TPU form) on cases 1 and 2 and in bf16; default tier:
# both interpreters on case0 in f32 (ragged rows, an empty prefix, whole pages, GQA 4, a tree)
@pytest.mark.parametrize(*stacked(("impl", IMPLS), ("case", CASES, [f"case{i}" for i in range(len(CASES))]),
                                  ("dtype", [jnp.float32, jnp.bfloat16], ["f32", "bf16"]),
                                  slow=lambda impl, case, dtype: impl in ("interpret", "tpu_interpret")
                                  and (case, dtype) != ("case0", "f32")))
def test_kernel_equals_reference(case, dtype, impl):
    cache_len, num_tokens, q_heads, kv_heads, head_dim, pages_per_row, kind = case
    paged, _ = paged_inputs(0, cache_len=cache_len, num_tokens=num_tokens, q_heads=q_heads, kv_heads=kv_heads,
                            head_dim=head_dim, pages_per_row=pages_per_row, mask_kind=kind, dtype=dtype)
    want = paged_tree_attention_reference(*paged, scale=head_dim ** -0.5)
    got = paged_tree_attention(*paged, impl=impl, num_splits=2)
    assert got.dtype == dtype and got.shape == want.shape
    assert np.isfinite(np.asarray(got, np.float32)).all()
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               **TOLERANCES[np.dtype(dtype)])


def test_reference_equals_dense_attention_over_the_cache_the_pages_hold():
    paged, (dense_k, dense_v) = paged_inputs(1, cache_len=(37, 0, 64, 5), num_tokens=8, q_heads=8, kv_heads=2,
                                             head_dim=32, pages_per_row=4, mask_kind="tree", dtype=jnp.float32)
    q, k_pages, v_pages, table, lengths, k_new, v_new, mask = paged
    dense = tree_attention_reference(q, dense_k, dense_v, lengths, k_new, v_new, mask, scale=32 ** -0.5)
    got = paged_tree_attention_reference(*paged, scale=32 ** -0.5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(dense), atol=1e-6, rtol=1e-6)
    held = np.asarray(gather_pages(k_pages, table))
    for b, length in enumerate(np.asarray(lengths)):
        np.testing.assert_array_equal(held[b, :length], np.asarray(dense_k)[b, :length])


def test_bad_shapes_are_refused_by_name():
    paged, _ = paged_inputs(2, cache_len=(20,), num_tokens=2, q_heads=2, kv_heads=1, head_dim=16, pages_per_row=2,
                            mask_kind="chain", dtype=jnp.float32)
    q, k_pages, v_pages, table, lengths, k_new, v_new, mask = paged
    with pytest.raises(ValueError, match="page_size=8 must be a power of two >= 16"):
        paged_tree_attention(q, k_pages[:, :8], v_pages[:, :8], table, lengths, k_new, v_new, mask)
    with pytest.raises(ValueError, match="page_table must be int\\[1, N\\]"):
        paged_tree_attention(q, k_pages, v_pages, table[0], lengths, k_new, v_new, mask)
