"""Times tree_attention (Pallas kernel vs the dense XLA reference) and reports achieved bandwidth.

    python scripts/bench_kernels.py --out tree_attention.json          # on a GPU: the full sweep
    python scripts/bench_kernels.py --impl interpret --small           # CPU smoke check, tiny sizes
    python scripts/bench_kernels.py --kernel paged --out paged.json    # attention over a paged cache

``--kernel paged`` times the paged tree-attention kernel (``pallas_kernels.paged_tree_attention``: the prefix read
through the page table) and ``models.paged_kv.paged_attention`` (the jnp form the server's verify passes run by
default: a row's pages gathered per layer, then the prefix and tree partials merged) on pages in shuffled order,
beside the dense tree-attention kernel reading the same K/V laid out as one buffer per row: B in {1, 8, 32},
T in {1, 8, 32}, L in {1k, 8k, 32k}, pages of 16 tokens; each column's bandwidth against the device's copy
bandwidth.

Sweep: B in {1, 8, 32}, T in {16, 64}, L in {1k, 8k, 32k}; bf16; Llama-3-8B heads (Hq=32, Hkv=8,
D=128); every sequence's cache full (cache_len = L). Bandwidth = KV bytes read
(2 * B * L * Hkv * D * itemsize) / time, against the device's copy bandwidth (read + write of a
large array / time).
Configurations whose estimated footprint exceeds device memory, or that run out of it, are skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from models.paged_kv import PagedKV, paged_attention
from pallas_kernels.paged_tree_attention import paged_tree_attention
from pallas_kernels.tree_attention import tree_attention

PAGE_SIZE = 16


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    tokens: int
    cache_size: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V read from a full cache."""
        itemsize = jnp.dtype(self.dtype).itemsize
        return 2 * self.batch * self.cache_size * self.kv_heads * self.head_dim * itemsize

    @property
    def reference_bytes(self) -> int:
        """Rough peak of the dense reference: f32 K/V repeated to Hq heads, and f32 logits."""
        keys = self.cache_size + self.tokens
        kv = 2 * self.batch * keys * self.q_heads * self.head_dim * 4
        logits = 2 * self.batch * self.q_heads * self.tokens * keys * 4
        return self.kv_bytes + kv + logits


def sweep(small: bool, kernel: str = "tree") -> list[Shape]:
    tokens = (16, 64) if kernel == "tree" else (1, 8, 32)
    if small:
        return [Shape(b, t, l, 4, 2, 32) for b in (1, 2) for t in tokens[:1] for l in (64, 208)]
    return [Shape(b, t, l, 32, 8, 128)
            for b in (1, 8, 32) for t in tokens for l in (1024, 8192, 32768)]


def device_memory_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def time_call(fn, *args, iters: int) -> float:
    """Median wall time of fn(*args) in milliseconds, after one compiling call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def time_or_none(fn, *args, iters: int) -> float | None:
    """time_call's milliseconds, or None where the device runs out of memory."""
    try:
        return time_call(fn, *args, iters=iters)
    except jax.errors.JaxRuntimeError as error:
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        return None


def copy_bandwidth(nbytes: int, iters: int) -> float:
    """Device copy bandwidth in GB/s: one read and one write of an nbytes array."""
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    ms = time_call(jax.jit(lambda a: -a), x, iters=iters)
    return 2 * nbytes / ms / 1e6


def make_inputs(shape: Shape, key):
    """Random inputs with a full cache and a chain tree mask (the mask does not change the cost)."""
    dtype = jnp.dtype(shape.dtype)
    keys = jax.random.split(key, 5)
    b, t, l = shape.batch, shape.tokens, shape.cache_size
    q = jax.random.normal(keys[0], (b, t, shape.q_heads, shape.head_dim), dtype)
    cache = (b, l, shape.kv_heads, shape.head_dim)
    new = (b, t, shape.kv_heads, shape.head_dim)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    return (q, jax.random.normal(keys[1], cache, dtype), jax.random.normal(keys[2], cache, dtype),
            jnp.full((b,), l, jnp.int32), jax.random.normal(keys[3], new, dtype),
            jax.random.normal(keys[4], new, dtype), mask)


def bench_shape(shape: Shape, impls: list[str], knobs: dict, iters: int,
                memory: int | None) -> dict:
    """One row of the table: {impl: ms or None (skipped)} plus GB/s for each timed impl."""
    row = dataclasses.asdict(shape)
    if memory is not None and 2 * shape.kv_bytes > memory:
        return {**row, "skipped": "KV cache does not fit"}
    inputs = make_inputs(shape, jax.random.key(0))
    for impl in impls:
        if impl == "reference" and memory is not None and shape.reference_bytes > 0.9 * memory:
            row[f"{impl}_ms"] = None
            continue
        extra = knobs if impl != "reference" else {}
        ms = time_or_none(jax.jit(functools.partial(tree_attention, impl=impl, **extra)), *inputs, iters=iters)
        row[f"{impl}_ms"] = ms
        row[f"{impl}_gbps"] = None if ms is None else shape.kv_bytes / ms / 1e6
    return row


def paged_inputs(shape: Shape, inputs: tuple, key) -> tuple:
    """The dense inputs' cache laid out in pages of PAGE_SIZE in shuffled order (page 0 the null page):
    (q, k PagedKV, v PagedKV, k_new, v_new, cache_len, mask)."""
    q, k_cache, v_cache, cache_len, k_new, v_new, mask = inputs
    per_row = -(-shape.cache_size // PAGE_SIZE)
    order = 1 + jax.random.permutation(key, shape.batch * per_row)
    table = order.reshape(shape.batch, per_row).astype(jnp.int32)

    def paged(cache):
        padded = jnp.pad(cache, ((0, 0), (0, per_row * PAGE_SIZE - shape.cache_size), (0, 0), (0, 0)))
        pages = padded.reshape(shape.batch * per_row, PAGE_SIZE, shape.kv_heads, shape.head_dim)
        pool = jnp.zeros((1 + pages.shape[0],) + pages.shape[1:], cache.dtype).at[order].set(pages)
        return PagedKV(pool, table)

    return q, paged(k_cache), paged(v_cache), k_new, v_new, cache_len, mask


def bench_paged_shape(shape: Shape, impl: str, knobs: dict, iters: int, memory: int | None) -> dict:
    """One row: the paged kernel ("kernel"), the jnp paged attention ("paged") and the dense kernel over the same
    K/V ("dense")."""
    row = dataclasses.asdict(shape)
    if memory is not None and 5 * shape.kv_bytes > memory:  # dense + pool + the gathered copy, and headroom
        return {**row, "skipped": "KV cache does not fit"}
    dense = make_inputs(shape, jax.random.key(0))
    q, k_paged, v_paged, k_new, v_new, cache_len, mask = paged_inputs(shape, dense, jax.random.key(1))
    scale = shape.head_dim ** -0.5
    paged_knobs = {k: v for k, v in knobs.items() if k in ("block_rows", "num_splits")}
    runs = {
        "kernel": (jax.jit(functools.partial(paged_tree_attention, impl=impl, **paged_knobs)),
                   (q, k_paged.pages, v_paged.pages, k_paged.page_table, cache_len, k_new, v_new, mask)),
        "paged": (jax.jit(lambda *a: paged_attention(*a, 0, scale=scale)),
                  (q, k_paged, v_paged, k_new, v_new, cache_len, mask)),
        "dense": (jax.jit(functools.partial(tree_attention, impl=impl, **knobs)), dense),
    }
    outputs = {}
    for name, (fn, args) in runs.items():
        ms = time_or_none(fn, *args, iters=iters)
        if ms is not None:
            outputs[name] = fn(*args)
        row[f"{name}_ms"] = ms
        row[f"{name}_gbps"] = None if ms is None else shape.kv_bytes / ms / 1e6
    if "paged" in outputs:
        for name in ("kernel", "dense"):
            if name in outputs:
                difference = jnp.abs(outputs["paged"].astype(jnp.float32) - outputs[name].astype(jnp.float32))
                row[f"max_abs_difference_{name}"] = float(jnp.max(difference))
    return row


def format_table(rows: list[dict], impls: list[str], copy_gbps: float) -> str:
    header = f"{'B':>3} {'T':>3} {'L':>6} " + " ".join(
        f"{impl + ' ms':>14} {'GB/s':>7} {'%copy':>6}" for impl in impls)
    lines = [f"device copy bandwidth: {copy_gbps:.0f} GB/s", header]
    for row in rows:
        line = f"{row['batch']:>3} {row['tokens']:>3} {row['cache_size']:>6} "
        if "skipped" in row:
            lines.append(line + row["skipped"])
            continue
        for impl in impls:
            ms, gbps = row.get(f"{impl}_ms"), row.get(f"{impl}_gbps")
            line += (f"{'skipped':>14} {'':>7} {'':>6} " if ms is None else
                     f"{ms:>14.3f} {gbps:>7.1f} {100 * gbps / copy_gbps:>5.0f}% ")
        lines.append(line.rstrip())
    return "\n".join(lines)


def run(args) -> dict:
    knobs = {k: v for k, v in dict(block_k=args.block_k, block_rows=args.block_rows,
                                   num_splits=args.num_splits).items() if v is not None}
    memory = device_memory_bytes()
    copy_gbps = copy_bandwidth((16 << 20) if args.small else (1 << 30), iters=args.iters)
    if args.kernel == "paged":
        impls = ["kernel", "paged", "dense"]
        rows = []
        print(format_table([], impls, copy_gbps), flush=True)
        for shape in sweep(args.small, "paged"):
            rows.append(bench_paged_shape(shape, args.impl, knobs, args.iters, memory))
            print(format_table(rows[-1:], impls, copy_gbps).splitlines()[-1], flush=True)
    else:
        impls = [args.impl, "reference"]
        rows = [bench_shape(shape, impls, knobs, args.iters, memory) for shape in sweep(args.small)]
    print(format_table(rows, impls, copy_gbps))
    return dict(device=str(jax.devices()[0]), jax_version=jax.__version__, kernel=args.kernel,
                copy_gbps=copy_gbps, knobs=knobs, rows=rows)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernel", default="tree", choices=["tree", "paged"],
                        help="tree: the tree-attention kernel against its reference; paged: attention over a paged "
                             "cache (jnp) against the dense kernel on the same K/V")
    parser.add_argument("--impl", default="pallas", choices=["pallas", "interpret"],
                        help="kernel implementation timed against the reference")
    parser.add_argument("--small", action="store_true", help="tiny sizes (CPU smoke check)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--block-k", type=int, default=None)
    parser.add_argument("--block-rows", type=int, default=None)
    parser.add_argument("--num-splits", type=int, default=None)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    result = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
