"""The memory floor of a decode step: the bytes it must read from device memory, and the measured device copy
bandwidth that turns them into seconds.

Memory floor per step (seconds) = bytes read per step / measured device copy bandwidth, where bytes =
target weights (the embedding table only when it is also the LM head: otherwise one row per token is
gathered) + target KV at the mean context (2 * layers * batch * mean_context * kv_heads * head_dim * itemsize)
+ for speculative steps, per drafter forward: the head's weights (fc only in the one forward that reads
target features) and its one-layer KV; a DFlash step: its weights and its layers' context KV once (one forward
drafts the block).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp

from jspec.config import SpecConfig
from jspec.tools.roofline.shapes import DFLASH, SyntheticModels
from models.checkpoint import DTYPES
from models.config import ModelConfig


def tree_bytes(tree: Any) -> int:
    return int(sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree)))


def target_weight_bytes(config: ModelConfig, params_t: Any) -> int:
    """Bytes of target weights one forward reads: all of them, less the embedding table unless it is tied
    (an untied embedding is gathered one row per token)."""
    total = tree_bytes(params_t)
    return total if config.tie_word_embeddings else total - tree_bytes(params_t["embed_tokens"])


def kv_bytes(config: ModelConfig, batch: int, context: float, itemsize: int) -> float:
    """K and V bytes of ``context`` tokens in every layer: 2 * layers * batch * context * kv_heads * head_dim."""
    return 2.0 * config.num_layers * batch * context * config.num_kv_heads * config.head_dim * itemsize


def drafter_forwards(method: str, spec: SpecConfig) -> int:
    """Drafter forwards per step. EAGLE-3: max_depth - 1 while drafting (the deepest nodes draft nothing) + 1
    extend; DFlash: one (the block; the context write of the committed tokens rides in the same step)."""
    return 1 if method == DFLASH else spec.max_depth


def floor_bytes(models: SyntheticModels, method: str, batch: int, context: float) -> dict[str, float]:
    """Bytes one decode step must read from device memory (see the module docstring), by part."""
    itemsize = jnp.dtype(DTYPES[models.shape.dtype]).itemsize
    parts = {"target_weights": float(target_weight_bytes(models.target, models.params_t)),
             "target_kv": kv_bytes(models.target, batch, context, itemsize),
             "drafter_weights": 0.0, "drafter_kv": 0.0}
    spec = models.shape.spec(method)
    if method == DFLASH:
        parts["drafter_weights"] = float(tree_bytes(models.params_f))
        parts["drafter_kv"] = kv_bytes(models.dflash.layer, batch, context, itemsize)
    elif spec is not None:
        head = models.params_d["head"]
        forwards = drafter_forwards(method, spec)
        fc = tree_bytes(head["fc"])
        parts["drafter_weights"] = float(forwards * (tree_bytes(head) - fc) + fc)
        parts["drafter_kv"] = forwards * kv_bytes(models.head.layer, batch, context, itemsize)
    parts["total"] = sum(parts.values())
    return parts


def measure_copy_bandwidth(num_bytes: int, iterations: int = 20, repeats: int = 5) -> tuple[float, list[float]]:
    """Device copy bandwidth: bytes read + written per second by an elementwise pass over a bf16 array of
    ``num_bytes`` -> (median bytes/s, seconds per pass). Each timing is ``iterations`` separate calls queued
    back to back (dispatch overlaps the device's work; separate calls cannot be fused into one pass)."""
    x = jnp.zeros((num_bytes // 2,), jnp.bfloat16)
    one_pass = jax.jit(lambda a: a + jnp.ones((), a.dtype))
    jax.block_until_ready(one_pass(x))
    per_pass = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iterations):
            out = one_pass(x)  # the previous output is freed once its pass is done
        jax.block_until_ready(out)
        per_pass.append((time.perf_counter() - start) / iterations)
    return 2 * x.nbytes / statistics.median(per_pass), per_pass


def default_copy_bytes() -> int:
    return (16 << 20) if jax.default_backend() == "cpu" else (1 << 30)
