"""Tree attention's Mosaic GPU form in Pallas's Mosaic GPU interpreter (on this CPU) against the jnp reference: the
TMA tiles of the cache's [B * S, Hkv, D] view (double-buffered, the last one clamped inside the row's cache; the
view padded where B * S is not a multiple of 8), the online softmax, the tree mask. Its WGMMAs run as dots in the interpreter, which
cannot run a WGMMA over a transposed ref; the H100 compiler compiles them (tests/aot/test_kernels.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_tree_attention import paged_tree_attention_reference
from pallas_kernels.tree_attention import tree_attention_reference
from pallas_kernels.tree_attention_mgpu import paged_tree_attention_mgpu, supports, tree_attention_mgpu
from tests.pallas_kernels.test_paged_tree_attention import paged_inputs

ATOL = 2e-2  # bf16 out; the reference computes in f32 from the same bf16 inputs


def inputs(seed, *, batch, nodes, q_heads, kv_heads, slots, cache_len, head_dim=64):
    keys = jax.random.split(jax.random.key(seed), 6)
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.bfloat16)
    q = normal(keys[0], (batch, nodes, q_heads, head_dim))
    k_cache, v_cache = (normal(k, (batch, slots, kv_heads, head_dim)) for k in keys[1:3])
    k_new, v_new = (normal(k, (batch, nodes, kv_heads, head_dim)) for k in keys[3:5])
    mask = jax.random.bernoulli(keys[5], 0.5, (batch, nodes, nodes)) | jnp.eye(nodes, dtype=bool)
    return q, k_cache, v_cache, jnp.asarray(cache_len, jnp.int32), k_new, v_new, mask


def check(args):
    out = tree_attention_mgpu(*args, scale=0.125, interpret=True)
    expected = tree_attention_reference(*[a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args],
                                        scale=0.125)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected), atol=ATOL, rtol=0)


def test_unaligned_cache_over_two_tiles_equals_the_reference():
    """3 rows of 130 slots (a padded view): rows at 129 committed slots (the second tile clamped to 66-129), none,
    and one tile and a part."""
    check(inputs(0, batch=3, nodes=4, q_heads=4, kv_heads=2, slots=130, cache_len=[129, 0, 70]))


# slow: more shapes of the Mosaic GPU form in its interpreter; default tier: the unaligned cache over two tiles above
@pytest.mark.slow
@pytest.mark.parametrize("nodes,q_heads,kv_heads,slots,cache_len", [
    (16, 8, 1, 256, [200, 64]),   # 128 rows a KV head (Llama-3-70B's 8 query heads to one), four tiles
    (1, 4, 2, 72, [72, 9]),       # a plain decode token; a full cache whose last tile is clamped to slots 8-71
    (8, 4, 2, 2053, [2045, 700, 5, 64]),  # max_seq_len 2048 plus a tree's slots: 4 x 2053, no padding
    (32, 8, 2, 69, [61, 3]),      # 256 rows, the most; 2 x 69 slots: a padded view
])
def test_more_shapes_equal_the_reference(nodes, q_heads, kv_heads, slots, cache_len):
    check(inputs(1, batch=len(cache_len), nodes=nodes, q_heads=q_heads, kv_heads=kv_heads, slots=slots,
                 cache_len=cache_len))


def test_what_the_form_takes_is_said_before_any_work():
    q, k_cache = inputs(2, batch=1, nodes=2, q_heads=4, kv_heads=2, slots=64, cache_len=[3])[:2]
    assert supports(q, k_cache)
    assert not supports(q.astype(jnp.float32), k_cache)             # WGMMA's operands: bf16 or f16
    assert not supports(q, k_cache[:, :60])                          # fewer slots than a tile
    assert not supports(jnp.zeros((1, 65, 8, 64), jnp.bfloat16), k_cache)  # 65 nodes x 4 heads: 260 rows
    with pytest.raises(ValueError, match="bf16 or f16"):
        tree_attention_mgpu(q.astype(jnp.float32), k_cache, k_cache, jnp.zeros((1,), jnp.int32),
                            jnp.zeros((1, 2, 2, 64)), jnp.zeros((1, 2, 2, 64)), jnp.ones((1, 2, 2), bool),
                            scale=0.125)


# slow: case 1 (one decode token, MHA, 12 pages a row); default tier: case 0 (ragged rows, an empty one, GQA 4)
@pytest.mark.parametrize("case", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_the_paged_form_equals_the_reference_with_nan_past_every_length(case):
    """Pages in shuffled order, 4 to a tile of 64 slots; the null page and every slot past a row's length NaN (the
    last tile's values past the length are zeroed before P @ V)."""
    cache_len, nodes, q_heads, kv_heads, pages_per_row = [((37, 0, 64, 5), 8, 8, 2, 9),
                                                          ((130, 17), 1, 4, 4, 12)][case]
    paged, _ = paged_inputs(case, cache_len=cache_len, num_tokens=nodes, q_heads=q_heads, kv_heads=kv_heads,
                            head_dim=64, pages_per_row=pages_per_row, mask_kind="tree", dtype=jnp.bfloat16)
    out = paged_tree_attention_mgpu(*paged, scale=0.125, interpret=True)
    expected = paged_tree_attention_reference(*[x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x
                                                for x in paged], scale=0.125)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected), atol=ATOL, rtol=0)
