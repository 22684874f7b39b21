"""tree_attention: the Pallas kernel against the dense reference, the reference against numpy."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.tree_attention import tree_attention, tree_attention_reference
from tests.pallas_kernels.stacked import stacked

# Kernel vs reference, stated once per dtype.
TOLERANCES = {
    np.dtype(jnp.float32): dict(atol=1e-5, rtol=1e-5),
    np.dtype(jnp.bfloat16): dict(atol=2e-2, rtol=2e-2),
}

FORMS = ["interpret", "tpu_interpret", pytest.param("pallas", marks=pytest.mark.gpu),
         pytest.param("tpu", marks=pytest.mark.tpu)]
# slow: the TPU (Mosaic) form in Pallas's TPU interpreter (issue 31: seconds a case on a CPU); default tier: the Triton
# form's interpreter on every case, and the TPU form's on test_kernel_matches_reference's representative
IMPLS = [pytest.param(form, marks=pytest.mark.slow) if form == "tpu_interpret" else form for form in FORMS]


def ancestor_mask(parents: np.ndarray) -> np.ndarray:
    """parents: i32[T] (parents[0] = -1, parents[i] < i) -> bool[T, T]: i and its ancestors."""
    num_tokens = len(parents)
    mask = np.eye(num_tokens, dtype=bool)
    for i in range(1, num_tokens):
        mask[i] |= mask[parents[i]]
    return mask


def tree_masks(rng: np.random.Generator, batch: int, num_tokens: int, kind: str) -> np.ndarray:
    """bool[B, T, T]: "chain" (lower triangular) or "tree" (random parents, one per sequence)."""
    if kind == "chain":
        return np.broadcast_to(np.tril(np.ones((num_tokens, num_tokens), bool)),
                               (batch, num_tokens, num_tokens)).copy()
    masks = []
    for _ in range(batch):
        parents = np.array([-1] + [rng.integers(0, i) for i in range(1, num_tokens)])
        masks.append(ancestor_mask(parents))
    return np.stack(masks)


def random_inputs(seed, *, cache_len, num_tokens, q_heads, kv_heads, head_dim, cache_size,
                  mask_kind, dtype):
    """Random (q, k_cache, v_cache, cache_len, k_new, v_new, mask); NaN in unused cache slots."""
    rng = np.random.default_rng(seed)
    batch = len(cache_len)
    cache_len = np.asarray(cache_len, np.int32)

    def normal(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    q = normal(batch, num_tokens, q_heads, head_dim)
    k_cache = normal(batch, cache_size, kv_heads, head_dim)
    v_cache = normal(batch, cache_size, kv_heads, head_dim)
    unused = np.arange(cache_size)[None, :] >= cache_len[:, None]  # [B, L]
    k_cache[unused] = np.nan
    v_cache[unused] = np.nan
    k_new = normal(batch, num_tokens, kv_heads, head_dim)
    v_new = normal(batch, num_tokens, kv_heads, head_dim)
    mask = tree_masks(rng, batch, num_tokens, mask_kind)
    as_dtype = lambda x: jnp.asarray(x, dtype)
    return (as_dtype(q), as_dtype(k_cache), as_dtype(v_cache), jnp.asarray(cache_len),
            as_dtype(k_new), as_dtype(v_new), jnp.asarray(mask))


def numpy_tree_attention(q, k_cache, v_cache, cache_len, k_new, v_new, mask, scale):
    """Independent oracle: one float64 softmax per (b, t, h) over the keys that query may see."""
    q, k_cache, v_cache, k_new, v_new = (np.asarray(x, np.float64)
                                         for x in (q, k_cache, v_cache, k_new, v_new))
    batch, num_tokens, q_heads, head_dim = q.shape
    group = q_heads // k_cache.shape[2]
    out = np.zeros_like(q)
    for b in range(batch):
        for t in range(num_tokens):
            seen = np.flatnonzero(np.asarray(mask)[b, t])
            for h in range(q_heads):
                kv_head = h // group
                past = slice(0, cache_len[b])
                keys = np.concatenate([k_cache[b, past, kv_head], k_new[b, seen, kv_head]])
                values = np.concatenate([v_cache[b, past, kv_head], v_new[b, seen, kv_head]])
                logits = keys @ q[b, t, h] * scale
                weights = np.exp(logits - logits.max())
                out[b, t, h] = weights @ values / weights.sum()
    return out


# (cache_len per sequence, L, T, Hq, Hkv, D, mask kind, kernel knobs)
CASES = {
    "L1-T1-empty-cache": ([0], 1, 1, 2, 2, 32, "chain", {}),
    "L3-full-and-empty-gqa2": ([3, 0], 3, 3, 4, 2, 32, "chain", dict(block_k=16)),
    "L127-ragged-gqa4-tree": ([127, 1, 64], 127, 8, 8, 2, 64, "tree",
                              dict(block_k=32, num_splits=3)),
    "L513-ragged-gqa2-tree": ([513, 0, 3, 300], 513, 16, 4, 2, 64, "tree",
                              dict(block_k=64, num_splits=4)),
    "L300-T16-gqa8-row-blocks-default-knobs": ([300, 299], 300, 16, 16, 2, 32, "tree", {}),
    "L600-gqa1-D40-chain": ([513, 127], 600, 5, 2, 2, 40, "chain", dict(block_k=16, block_rows=16)),
}


# slow: the TPU interpreter's form on every case but one; default tier: its [L600-gqa1-D40-chain-bf16-tpu_interpret]
# (ragged cache, block_rows, D = 40, bf16) and the Triton form's interpreter on every case
@pytest.mark.parametrize(*stacked(("case", list(CASES), list(CASES)),
                                  ("dtype", [jnp.float32, jnp.bfloat16], ["f32", "bf16"]),
                                  ("impl", FORMS),
                                  slow=lambda case, dtype, impl: impl == "tpu_interpret"
                                  and (case, dtype) != ("L600-gqa1-D40-chain", "bf16")))
def test_kernel_matches_reference(case, dtype, impl):
    cache_len, cache_size, num_tokens, q_heads, kv_heads, head_dim, mask_kind, knobs = CASES[case]
    inputs = random_inputs(len(case), cache_len=cache_len, num_tokens=num_tokens, q_heads=q_heads,
                           kv_heads=kv_heads, head_dim=head_dim, cache_size=cache_size,
                           mask_kind=mask_kind, dtype=dtype)
    out = tree_attention(*inputs, impl=impl, **knobs)
    expected = tree_attention_reference(*inputs, scale=head_dim ** -0.5)
    assert out.shape == inputs[0].shape and out.dtype == dtype
    assert not np.isnan(np.asarray(out, np.float32)).any()
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32),
                               **TOLERANCES[np.dtype(dtype)])


@pytest.mark.parametrize("impl", IMPLS)
def test_rows_that_see_no_key_are_zero_not_nan(impl):
    """Invalid in use (a node always sees itself), but padding rows must not turn into NaN."""
    q, k_cache, v_cache, _, k_new, v_new, mask = random_inputs(
        5, cache_len=[0, 0], num_tokens=3, q_heads=2, kv_heads=1, head_dim=16, cache_size=20,
        mask_kind="chain", dtype=jnp.float32)
    mask = mask.at[:, 1].set(False)  # token 1 sees nothing: empty cache, no tree keys
    out = np.asarray(tree_attention(q, k_cache, v_cache, jnp.zeros(2, jnp.int32), k_new, v_new,
                                    mask, impl=impl, block_k=16))
    np.testing.assert_array_equal(out[:, 1], 0.0)
    assert not np.isnan(out).any()


def test_reference_matches_numpy_oracle():
    inputs = random_inputs(7, cache_len=[5, 0, 9], num_tokens=6, q_heads=4, kv_heads=2, head_dim=8,
                           cache_size=9, mask_kind="tree", dtype=jnp.float32)
    scale = 0.3
    expected = numpy_tree_attention(*inputs, scale=scale)
    out = tree_attention(*inputs, scale=scale, impl="reference")
    assert not np.isnan(np.asarray(out)).any()
    np.testing.assert_allclose(np.asarray(out), expected, **TOLERANCES[np.dtype(jnp.float32)])


def test_ancestor_mask_of_a_small_tree():
    #      0
    #     / \
    #    1   2
    #    |
    #    3
    np.testing.assert_array_equal(ancestor_mask(np.array([-1, 0, 0, 1])), np.array(
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], bool))


@pytest.mark.parametrize("impl", IMPLS)
def test_kernel_under_outer_jit(impl):
    inputs = random_inputs(3, cache_len=[20, 7], num_tokens=4, q_heads=4, kv_heads=1, head_dim=16,
                           cache_size=40, mask_kind="tree", dtype=jnp.float32)
    run = jax.jit(lambda *args: tree_attention(*args, impl=impl, block_k=16))
    np.testing.assert_allclose(np.asarray(run(*inputs)),
                               np.asarray(tree_attention_reference(*inputs, scale=0.25)),
                               **TOLERANCES[np.dtype(jnp.float32)])


@pytest.mark.parametrize("batch, tokens, q_heads, kv_heads, head_dim, cache_size, dtype, knobs", [
    (1, 16, 32, 8, 128, 1024, jnp.bfloat16, {}),       # Llama-3-8B heads, one row block
    (4, 64, 32, 8, 128, 8192, jnp.bfloat16, {}),       # four row blocks, split cache
    (2, 5, 4, 2, 40, 513, jnp.float32, dict(block_k=16, block_rows=16)),  # padded rows and D
    (1, 1, 2, 2, 32, 1, jnp.float32, {}),              # cache shorter than one tile
])
def test_kernel_lowers_to_triton(batch, tokens, q_heads, kv_heads, head_dim, cache_size, dtype,
                                 knobs):
    """Without a GPU, lowering for CUDA still runs the Pallas -> Triton IR pass on every tile."""
    spec = jax.ShapeDtypeStruct
    args = (spec((batch, tokens, q_heads, head_dim), dtype),
            spec((batch, cache_size, kv_heads, head_dim), dtype),
            spec((batch, cache_size, kv_heads, head_dim), dtype), spec((batch,), jnp.int32),
            spec((batch, tokens, kv_heads, head_dim), dtype),
            spec((batch, tokens, kv_heads, head_dim), dtype),
            spec((batch, tokens, tokens), jnp.bool_))
    op = jax.jit(functools.partial(tree_attention, impl="pallas", **knobs))
    triton_call = "__gpu$xla.gpu.triton"
    exported = jax.export.export(
        op, platforms=("cuda",),
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton_call)])(*args)
    assert triton_call in exported.mlir_module()


def _small_inputs(**overrides):
    shapes = dict(q=(2, 3, 4, 8), k_cache=(2, 10, 2, 8), v_cache=(2, 10, 2, 8), cache_len=(2,),
                  k_new=(2, 3, 2, 8), v_new=(2, 3, 2, 8), mask=(2, 3, 3))
    shapes.update(overrides)
    dtypes = dict(cache_len=jnp.int32, mask=jnp.bool_)
    return [jnp.zeros(shape, dtypes.get(name, jnp.float32)) for name, shape in shapes.items()]


@pytest.mark.parametrize("overrides, message", [
    (dict(q=(2, 3, 3, 8)), "Hq=3"),
    (dict(v_cache=(2, 11, 2, 8)), "v_cache"),
    (dict(k_cache=(2, 10, 2, 4), v_cache=(2, 10, 2, 4)), "k_cache shape"),
    (dict(k_new=(2, 4, 2, 8)), "k_new"),
    (dict(mask=(2, 3, 4)), "mask"),
    (dict(cache_len=(3,)), "cache_len"),
])
def test_invalid_shapes_raise(overrides, message):
    with pytest.raises(ValueError, match=message):
        tree_attention(*_small_inputs(**overrides), impl="reference")


@pytest.mark.parametrize("knobs, message", [
    (dict(block_k=48), "block_k=48"), (dict(block_rows=8), "block_rows=8"),
    (dict(num_splits=0), "num_splits=0"), (dict(impl="cuda"), "impl='cuda'"),
])
def test_invalid_knobs_raise(knobs, message):
    with pytest.raises(ValueError, match=message):
        tree_attention(*_small_inputs(), **{"impl": "interpret", **knobs})


# slow: the TPU form in its interpreter; default tier: the Triton form's interpreter
@pytest.mark.parametrize("impl", IMPLS)
def test_the_latent_layout_matches_reference(impl):
    """DeepSeek-V3's attention as models/mla.py hands it over: one latent head of 576 (512 + 64 rope) read as both K
    and V by every query head; the Triton tiles shrink to fit the head (fit_tiles)."""
    inputs = random_inputs(5, cache_len=[70, 3], num_tokens=4, q_heads=4, kv_heads=1, head_dim=576, cache_size=80,
                           mask_kind="tree", dtype=jnp.float32)
    q, latent, _, cache_len, new, _, mask = inputs  # the latent's unused slots NaN: never read
    out = tree_attention(q, latent, latent, cache_len, new, new, mask, impl=impl, scale=0.1)
    expected = tree_attention_reference(q, latent, latent, cache_len, new, new, mask, scale=0.1)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), **TOLERANCES[np.dtype(jnp.float32)])
