"""Pallas kernels on a mesh, in the Pallas interpreter (tests/jspec/test_sharded_kernels.py runs this in a
subprocess with 4 virtual CPU devices): each device runs the kernel on its own rows and heads under shard_map; the
paged tree-attention kernel in both its forms (Triton, Mosaic TPU).

Prints one JSON object: the largest difference of each sharded kernel call from the same call on one device.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jspec.attention import target_attention
from jspec.sharding import KV_CACHE, KV_POOL, make_mesh, per_shard, traced_on
from models.paged_kv import PagedKV
from pallas_kernels.tree_build import build_dynamic_tree
from pallas_kernels.tree_verify import verify_tree_greedy
from tests.jspec.test_attention import window_inputs


def on_mesh(mesh, fn, *args):
    """fn(*args) jitted and traced on ``mesh`` (as jspec.generate traces its program)."""
    def traced(*a):
        with traced_on(mesh):
            return fn(*a)

    return jax.jit(traced)(*args)


def tree_attention_difference(mesh) -> float:
    # 4 query heads over 2 KV heads, batch 2: dp 2 x tp 2 gives each device one row and one KV head.
    args = window_inputs(0, cache_len=[5, 9], num_new=6, window=6, write_offset=0)
    kernel = functools.partial(target_attention, scale=0.25, write_offset=0, impl="interpret")
    single = kernel(*args)
    specs = (KV_CACHE, KV_CACHE, KV_CACHE, KV_CACHE, KV_CACHE, P("data"), P("data"))
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    sharded = on_mesh(mesh, lambda *a: kernel(*a), *placed)
    assert sharded.sharding.spec[:3] == ("data", None, "model"), sharded.sharding
    return float(jnp.max(jnp.abs(sharded - single)))


def paged_attention_differences(mesh) -> dict:
    """The paged tree-attention kernel per shard (rows over "data", the pool's KV heads over "model"), each form:
    {impl: largest difference from one device}, and one device's from dense attention on the same K/V."""
    page, per_row = 16, 3
    q, k_cache, v_cache, k_new, v_new, cache_len, mask = window_inputs(1, cache_len=[20, 37], num_new=6, window=6,
                                                                       write_offset=0, cache_size=page * per_row)
    batch = q.shape[0]
    order = 1 + np.random.default_rng(2).permutation(batch * per_row)  # page 0: the null page, NaN

    def pool(cache):
        pages = cache.reshape((batch * per_row, page) + cache.shape[2:])
        return jnp.full((1 + batch * per_row,) + pages.shape[1:], jnp.nan, cache.dtype).at[order].set(pages)

    table = jnp.asarray(order.reshape(batch, per_row), jnp.int32)
    dense = target_attention(q, k_cache, v_cache, k_new, v_new, cache_len, mask, 0, scale=0.25, impl="reference")
    report = {}
    for impl in ("interpret", "tpu_interpret"):
        kernel = functools.partial(target_attention, scale=0.25, write_offset=0, impl=impl)
        paged = lambda q, k, v, table, *rest: kernel(q, PagedKV(k, table), PagedKV(v, table), *rest)
        args = (q, pool(k_cache), pool(v_cache), table, k_new, v_new, cache_len, mask)
        single = paged(*args)
        specs = (KV_CACHE, KV_POOL, KV_POOL, P("data"), KV_CACHE, KV_CACHE, P("data"), P("data"))
        placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
        sharded = on_mesh(mesh, paged, *placed)
        report[impl] = float(jnp.max(jnp.abs(sharded - single)))
        report[f"{impl}_vs_dense"] = float(jnp.max(jnp.abs(single - dense)))
    return report


def tree_build_and_verify_differences(mesh) -> dict:
    rng = np.random.default_rng(0)
    topk, num_steps, batch = 2, 3, 4
    parent_list = jnp.asarray(np.tile(np.arange(topk * (num_steps - 1) + 1), (batch, 1)), jnp.int32)
    selected = jnp.asarray(np.stack([np.sort(rng.choice(topk * topk * (num_steps - 1) + topk, 5, replace=False))
                                     for _ in range(batch)]), jnp.int32)
    seq_lens = jnp.asarray([3, 7, 1, 12], jnp.int32)
    build = functools.partial(build_dynamic_tree, topk=topk, num_steps=num_steps, impl="interpret")
    single = build(parent_list, selected, seq_lens)
    rows = NamedSharding(mesh, P("data"))
    sharded = on_mesh(mesh, lambda *a: per_shard(build, in_specs=(P("data"),) * 3, out_specs=P("data"))(*a),
                      *(jax.device_put(a, rows) for a in (parent_list, selected, seq_lens)))
    # retrieve_index numbers (row, node) over the rows the kernel sees (SGLang's flat index): per shard it counts
    # from the shard's first row. jspec reads the other buffers only.
    build_diff = max(int(jnp.sum(getattr(single, f) != getattr(sharded, f))) for f in single._fields
                     if f != "retrieve_index")
    tokens = jnp.asarray(rng.integers(0, 8, (batch, 6)), jnp.int32)
    predict = jnp.asarray(rng.integers(0, 8, (batch, 6)), jnp.int32)
    walk = functools.partial(verify_tree_greedy, num_steps=num_steps, impl="interpret")
    inputs = (tokens, single.retrieve_next_token, single.retrieve_next_sibling, predict)
    verified = walk(*inputs)
    sharded_verified = on_mesh(mesh, lambda *a: per_shard(walk, in_specs=(P("data"),) * 4, out_specs=P("data"))(*a),
                               *(jax.device_put(a, rows) for a in inputs))
    verify_diff = max(int(jnp.sum(jnp.asarray(a) != jnp.asarray(b))) for a, b in zip(verified, sharded_verified))
    return {"tree_build": build_diff, "verify_greedy": verify_diff}


if __name__ == "__main__":
    assert len(jax.devices()) == 4, jax.devices()
    report = {"tree_attention": tree_attention_difference(make_mesh(2, 2)),
              "paged_attention": paged_attention_differences(make_mesh(2, 2))}
    report.update(tree_build_and_verify_differences(make_mesh(1, 4)))
    print(json.dumps(report))
