"""Times tree_attention (Pallas kernel vs the dense XLA reference) and reports achieved bandwidth.

    python scripts/bench_kernels.py --out tree_attention.json          # on a GPU: the full sweep
    python scripts/bench_kernels.py --impl interpret --small           # CPU smoke check, tiny sizes
    python scripts/bench_kernels.py --kernel paged --out paged.json    # = jspec bench --kernel-sweep

``--kernel paged`` runs the paged tree-attention sweep of ``jspec.tools.kernel_sweep`` (what ``jspec bench
--kernel-sweep`` runs): the paged kernel, the jnp paged attention and the dense kernel on the same K/V, against the
device's copy and published HBM bandwidth.

Tree sweep: B in {1, 8, 32}, T in {16, 64}, L in {1k, 8k, 32k}; bf16; Llama-3-8B heads (Hq=32, Hkv=8,
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

import jax

from jspec.tools.kernel_sweep import (Shape, copy_bandwidth, device_memory_bytes, make_inputs, run_kernel_sweep,
                                     time_or_none)
from pallas_kernels.tree_attention import tree_attention


def reference_bytes(shape: Shape) -> int:
    """Rough peak of the dense reference: f32 K/V repeated to Hq heads, and f32 logits."""
    keys = shape.cache_size + shape.tokens
    kv = 2 * shape.batch * keys * shape.q_heads * shape.head_dim * 4
    logits = 2 * shape.batch * shape.q_heads * shape.tokens * keys * 4
    return shape.kv_bytes + kv + logits


def sweep(small: bool) -> list[Shape]:
    if small:
        return [Shape(b, 16, l, 4, 2, 32) for b in (1, 2) for l in (64, 208)]
    return [Shape(b, t, l) for b in (1, 8, 32) for t in (16, 64) for l in (1024, 8192, 32768)]


def bench_shape(shape: Shape, impls: list[str], knobs: dict, iters: int,
                memory: int | None) -> dict:
    """One row of the table: {impl: ms or None (skipped)} plus GB/s for each timed impl."""
    row = dataclasses.asdict(shape)
    if memory is not None and 2 * shape.kv_bytes > memory:
        return {**row, "skipped": "KV cache does not fit"}
    inputs = make_inputs(shape, jax.random.key(0))
    for impl in impls:
        if impl == "reference" and memory is not None and reference_bytes(shape) > 0.9 * memory:
            row[f"{impl}_ms"] = None
            continue
        extra = knobs if impl != "reference" else {}
        ms = time_or_none(jax.jit(functools.partial(tree_attention, impl=impl, **extra)), *inputs, iters=iters)
        row[f"{impl}_ms"] = ms
        row[f"{impl}_gbps"] = None if ms is None else shape.kv_bytes / ms / 1e6
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
    if args.kernel == "paged":
        return run_kernel_sweep(args.impl, small=args.small, iters=args.iters, knobs=knobs)
    memory = device_memory_bytes()
    copy_gbps = copy_bandwidth((16 << 20) if args.small else (1 << 30), iters=args.iters) / 1e9
    impls = [args.impl, "reference"]
    rows = [bench_shape(shape, impls, knobs, args.iters, memory) for shape in sweep(args.small)]
    print(format_table(rows, impls, copy_gbps))
    return dict(device=str(jax.devices()[0]), jax_version=jax.__version__, kernel=args.kernel,
                copy_gbps=copy_gbps, knobs=knobs, rows=rows)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernel", default="tree", choices=["tree", "paged"],
                        help="tree: the tree-attention kernel against its reference; paged: the paged kernel, the "
                             "jnp paged attention and the dense kernel on the same K/V (jspec.tools.kernel_sweep)")
    parser.add_argument("--impl", default="auto", choices=["auto", "pallas", "interpret", "tpu", "tpu_interpret"],
                        help="kernel lowering timed against the reference (pallas_kernels.impl)")
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
