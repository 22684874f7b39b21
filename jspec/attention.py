"""The target's attention inside generate: the tree-attention kernel for verify passes, dense attention otherwise.

A verify pass is T tree tokens written at ``cache_len`` itself (``write_offset`` the Python int 0) under a mask
over exactly those T (W = T); a plain decode step's one token (no mask) is one, a tree of one node. Only there is
window slot j new token j, so only there may attention read the window from ``k_new``/``v_new``, as
``pallas_kernels.tree_attention``'s kernels do; on a GPU or a TPU it goes to them (dense attention in jnp lets the
compiler copy the whole cache into a head-major layout every layer, XLA's GPU compiler three times over: docs/aot.md).
Everything else (prefill, drafter windows wider than T, a window written at another offset, an
offset given as an array, and verify passes off the GPU) goes to ``models.attention.dense_attention``
(grouped-query attention in jnp, compiled by XLA), which reads the window from the cache wherever it was written: the
kernel's jnp reference is its specification, and slower than that on a CPU.

The route is chosen at trace time, from shapes and the offset's Python type: a traced offset may be anything,
so even a zero one goes dense (the target's verify call passes none, and the model hands on its default 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jspec.sharding import KV_CACHE, KV_POOL, kv_spec, per_shard
from models.attention import dense_attention
from models.paged_kv import PagedKV, paged_attention
from pallas_kernels.impl import Impl, ImplName, resolve_impl
from pallas_kernels.paged_tree_attention import paged_tree_attention
from pallas_kernels.tree_attention import tree_attention


def is_verify_pass(q: jax.Array, local_mask: jax.Array | None, write_offset: jax.Array | int) -> bool:
    """Whether the new tokens fill a window of exactly T slots from its start, known at trace time: a mask
    bool[B, T, T] and an offset that is the integer 0 itself, not an array (whose value a trace cannot see)."""
    static_zero = isinstance(write_offset, (int, np.integer)) and int(write_offset) == 0
    return local_mask is not None and local_mask.shape[2] == q.shape[1] and static_zero


def target_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, k_new: jax.Array, v_new: jax.Array,
                     cache_len: jax.Array, local_mask: jax.Array | None, write_offset: jax.Array | int, *,
                     scale: float, impl: ImplName = "auto", window: int | jax.Array | None = None,
                     sinks: jax.Array | None = None) -> jax.Array:
    """An ``models.attention.AttentionFn``; shapes as documented there.

    impl: the tree kernel's lowering for verify passes (``pallas_kernels.impl``): "auto" (Pallas on a GPU, Mosaic
    on a TPU, dense attention elsewhere), "pallas", "interpret" (the GPU kernel in the Pallas interpreter: tests
    on CPU), "tpu", "tpu_interpret", or "reference" (dense attention). Calls that are not verify passes go dense
    whatever impl says. A paged cache (``models.paged_kv.PagedKV``: the server's step programs) goes to
    ``paged_attention``, the prefix read through the page table, in jnp; or, with pages of a power-of-two size
    >= 16, to ``pallas_kernels.paged_tree_attention``: its TPU form on a TPU (or named), its GPU form only with
    impl "pallas" or "interpret" named (not "auto": the GPU form has not run on a GPU yet).

    A layer's sliding ``window`` and attention ``sinks`` (gpt-oss, Gemma-3, Mistral) go wherever the call goes: the
    kernels take a window that is a Python int (an unrolled layer's) and read only its blocks; a traced one (a
    scanned stack's) goes to the jnp forms.
    """
    extra = dict(window=window, sinks=sinks)
    if window is not None and not isinstance(window, (int, np.integer)):
        attend = paged_attention if isinstance(k_cache, PagedKV) else dense_attention
        return attend(q, k_cache, v_cache, k_new, v_new, cache_len, local_mask, write_offset, scale=scale, **extra)
    if window is not None:
        extra["window"] = int(window)
    if isinstance(k_cache, PagedKV):
        page_size = k_cache.page_size
        named = impl in ("pallas", "interpret") or resolve_impl(impl, "paged_tree_attention").is_tpu
        if named and page_size >= 16 and not page_size & (page_size - 1):
            return _paged_kernel(q, k_cache, v_cache, k_new, v_new, cache_len, local_mask, write_offset,
                                 scale=scale, impl=impl, **extra)
        return paged_attention(q, k_cache, v_cache, k_new, v_new, cache_len, local_mask, write_offset, scale=scale,
                               **extra)
    tree_mask = local_mask
    if local_mask is None and q.shape[1] == 1:  # a plain decode step's one token: a tree of one node
        tree_mask = jnp.ones((q.shape[0], 1, 1), bool)
    if is_verify_pass(q, tree_mask, write_offset) and resolve_impl(impl, "tree_attention") is not Impl.REFERENCE:
        # On a mesh each device runs the kernel on its rows and its heads (KV heads split as its query heads are).
        args, specs = _with_sinks([q, k_cache, v_cache, cache_len, k_new, v_new, tree_mask],
                                  [KV_CACHE, kv_spec(KV_CACHE, k_cache.shape), kv_spec(KV_CACHE, v_cache.shape),
                                   P("data"), kv_spec(KV_CACHE, k_new.shape), kv_spec(KV_CACHE, v_new.shape),
                                   P("data")], sinks)
        kernel = per_shard(lambda *a: tree_attention(*a[:7], scale=scale, impl=impl, window=extra["window"],
                                                     sinks=a[7] if len(a) > 7 else None),
                           in_specs=specs, out_specs=KV_CACHE)
        return kernel(*args)
    return dense_attention(q, k_cache, v_cache, k_new, v_new, cache_len, local_mask, write_offset, scale=scale,
                           **extra)


def _with_sinks(args: list, specs: list, sinks: jax.Array | None) -> tuple[tuple, tuple]:
    """A kernel's arguments and their PartitionSpecs, the sinks f32[Hq] last where the layer has them (split over
    "model" as the query heads are)."""
    if sinks is None:
        return tuple(args), tuple(specs)
    return tuple(args) + (sinks,), tuple(specs) + (P("model"),)


def _paged_kernel(q, k_cache: PagedKV, v_cache: PagedKV, k_new, v_new, cache_len, local_mask, write_offset, *,
                  scale: float, impl: ImplName, window: int | None = None, sinks: jax.Array | None = None):
    """``paged_attention``'s contract (new tokens at the window's start; causal without a mask) through the paged
    tree-attention kernel, each device on its rows and its KV heads on a mesh."""
    batch, num_new = q.shape[:2]
    if not (isinstance(write_offset, (int, np.integer)) and int(write_offset) == 0):
        raise ValueError(f"paged attention reads new tokens from k_new/v_new: write_offset must be the int 0, got "
                         f"{write_offset!r}")
    if local_mask is None:
        local_mask = jnp.broadcast_to(jnp.tril(jnp.ones((num_new, num_new), bool)), (batch, num_new, num_new))
    args, specs = _with_sinks(
        [q, k_cache.pages, v_cache.pages, k_cache.page_table, cache_len, k_new, v_new, local_mask],
        [KV_CACHE, kv_spec(KV_POOL, k_cache.pages.shape), kv_spec(KV_POOL, v_cache.pages.shape), P("data"),
         P("data"), kv_spec(KV_CACHE, k_new.shape), kv_spec(KV_CACHE, v_new.shape), P("data")], sinks)
    kernel = per_shard(lambda *a: paged_tree_attention(*a[:8], scale=scale, impl=impl, window=window,
                                                       sinks=a[8] if len(a) > 8 else None),
                       in_specs=specs, out_specs=KV_CACHE)
    return kernel(*args)
