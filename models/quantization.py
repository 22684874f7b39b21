"""Weight-only quantization of a model's linear layers with qwix: int8 and fp8 per output channel, int4 per group.

A quantized kernel is a ``qwix.QArray`` in the param tree where the float ``kernel`` was (``qvalue`` [..., in, out]
in int8 / float8_e4m3fn / int4, ``scale`` [..., 1 or in / group, out] in the compute dtype), so every tree
operation the engine does (unstacking layers, slicing, sharding, donation) applies to it leaf by leaf, and
``models.dense.Dense`` multiplies by it through ``qwix.dot_general`` (the weight dequantized next to the matmul,
which XLA fuses into it: the int8 / int4 bytes are what is read from memory). Activations stay in the compute dtype.

Which kernels: every ``Dense`` kernel (``kernel`` leaves of rank >= 2: attention and MLP projections, a mixture's
experts but not its router, an EAGLE-3 head's ``fc``, MTP's ``eh_proj``, DFlash's projections), ``lm_head`` only
with ``lm_head=True``, the target's
``embed_tokens`` table only with ``embeddings=True`` (vLLM's and llm-compressor's default is to leave ``lm_head`` and
the embeddings unquantized).
Scales are absmax (qwix's default calibration): symmetric, no zero point.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import qwix

SCHEMES = ("int8", "fp8", "int4")
QTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "int4": jnp.int4}


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    """scheme: "int8" | "fp8" (per output channel) | "int4" (per group of ``group_size`` input features, as GPTQ and
    AWQ checkpoints are); lm_head: quantize the output projection too; embeddings: the embedding table too (a scale
    per vocabulary row; a tied lm_head is its own kernel in the inference layout, quantized with ``lm_head``)."""

    scheme: str
    group_size: int = 128
    lm_head: bool = False
    embeddings: bool = False

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"quantization={self.scheme!r}: expected one of {SCHEMES}")
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size={self.group_size!r}: expected a positive integer")

    @classmethod
    def coerce(cls, value: "QuantizationConfig | str | None") -> "QuantizationConfig | None":
        """None, a scheme name or a QuantizationConfig -> QuantizationConfig or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(value)
        raise ValueError(f"quantization={value!r}: expected None, one of {SCHEMES} or a QuantizationConfig")


def is_quantized(leaf: Any) -> bool:
    return isinstance(leaf, qwix.QArray)


def quantizes(names: Sequence[str], ndim: int, config: QuantizationConfig) -> bool:
    """Whether the leaf at ``names`` (its path's keys), of rank ``ndim``, is one ``config`` quantizes."""
    if ndim < 2 or not names:
        return False
    if names[-1] == "embedding":
        return config.embeddings and len(names) >= 2 and names[-2] == "embed_tokens"
    if names[-1] != "kernel":
        return False
    if tuple(names[-3:-1]) == ("mlp", "gate"):  # a mixture of experts' router stays in float (llm-compressor's default)
        return False
    return config.lm_head or (len(names) < 2 or names[-2] != "lm_head")


def quantize_kernel(kernel: jax.Array, config: QuantizationConfig, name: str = "kernel") -> qwix.QArray:
    """kernel [..., in, out] (leading axes: stacked layers), or an embedding table [V, H] -> QArray; a scale per
    output channel (per vocabulary row) and per layer, for int4 per group of ``config.group_size`` input features
    too."""
    contracting = kernel.ndim - 1 if name.endswith("embedding") else kernel.ndim - 2
    channelwise = tuple(axis for axis in range(kernel.ndim) if axis != contracting)
    tiled = {}
    if config.scheme == "int4":
        features = kernel.shape[contracting]
        if features % config.group_size:
            raise ValueError(f"int4 quantization of {name} {tuple(kernel.shape)}: its {features} input features are "
                             f"not a multiple of group_size={config.group_size}")
        tiled = {contracting: config.group_size}
    return qwix.quantize(kernel, QTYPES[config.scheme], channelwise_axes=channelwise, tiled_axes=tiled)


def quantize_params(params: Any, config: QuantizationConfig | str | None) -> Any:
    """A param tree with every quantized kernel (see the module docstring) replaced by its QArray; the tree as it
    is for ``config=None``. Already-quantized kernels are kept."""
    config = QuantizationConfig.coerce(config)
    if config is None:
        return params

    def quantize(path, leaf):
        names = [str(getattr(key, "key", getattr(key, "name", key))) for key in path]
        if is_quantized(leaf) or not quantizes(names, jnp.ndim(leaf), config):
            return leaf
        return quantize_kernel(leaf, config, name="/".join(names))

    return jax.tree_util.tree_map_with_path(quantize, params, is_leaf=is_quantized)


# --- stored quantized (jspec convert --quantization) ------------------------------------------------------------
#
# On disk a quantized kernel is two leaves, ``<path>/qvalue`` and ``<path>/scale``; int4 values are held in int8
# (one per byte: the checkpoint store has no 4-bit type) and narrowed again at load.

def stored_leaves(leaves: Iterable[tuple[tuple[str, ...], np.ndarray]],
                  config: QuantizationConfig) -> Iterator[tuple[tuple[str, ...], np.ndarray]]:
    """(path, float array) pairs -> the pairs a quantized checkpoint stores, one source leaf at a time."""
    for path, array in leaves:
        if not quantizes(path, np.ndim(array), config):
            yield path, array
            continue
        quantized = quantize_kernel(jnp.asarray(array, jnp.float32), config, name="/".join(path))
        del array
        qvalue = quantized.qvalue.astype(jnp.int8) if quantized.qvalue.dtype == jnp.int4 else quantized.qvalue
        yield path + ("qvalue",), np.asarray(qvalue)
        yield path + ("scale",), np.asarray(quantized.scale)


def as_stored(tree: Any) -> Any:
    """A tree with QArrays (arrays, abstract arrays or shardings) -> the same with each as {"qvalue", "scale"}, an
    int4 qvalue's abstract array widened to int8 as stored."""
    def widen(x):
        if isinstance(x, jax.ShapeDtypeStruct) and x.dtype == jnp.int4:
            return jax.ShapeDtypeStruct(x.shape, jnp.int8, sharding=x.sharding)
        return x

    return jax.tree.map(lambda q: {"qvalue": widen(q.qvalue), "scale": q.scale} if is_quantized(q) else q, tree,
                        is_leaf=is_quantized)


def from_stored(tree: Any, abstract: Any) -> Any:
    """``as_stored``'s form of restored params -> QArrays again, shaped by ``abstract`` (the quantized abstract
    params): each qvalue narrowed to its qtype."""
    def rebuild(spec, stored):
        if not is_quantized(spec):
            return stored
        return qwix.QArray(stored["qvalue"].astype(spec.qvalue.dtype), stored["scale"], qtype=spec.qtype)

    return jax.tree.map(rebuild, abstract, tree, is_leaf=is_quantized)


def cpu_int4(params: Any) -> Any:
    """The tree with its int4 arrays re-placed as uncommitted arrays on a CPU backend. XLA:CPU holds int4 arrays one
    value per byte while a program compiled ahead of time (the engine's) asks for them packed two per byte, and
    JAX refuses a committed array whose layout differs (an uncommitted one is converted when the program runs:
    same values). Elsewhere, and for other dtypes, the tree is returned as it is."""
    if jax.default_backend() != "cpu":
        return params

    def place(leaf):
        if getattr(leaf, "dtype", None) != jnp.int4:
            return leaf
        if len(leaf.sharding.device_set) > 1:
            raise ValueError("int4 weights split over several CPU devices: XLA:CPU cannot hold them as the "
                             "compiled program wants (one device, or int8 / fp8, works)")
        return jax.device_put(np.asarray(leaf))

    return jax.tree.map(place, params)


def weight_bytes(params: Any, per_device: bool = False) -> int:
    """Bytes of a param tree's arrays (int4 counted at half a byte); ``per_device``: the largest over devices of
    the bytes of the shards each holds (``addressable_shards``)."""
    def nbytes(array) -> float:
        bits = 4 if array.dtype in (jnp.int4, jnp.uint4) else 8 * array.dtype.itemsize
        return array.size * bits / 8

    leaves = jax.tree.leaves(params)
    if not per_device:
        return int(sum(nbytes(leaf) for leaf in leaves))
    held: dict = {}
    for leaf in leaves:
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + nbytes(shard.data)
    return int(max(held.values()))
