"""The device mesh and every partition rule: tensor parallelism over "model", batch rows over "data".

One ``jax.sharding.Mesh`` with axes ("data", "model") holds ``data_parallel_size x tensor_parallel_size``
devices (on one host or several, after ``jax.distributed.initialize``). The rules (Megatron):

    embed_tokens/embedding [V, H]        vocabulary split over "model" (a lookup is a masked local gather + psum)
    q/k/v/gate/up_proj/kernel [in, out]  output features split over "model" (whole heads per device)
    o/down_proj/kernel [in, out]         input features split over "model" (one all-reduce after each)
    lm_head/kernel [H, V]                vocabulary split over "model" (logits gathered for sampling)
    norms, o/down biases                 replicated
    target KV cache [B, S, Hkv, D]       rows over "data", KV heads over "model"; DeepSeek-V3's latent cache
                                         [B, S, 1, r + rope] (one head every query head reads) replicated over
                                         "model", as vLLM keeps it under tensor parallelism (:func:`kv_spec`)
    decode state (tokens, lengths ...)   rows over "data", replicated over "model"

Stacked parameters (``layers/...`` with a leading L axis) get the same rule behind a replicated L axis.

When the target has fewer KV heads than "model" devices, each KV head is repeated ``tp / Hkv`` times
(:func:`expand_kv_heads`, as sglang-jax and tpu-inference do), so every device holds exactly one KV head, the one
its query heads read: attention is unchanged (a query head reads the same K/V values), and the cost is the KV cache
and the k/v projections stored ``tp / Hkv`` times over in total (per device: one head instead of ``Hkv / tp``).

Drafters choose (``Drafter.param_specs``; a drafter without it is replicated), batch rows over "data" always:

- the EAGLE-3 head is split by the same rules when its heads, KV heads and MLP divide by tp, else replicated; fc
  (3H -> H, run once per step by the commit's extend) stays whole. The head is one layer: splitting adds 2
  all-reduces of [B, T, H] per head forward (o_proj, down_proj) and a gather of its draft-vocabulary logits, and
  saves reading (tp - 1) / tp of its layer and lm_head on every one of the num_steps forwards per step; for
  Llama-3.1-70B's head (2.8 GB bf16, 0.4 GB of it fc) at tp=8 that is ~0.72 ms -> ~0.09 ms of HBM reads per
  forward for ~2 x 15 us of all-reduce latency (docs/scaling.md). The target's hidden states the head reads are
  pinned whole on every "model" device (``TAPS``), so the head's split never reshapes the target's;
- a draft model is replicated: each of its layers would add two all-reduces per draft forward, which for a small
  draft model of many layers costs about what the split saves (Llama-3.2-1B for a 70B target: 16 layers,
  33 all-reduces x 10-20 us = 0.3-0.7 ms against 0.75 -> 0.09 ms of weight reads);
- the n-gram drafter has no weights; its token buffer is split by rows.

The drafter reads the target's (vocabulary-split) embedding: one all-reduce per draft forward's lookup.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from models.config import ModelConfig

MESH_AXES = ("data", "model")
ROWS = P("data")                          # [B, ...] arrays: batch rows over "data"
KV_CACHE = P("data", None, "model", None)  # [B, S, Hkv, D]
KV_POOL = P(None, None, "model", None)  # [num_pages, page_size, Hkv, D]: pages shared by every row
TAPS = P(None, "data")                     # [K, B, T, H] the target's hidden states a drafter reads: whole rows

# output features split (MLA's q_b_proj and kv_b_proj: by heads; its q_a/kv_a projections to the latents whole)
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj")
_ROW = ("o_proj", "down_proj")                                    # input features split


def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("data", "model") mesh over the first ``data_parallel_size * tensor_parallel_size`` devices
    (``jax.devices()``: every process's devices once ``jax.distributed`` is initialized)."""
    for name, value in (("tensor_parallel_size", tensor_parallel_size), ("data_parallel_size", data_parallel_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r}: expected an integer >= 1")
    devices = list(jax.devices() if devices is None else devices)
    need = tensor_parallel_size * data_parallel_size
    if need > len(devices):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} x data_parallel_size={data_parallel_size} "
                         f"needs {need} devices, but only {len(devices)} ({devices[0].platform}) are available")
    grid = np.asarray(devices[:need], dtype=object).reshape(data_parallel_size, tensor_parallel_size)
    return Mesh(grid, MESH_AXES)


def mesh_sizes(mesh: Mesh) -> tuple[int, int]:
    """(data_parallel_size, tensor_parallel_size) of a ("data", "model") mesh; ValueError for another mesh."""
    if tuple(mesh.axis_names) != MESH_AXES:
        raise ValueError(f"mesh axes {tuple(mesh.axis_names)}: expected {MESH_AXES} (jspec.sharding.make_mesh)")
    return int(mesh.shape["data"]), int(mesh.shape["model"])


def check_tensor_parallel(config: ModelConfig, tensor_parallel_size: int, what: str = "target") -> None:
    """Raises ValueError naming both numbers when a split dimension does not divide by the "model" axis."""
    tp = tensor_parallel_size
    for name, value in (("num_attention_heads", config.num_heads), ("intermediate_size", config.intermediate_size),
                        ("moe_intermediate_size", config.moe_intermediate_size)):
        if value % tp:
            raise ValueError(f"{what} {name}={value} is not divisible by tensor_parallel_size={tp}")
    kv = config.num_kv_heads
    if config.mla:  # one latent every head reads, on every device
        return
    if kv % tp and tp % kv:
        raise ValueError(f"{what} num_key_value_heads={kv} and tensor_parallel_size={tp}: one must divide the "
                         f"other (KV heads are split over, or repeated across, the model axis)")


def splits_evenly(config: ModelConfig, tensor_parallel_size: int) -> bool:
    """Whether every split of the rules gives each device whole heads (query and KV) and equal MLP slices."""
    tp = tensor_parallel_size
    return (config.num_heads % tp == 0 and (config.mla or config.num_kv_heads % tp == 0)
            and config.intermediate_size % tp == 0 and config.moe_intermediate_size % tp == 0
            and config.shared_expert_size % tp == 0)


def replicated_specs(tree: Any) -> Any:
    """P() for every leaf: the whole array on every device."""
    return jax.tree.map(lambda _: P(), tree)


def kv_repeats(config: ModelConfig, tensor_parallel_size: int) -> int:
    """How many times each KV head is stored so every "model" device holds whole heads (1: no repetition)."""
    kv = config.num_kv_heads
    return tensor_parallel_size // kv if kv < tensor_parallel_size and not config.mla else 1


def expand_kv_heads(params: dict, config: ModelConfig, repeats: int) -> tuple[dict, ModelConfig]:
    """Repeats every KV head ``repeats`` times in k_proj/v_proj (kernel and bias, stacked or per layer) -> (params,
    config with num_kv_heads * repeats). Head j becomes heads j * repeats .. (j + 1) * repeats - 1, so query head h
    still reads the K/V of original head h // (Hq / Hkv): the model's output is unchanged."""
    if repeats == 1:
        return params, config
    head_dim, kv = config.head_dim, config.num_kv_heads

    def expand(path, leaf):
        names = _names(path)
        if len(names) < 2 or names[-2] not in ("k_proj", "v_proj"):
            return leaf
        split = leaf.reshape(leaf.shape[:-1] + (kv, head_dim))
        return jnp.repeat(split, repeats, axis=-2).reshape(leaf.shape[:-1] + (kv * repeats * head_dim,))

    expanded = jax.tree_util.tree_map_with_path(expand, params)
    return expanded, dataclasses.replace(config, num_kv_heads=kv * repeats)


# The array fields of a qwix QArray (a weight-only quantized kernel, models.quantization) as they appear in a path.
QARRAY_FIELDS = ("qvalue", "scale", "zero_point")


def _names(path) -> list[str]:
    return [str(getattr(key, "key", getattr(key, "name", key))) for key in path]


def _rule(names: list[str], vocab_split: bool) -> tuple:
    """The PartitionSpec entries of an unstacked parameter, by its module and leaf name."""
    module, leaf = (names[-2], names[-1]) if len(names) >= 2 else ("", names[-1])
    if module == "embed_tokens" and leaf == "embedding":
        return ("model", None) if vocab_split else (None, None)
    if module == "lm_head" and leaf == "kernel":
        return (None, "model") if vocab_split else (None, None)
    if module in _COLUMN:
        return (None, "model") if leaf == "kernel" else ("model",)
    if module in _ROW and leaf == "kernel":
        return ("model", None)
    return ()


def param_specs(params: Any, config: ModelConfig, tensor_parallel_size: int) -> Any:
    """The PartitionSpec of every leaf of a Llama-family param tree (stacked or per layer), Megatron-style.

    The vocabulary is split only when it divides by tensor_parallel_size (else embedding and lm_head are
    replicated: more bytes per device, no error). A quantized kernel's qvalue splits as the kernel would, its scale
    along the same axes where they still divide (a per-channel scale's size-1 input axis stays whole)."""
    vocab_split = config.vocab_size % tensor_parallel_size == 0

    def spec(path, leaf):
        names = _names(path)
        quantized = len(names) >= 2 and names[-1] in QARRAY_FIELDS and names[-2] == "kernel"
        rule = _rule(names[:-1] if quantized else names, vocab_split)
        shape = np.shape(leaf)
        axes = (None,) * (len(shape) - len(rule)) + rule
        if config.expert_parallel and "experts" in names:  # [..., E, in, out]: whole experts over "data"
            rank = 2 if names[-1] == "bias" else 3  # a bias: [..., E, out]
            axes = axes[:-rank] + ("data",) + axes[len(axes) - rank + 1:]
        if quantized:  # a QArray's qvalue splits like its kernel; its scale where its axis still divides
            axes = tuple(a if a is None or shape[i] % tensor_parallel_size == 0 else None for i, a in enumerate(axes))
        return P(*axes) if rule else P()

    return jax.tree_util.tree_map_with_path(spec, params)


def named(mesh: Mesh, specs: Any) -> Any:
    """PartitionSpecs -> NamedShardings on ``mesh`` (same tree)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def put(value: Any, sharding: NamedSharding) -> jax.Array:
    """A host or device array placed with ``sharding``, also when the mesh spans several processes (each
    process passes the same full value and keeps its own shards)."""
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def to_host(x: jax.Array) -> np.ndarray:
    """The whole value of a (possibly multi-process) array as numpy, on every process."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


# --- inside the program ------------------------------------------------------------------------------------------

@contextlib.contextmanager
def traced_on(mesh: Mesh | None) -> Iterator[None]:
    """Traces the enclosed code on ``mesh`` (its abstract mesh becomes ``jax.sharding.get_abstract_mesh()``), so
    kernels can wrap themselves in ``shard_map``; does nothing for ``mesh=None``."""
    if mesh is None:
        yield
        return
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        yield


def current_mesh():
    """The abstract mesh the program is being traced on (:func:`traced_on`), or None on one device."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def constrain(x: Any, spec: P) -> Any:
    """``with_sharding_constraint`` of every leaf to ``spec`` on the current mesh; identity on one device."""
    mesh = current_mesh()
    if mesh is None:
        return x
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, spec)), x)


def constrain_rows(x: Any) -> Any:
    """Every leaf split by rows over "data" (its leading axis), replicated over "model"."""
    mesh = current_mesh()
    if mesh is None:
        return x
    return jax.tree.map(lambda a: a if np.ndim(a) == 0 else
                        jax.lax.with_sharding_constraint(a, NamedSharding(mesh, ROWS)), x)


def kv_spec(spec: P, shape: Sequence[int], mesh: Any = None) -> P:
    """``spec`` (KV_CACHE, KV_POOL) for a K/V buffer of ``shape`` on ``mesh`` (default: the one traced on): its
    KV-head axis whole where it does not divide by "model" (MLA's one latent head: every device keeps the whole
    latent cache, which all of its query heads read)."""
    mesh = current_mesh() if mesh is None else mesh
    if mesh is None:
        return spec
    return P(*(axis if axis != "model" or shape[i] % mesh.shape["model"] == 0 else None
               for i, axis in enumerate(spec)))


def constrain_kv(x: Any, spec: P) -> Any:
    """:func:`constrain` of every K/V leaf to ``spec`` fitted to its shape (:func:`kv_spec`)."""
    mesh = current_mesh()
    if mesh is None:
        return x
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, kv_spec(spec, a.shape))), x)


def per_shard(fn: Callable, in_specs: Any, out_specs: Any) -> Callable:
    """``fn`` run on each device's shard (``shard_map``) when traced on a mesh, as it is otherwise: how a Pallas
    kernel (which the partitioner cannot split) runs on a mesh."""
    mesh = current_mesh()
    if mesh is None:
        return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def per_device_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of arrays or ``jax.ShapeDtypeStruct`` (a leaf placed nowhere: whole)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        shape = leaf.shape if sharding is None else sharding.shard_shape(leaf.shape)
        total += math.prod(shape) * leaf.dtype.itemsize
    return total
