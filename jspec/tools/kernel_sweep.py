"""The paged tree-attention sweep: bytes moved over time against the device's memory bandwidth.

    jspec bench --kernel-sweep --out $OUT              # on a GPU or TPU: the full sweep, kernel_sweep.json
    jspec bench --kernel-sweep --small --kernel-impl tpu_interpret   # CPU smoke check in an interpreter

Each row times, on the same K/V (bf16, Llama-3-8B heads: Hq 32, Hkv 8, D 128, every row's cache full):
``kernel``, ``pallas_kernels.paged_tree_attention`` over pages of 16 tokens in shuffled order (the serving
engine's layout); ``paged``, ``models.paged_kv.paged_attention`` (the jnp form the server runs by default: a row's
pages gathered, then the prefix and tree partials merged); ``dense``, the dense tree-attention kernel over one
buffer per row; ``mgpu`` and ``mgpu_paged``, the Mosaic GPU forms of the two (``pallas_kernels.tree_attention_mgpu``:
TMA and WGMMA; on a GPU, or in the Mosaic GPU interpreter with ``impl="interpret"``). Sweep: context L in {1k, 4k,
8k, 16k, 32k}, T in {1, 8, 32} tree tokens, batch B in {1, 8, 32, 64}.

Bytes moved = the K and V read from a full cache, 2 * B * L * Hkv * D * itemsize (queries, the tree's own K/V and
the output are under 1% of it at L >= 1k). Each column's bandwidth is reported as a share of the device's measured
copy bandwidth (one read and one write of a 1 GiB array) and, where the device's kind is in ``PEAK_BANDWIDTH``,
of its published HBM bandwidth: the floor is bytes over that bandwidth. A shape whose buffers would not fit in the
device's memory, or that runs out of it, is reported as skipped.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from models.paged_kv import PagedKV, paged_attention
from pallas_kernels.paged_tree_attention import paged_tree_attention
from pallas_kernels.tree_attention import tree_attention
from pallas_kernels.tree_attention_mgpu import supports as mgpu_supports
from pallas_kernels.tree_attention_mgpu import paged_tree_attention_mgpu, tree_attention_mgpu

PAGE_SIZE = 16
COLUMNS = ("kernel", "paged", "dense", "mgpu", "mgpu_paged")
# Published HBM bandwidth (bytes/s) by jax's device_kind. A kind not listed is reported against its measured copy
# bandwidth only.
PEAK_BANDWIDTH = {
    "NVIDIA H100 80GB HBM3": 3.35e12,   # SXM
    "NVIDIA H100 PCIe": 2.0e12,
    "NVIDIA H100 NVL": 3.9e12,
    "NVIDIA H200": 4.8e12,
    "NVIDIA A100-SXM4-80GB": 2.039e12,
    "NVIDIA A100-SXM4-40GB": 1.555e12,
    "TPU v4": 1.2e12,
    "TPU v5 lite": 8.19e11,             # v5e
    "TPU v5": 2.765e12,                 # v5p
    "TPU v6 lite": 1.64e12,             # v6e (Trillium)
}


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    tokens: int
    cache_size: int
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V read from a full cache: 2 * B * L * Hkv * D * itemsize."""
        itemsize = jnp.dtype(self.dtype).itemsize
        return 2 * self.batch * self.cache_size * self.kv_heads * self.head_dim * itemsize


def sweep_shapes(small: bool = False) -> list[Shape]:
    """The sweep: L in {1k, 4k, 8k, 16k, 32k} x T in {1, 8, 32} x B in {1, 8, 32, 64}; ``small``: a CPU smoke check
    (B in {1, 2}, T 8, L in {64, 208}, 4 query heads over 2 KV heads of 32)."""
    if small:
        return [Shape(b, 8, l, 4, 2, 32) for b in (1, 2) for l in (64, 208)]
    return [Shape(b, t, l) for l in (1024, 4096, 8192, 16384, 32768) for t in (1, 8, 32) for b in (1, 8, 32, 64)]


def peak_bandwidth(device: jax.Device) -> float | None:
    """The device's published HBM bandwidth in bytes/s, None when its kind is not in PEAK_BANDWIDTH."""
    return PEAK_BANDWIDTH.get(device.device_kind)


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
    """Device copy bandwidth in bytes/s: one read and one write of an nbytes array."""
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    ms = time_call(jax.jit(lambda a: -a), x, iters=iters)
    return 2 * nbytes / ms * 1e3


def make_inputs(shape: Shape, key) -> tuple:
    """Random dense inputs with a full cache and a chain tree mask (the mask does not change the cost):
    (q, k_cache, v_cache, cache_len, k_new, v_new, mask)."""
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


def bench_shape(shape: Shape, impl: str, iters: int, memory: int | None, bandwidth: dict[str, float],
                knobs: dict | None = None) -> dict:
    """One row: ms, bytes/s and the share of each bandwidth in ``bandwidth`` ({"copy": B/s, "hbm": B/s}) for the
    paged kernel, the jnp paged attention and the dense kernel; their largest difference from the jnp form."""
    row = {**dataclasses.asdict(shape), "kv_bytes": shape.kv_bytes}
    if memory is not None and 5 * shape.kv_bytes > memory:  # dense + pool + the gathered copy, and headroom
        return {**row, "skipped": "KV cache does not fit"}
    knobs = knobs or {}
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
    if (jax.devices()[0].platform == "gpu" or impl == "interpret") and mgpu_supports(*dense[:2]):
        mgpu = dict(scale=scale, interpret=impl == "interpret")
        runs["mgpu"] = (jax.jit(functools.partial(tree_attention_mgpu, **mgpu)), dense)
        runs["mgpu_paged"] = (jax.jit(functools.partial(paged_tree_attention_mgpu, **mgpu)),
                              (q, k_paged.pages, v_paged.pages, k_paged.page_table, cache_len, k_new, v_new, mask))
    outputs = {}
    for name, (fn, args) in runs.items():
        ms = time_or_none(fn, *args, iters=iters)
        row[f"{name}_ms"] = ms
        if ms is None:
            continue
        outputs[name] = fn(*args)
        row[f"{name}_bytes_per_second"] = shape.kv_bytes / ms * 1e3
        for which, value in bandwidth.items():
            row[f"{name}_pct_{which}"] = 100.0 * row[f"{name}_bytes_per_second"] / value
    if "paged" in outputs:
        for name in ("kernel", "dense", "mgpu", "mgpu_paged"):
            if name in outputs:
                difference = jnp.abs(outputs["paged"].astype(jnp.float32) - outputs[name].astype(jnp.float32))
                row[f"max_abs_difference_{name}"] = float(jnp.max(difference))
    return row


def format_row(row: dict, share: str) -> str:
    line = f"{row['batch']:>3} {row['tokens']:>3} {row['cache_size']:>6} "
    if "skipped" in row:
        return line + row["skipped"]
    for name in COLUMNS:
        ms = row.get(f"{name}_ms")
        line += (f"{'skipped':>10} {'':>7} {'':>6} " if ms is None else
                 f"{ms:>10.3f} {row[f'{name}_bytes_per_second'] / 1e9:>7.1f} {row[f'{name}_pct_{share}']:>5.0f}% ")
    return line.rstrip()


def header(share: str) -> str:
    return f"{'B':>3} {'T':>3} {'L':>6} " + " ".join(f"{name + ' ms':>10} {'GB/s':>7} {'%' + share:>6}"
                                                     for name in COLUMNS)


def run_kernel_sweep(impl: str = "auto", small: bool = False, iters: int = 20, knobs: dict | None = None,
                     shapes: list[Shape] | None = None, echo=print) -> dict:
    """Times every shape of the sweep (or ``shapes``) and returns the report (device, bandwidths, rows); prints
    each row through ``echo`` as it is measured. impl: the kernels' lowering (``pallas_kernels.impl``)."""
    device = jax.devices()[0]
    copy = copy_bandwidth((16 << 20) if small else (1 << 30), iters=iters)
    peak = peak_bandwidth(device)
    bandwidth = {"copy": copy} if peak is None else {"copy": copy, "hbm": peak}
    share = "hbm" if peak is not None else "copy"
    echo(f"{device.device_kind}: copy bandwidth {copy / 1e9:.0f} GB/s, published HBM bandwidth "
         f"{'unknown' if peak is None else f'{peak / 1e9:.0f} GB/s'}; kernels impl={impl}; % of {share}")
    echo(header(share))
    memory = device_memory_bytes()
    rows = []
    for shape in (sweep_shapes(small) if shapes is None else shapes):
        rows.append(bench_shape(shape, impl, iters, memory, bandwidth, knobs))
        echo(format_row(rows[-1], share))
    return dict(device=device.device_kind, platform=device.platform, jax_version=jax.__version__, impl=impl,
                page_size=PAGE_SIZE, copy_bytes_per_second=copy, hbm_bytes_per_second=peak, share=share,
                knobs=knobs or {}, rows=rows)
