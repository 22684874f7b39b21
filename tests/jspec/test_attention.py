"""target_attention: the tree kernel only for a verify pass (W = T, written at offset 0), dense attention otherwise.

The kernel reads the window from k_new/v_new, which is right only when window slot j holds new token j. A drafter
growing a tree writes a depth at a nonzero offset; with W = T such a call must not reach the kernel. The kernel is
forced with impl="interpret" (the Pallas interpreter, on CPU); NaN fills every cache slot nothing wrote, so a read
of garbage shows. Oracle: a float64 numpy softmax over the slots each query may see (models/attention.py).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec.attention
from jspec.attention import target_attention
from models.attention import KVCache, dense_attention, write_new_tokens
from models.config import ModelConfig
from models.llama import LlamaModel, init_params, unstack_layers

ATOL = 1e-5  # float32, kernel (split-k, logsumexp merge) vs dense and the float64 oracle
KERNEL = functools.partial(target_attention, impl="interpret")


def window_inputs(seed, *, cache_len, num_new, window, write_offset, q_heads=4, kv_heads=2, head_dim=16,
                  cache_size=32):
    """(q, k_cache, v_cache, k_new, v_new, cache_len, local_mask) as the model hands them to attention: the
    committed slots and the window slots before write_offset (earlier depths) hold data, the new tokens are
    written at cache_len + write_offset, and every other slot holds NaN. local_mask: bool[B, T, W], random, with
    each query seeing its own slot when that lies in the window."""
    rng = np.random.default_rng(seed)
    cache_len = np.asarray(cache_len, np.int32)
    batch = len(cache_len)

    def normal(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    slot = np.arange(cache_size)[None, :]
    written = slot < (cache_len + write_offset)[:, None]  # committed, then earlier depths of the window
    k_cache, v_cache = normal(batch, cache_size, kv_heads, head_dim), normal(batch, cache_size, kv_heads, head_dim)
    k_cache[~written], v_cache[~written] = np.nan, np.nan
    q = normal(batch, num_new, q_heads, head_dim)
    k_new, v_new = normal(batch, num_new, kv_heads, head_dim), normal(batch, num_new, kv_heads, head_dim)
    start = jnp.asarray(cache_len + write_offset)
    k_cache = write_new_tokens(jnp.asarray(k_cache), jnp.asarray(k_new), start)
    v_cache = write_new_tokens(jnp.asarray(v_cache), jnp.asarray(v_new), start)
    mask = rng.random((batch, num_new, window)) < 0.5
    for i in range(num_new):
        if write_offset + i < window:
            mask[:, i, write_offset + i] = True
    return (jnp.asarray(q), k_cache, v_cache, jnp.asarray(k_new), jnp.asarray(v_new), jnp.asarray(cache_len),
            jnp.asarray(mask))


def numpy_window_attention(q, k_cache, v_cache, cache_len, local_mask, scale):
    """Independent oracle: per (b, t, h), one float64 softmax over slots < cache_len and the window slots the
    mask allows, all read from the cache."""
    q, k_cache, v_cache = (np.asarray(x, np.float64) for x in (q, k_cache, v_cache))
    mask, cache_len = np.asarray(local_mask), np.asarray(cache_len)
    batch, num_new, q_heads, _ = q.shape
    group = q_heads // k_cache.shape[2]
    out = np.zeros_like(q)
    for b in range(batch):
        for t in range(num_new):
            seen = np.concatenate([np.arange(cache_len[b]), cache_len[b] + np.flatnonzero(mask[b, t])])
            for h in range(q_heads):
                scores = k_cache[b, seen, h // group] @ q[b, t, h] * scale
                weights = np.exp(scores - scores.max())
                out[b, t, h] = weights @ v_cache[b, seen, h // group] / weights.sum()
    return out


def call(attention, inputs, write_offset, scale):
    q, k_cache, v_cache, k_new, v_new, cache_len, mask = inputs
    return np.asarray(attention(q, k_cache, v_cache, k_new, v_new, cache_len, mask, write_offset, scale=scale))


@pytest.mark.parametrize("write_offset", [1, 3])
def test_window_written_at_an_offset_equals_dense(write_offset):
    """W = T at a nonzero offset: the kernel would read new token j for window slot j; the answer reads the cache."""
    num_new = 4
    inputs = window_inputs(write_offset, cache_len=[5, 17], num_new=num_new, window=num_new,
                           write_offset=write_offset)
    expected = call(dense_attention, inputs, write_offset, 0.25)
    out = call(KERNEL, inputs, write_offset, 0.25)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expected, atol=ATOL, rtol=0)
    q, k_cache, v_cache, _, _, cache_len, mask = inputs
    np.testing.assert_allclose(out, numpy_window_attention(q, k_cache, v_cache, cache_len, mask, 0.25),
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("cache_len,num_new", [([5, 17], 4), ([1, 30], 1), ([0, 3], 7)])
def test_verify_pass_through_the_kernel_equals_dense(cache_len, num_new):
    inputs = window_inputs(num_new, cache_len=cache_len, num_new=num_new, window=num_new, write_offset=0)
    out = call(KERNEL, inputs, 0, 0.25)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, call(dense_attention, inputs, 0, 0.25), atol=ATOL, rtol=0)
    q, k_cache, v_cache, _, _, cache_len, mask = inputs
    np.testing.assert_allclose(out, numpy_window_attention(q, k_cache, v_cache, cache_len, mask, 0.25),
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("window,write_offset,impl,kernel", [
    (4, 0, "interpret", True),            # a verify pass
    (4, 0, "reference", False),           # the same, kernel not asked for
    (4, 2, "interpret", False),           # W = T written at an offset
    (4, np.int32(0), "interpret", True),  # a numpy zero is as static as a Python one
    (6, 0, "interpret", False),           # a drafter's window wider than T
    (None, 0, "interpret", False),        # causal over several tokens (prefill)
])
def test_route(monkeypatch, window, write_offset, impl, kernel):
    calls = []
    real = jspec.attention.tree_attention
    monkeypatch.setattr(jspec.attention, "tree_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    inputs = window_inputs(0, cache_len=[5, 17], num_new=4, window=window or 4, write_offset=0)
    if window is None:
        inputs = inputs[:-1] + (None,)
    call(functools.partial(target_attention, impl=impl), inputs, write_offset, 0.25)
    assert bool(calls) == kernel


def test_a_plain_decode_token_goes_to_the_kernel_as_a_tree_of_one_node(monkeypatch):
    """One new token, no mask (plain decoding): the kernel, reading the cache in place, equals dense attention and
    the float64 oracle."""
    calls = []
    real = jspec.attention.tree_attention
    monkeypatch.setattr(jspec.attention, "tree_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    inputs = window_inputs(3, cache_len=[5, 30], num_new=1, window=1, write_offset=0)
    unmasked = inputs[:-1] + (None,)
    out = call(KERNEL, unmasked, 0, 0.25)
    assert calls and np.isfinite(out).all()
    np.testing.assert_allclose(out, call(dense_attention, unmasked, 0, 0.25), atol=ATOL, rtol=0)
    q, k_cache, v_cache, _, _, cache_len, mask = inputs
    np.testing.assert_allclose(out, numpy_window_attention(q, k_cache, v_cache, cache_len, mask, 0.25),
                               atol=ATOL, rtol=0)


def test_traced_offset_goes_dense(monkeypatch):
    """Under jit an array offset is a tracer whose value routing cannot see: even a zero one goes dense."""
    calls = []
    real = jspec.attention.tree_attention
    monkeypatch.setattr(jspec.attention, "tree_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    inputs = window_inputs(0, cache_len=[5, 17], num_new=4, window=4, write_offset=0)
    out = jax.jit(lambda offset: call_traced(inputs, offset))(jnp.int32(0))
    assert not calls
    np.testing.assert_allclose(np.asarray(out), call(dense_attention, inputs, 0, 0.25), atol=ATOL, rtol=0)


def call_traced(inputs, offset):
    q, k_cache, v_cache, k_new, v_new, cache_len, mask = inputs
    return KERNEL(q, k_cache, v_cache, k_new, v_new, cache_len, mask, offset, scale=0.25)


TINY = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16)


# slow: the model hands the cache offset to attention; default tier: the attention tests against jax's, every cached
# decode = transformers test
@pytest.mark.slow
def test_model_hands_the_offset_to_attention():
    """Through LlamaModel (unrolled, as the target runs): a depth of 2 tree tokens at offset 0 (a verify-shaped
    call: the kernel), then 3 at offset 2 under a 3-slot window (W = T: must go dense). Logits equal the model
    with dense attention."""
    params = unstack_layers(init_params(TINY, jax.random.key(0)), TINY)
    batch, cache_size, rng = 2, 16, np.random.default_rng(0)
    nan = jnp.full((batch, cache_size, TINY.num_kv_heads, TINY.head_dim), jnp.nan)
    cache = KVCache((nan,) * TINY.num_layers, (nan,) * TINY.num_layers)
    prompt = jnp.asarray(rng.integers(0, TINY.vocab_size, (batch, 6)), jnp.int32)
    models = {name: LlamaModel(TINY, attention_fn=fn, scan_layers=False)
              for name, fn in (("kernel", KERNEL), ("dense", dense_attention))}
    prefill = models["dense"].apply({"params": params}, prompt, jnp.broadcast_to(jnp.arange(6), (batch, 6)),
                                    cache, jnp.zeros((batch,), jnp.int32))
    cache_len = jnp.asarray([4, 6], jnp.int32)  # row 0: slots 4, 5 are stale, overwritten by the window
    depth1 = jnp.asarray(rng.integers(0, TINY.vocab_size, (batch, 2)), jnp.int32)
    depth2 = jnp.asarray(rng.integers(0, TINY.vocab_size, (batch, 3)), jnp.int32)
    mask1 = jnp.broadcast_to(jnp.tril(jnp.ones((2, 2), bool)), (batch, 2, 2))
    mask2 = jnp.broadcast_to(jnp.asarray([[1, 1, 1], [1, 1, 0], [1, 1, 0]], bool), (batch, 3, 3))

    positions1, positions2 = cache_len[:, None] + jnp.arange(2), cache_len[:, None] + 2 + jnp.arange(3)

    logits = {}
    for name, model in models.items():
        out1 = model.apply({"params": params}, depth1, positions1, prefill.cache, cache_len, local_mask=mask1)
        out2 = model.apply({"params": params}, depth2, positions2, out1.cache, cache_len, local_mask=mask2,
                           write_offset=2)
        logits[name] = (np.asarray(out1.logits), np.asarray(out2.logits))
    for kernel, dense in zip(logits["kernel"], logits["dense"]):
        assert np.isfinite(kernel).all()
        np.testing.assert_allclose(kernel, dense, atol=ATOL, rtol=0)
