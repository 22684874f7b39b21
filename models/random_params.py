"""Random parameters of a model's shapes, drawn on the host (tests, synthetic benchmarks, drafter training starts).

Running a Flax ``init`` traces the network's forward pass and, outside jit, runs it op by op: every op a small
program XLA compiles, and ``nn.scan`` a whole compiled layer, for values that depend only on the shapes. Here the
tree of shapes (``jax.eval_shape`` of the init: tracing only) is filled with numpy draws instead, by leaf name, with
Flax's default scales:

    kernel     [..., in, out]  normal, std 1/sqrt(in)      (lecun; stacked layers keep a leading L axis)
    embedding  [V, H]          normal, std 1/sqrt(H)
    bias       [..., n]        zeros
    weight     [..., n]        ones                         (RMSNorm scales)
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import numpy as np


def cached_shapes(param_shapes: Callable[..., Any]) -> Callable[..., Any]:
    """``param_shapes(config, dtype)`` traced once per (config, dtype) in a process (configs are frozen dataclasses);
    each call gets its own containers over the shared, immutable ``jax.ShapeDtypeStruct`` leaves."""
    traced = functools.lru_cache(maxsize=256)(param_shapes)

    @functools.wraps(param_shapes)
    def shapes(config, dtype=jax.numpy.float32):
        return jax.tree.map(lambda leaf: leaf, traced(config, dtype))

    return shapes


def host_rng(key: jax.Array) -> np.random.Generator:
    """A numpy generator seeded by a JAX key (typed ``jax.random.key`` or raw ``PRNGKey``): equal keys, equal draws."""
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return np.random.default_rng(np.asarray(key, np.uint32).ravel().tolist())


def _draw(path, leaf: jax.ShapeDtypeStruct, rng: np.random.Generator) -> jax.Array:
    name = path[-1].key if hasattr(path[-1], "key") else str(path[-1])
    shape = tuple(leaf.shape)
    if name == "kernel":
        values = rng.standard_normal(shape, np.float32) / np.sqrt(shape[-2])
    elif name == "embedding":
        values = rng.standard_normal(shape, np.float32) / np.sqrt(shape[-1])
    elif name == "bias":
        values = np.zeros(shape, np.float32)
    elif name == "weight":
        values = np.ones(shape, np.float32)
    elif name == "sinks":  # attention sinks: logits on the scores' scale, so they move the softmax
        values = rng.standard_normal(shape, np.float32)
    elif name == "e_score_correction_bias":  # DeepSeek's router: on the sigmoid scores' scale, so it moves choices
        values = 0.1 * rng.standard_normal(shape, np.float32)
    else:
        raise ValueError(f"random_params: parameter {jax.tree_util.keystr(path)} {shape} has no known initializer "
                         f"(expected a leaf named kernel, embedding, bias, weight, sinks or e_score_correction_bias)")
    return jax.numpy.asarray(values.astype(leaf.dtype))


def random_params(shapes: Any, key: jax.Array) -> Any:
    """shapes: a param tree of ``jax.ShapeDtypeStruct`` -> the same tree of device arrays, drawn from ``key``."""
    rng = host_rng(key)
    return jax.tree_util.tree_map_with_path(lambda path, leaf: _draw(path, leaf, rng), shapes)
