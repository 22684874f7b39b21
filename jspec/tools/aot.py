"""Programs compiled ahead of time for hardware this machine does not have, by the real compiler for it:
- a TPU slice's compile-only devices from libtpu (``pip install -e ".[aot]"``), Mosaic kernels included;
- an H100's (one, or a node of eight) from JAX's CUDA plugin (``pip install -e ".[aot]"``) and XLA's GPU target
  description of the chip (``gpu_targets/``), Triton kernels included; no GPU or driver needed, but the process's
  own backends must be the CPU's (``JAX_PLATFORMS=cpu``: the plugin's failed start would take its compiler with it).

    devices = devices_for("v5e", 1)                     # or devices_for("h100", 8)
    compiled = compile_for(fun, [jax.ShapeDtypeStruct(shape, dtype), ...], devices)
    compiled.cost_analysis(), compiled.memory_analysis()

The interpreters do not apply the compilers' layout and resource rules; this is how a kernel or a program is known
to build where users run it (tests/aot, ``jspec bench --aot``).
"""

from __future__ import annotations

import functools
import importlib.resources
import importlib.util
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Compile-only topologies of each TPU generation: the smallest slice libtpu names (a program on fewer chips takes
# the first of its devices), and the 8-chip slices.
TPU_TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
TPU_SLICES_OF_8 = {"v4": "v4:2x2x2", "v5e": "v5e:2x4", "v5p": "v5p:2x2x2", "v6e": "v6e:2x4"}
# GPUs by XLA's target description of one (jspec/tools/gpu_targets), with what the description lacks: the dense
# bf16 tensor-core peak from the vendor's datasheet (H100 SXM: 989.4 TFLOP/s; 1,979 is with 2:4 sparsity).
GPU_TARGETS = {"h100": ("h100_sxm.txtpb", 989.4e12)}
CHIPS = tuple(TPU_TOPOLOGIES) + tuple(GPU_TARGETS)


def devices_for(chip: str, count: int = 1) -> tuple:
    """``count`` compile-only devices of ``chip`` (a TPU generation of :data:`TPU_TOPOLOGIES`, or a GPU of
    :data:`GPU_TARGETS` in one node): 1 to 8."""
    if chip in GPU_TARGETS:
        return gpu_devices(chip, count)
    devices = tpu_devices(chip)
    if count > len(devices):
        devices = _tpu_slice_of_8(chip) if count <= 8 else ()
    if count > len(devices) or count < 1:
        raise ValueError(f"{count} chips of {chip}: expected 1 to 8")
    return devices[:count]


@functools.cache
def tpu_devices(chip: str) -> tuple:
    """The compile-only devices of ``chip``'s topology (:data:`TPU_TOPOLOGIES`); no TPU needed, libtpu is."""
    if chip not in TPU_TOPOLOGIES:
        raise ValueError(f"chip={chip!r}: expected one of {list(CHIPS)}")
    if importlib.util.find_spec("libtpu") is None:
        raise RuntimeError('compiling for a TPU needs libtpu on this machine: pip install -e ".[aot]"')
    from jax.experimental import topologies

    # Compile-only: several processes may hold libtpu at once (pytest's workers), which its lockfile forbids.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return tuple(topologies.get_topology_desc(platform="tpu", topology_name=TPU_TOPOLOGIES[chip]).devices)


@functools.cache
def _tpu_slice_of_8(chip: str) -> tuple:
    from jax.experimental import topologies

    tpu_devices(chip)  # libtpu present, or the error that says how to install it
    return tuple(topologies.get_topology_desc(platform="tpu", topology_name=TPU_SLICES_OF_8[chip]).devices)


@functools.cache
def gpu_devices(chip: str, count: int = 1) -> tuple:
    """``count`` (1 to 8, one node) compile-only devices of the GPU ``chip`` (:data:`GPU_TARGETS`); no GPU needed,
    JAX's CUDA plugin is, and a process whose backends are the CPU's."""
    if chip not in GPU_TARGETS:
        raise ValueError(f"chip={chip!r}: expected one of {list(CHIPS)}")
    if not 1 <= count <= 8:
        raise ValueError(f"{count} GPUs of {chip}: expected 1 to 8 (one node)")
    if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        raise RuntimeError('compiling for a GPU needs JAX\'s CUDA plugin on this machine: pip install -e ".[aot]"')
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(platform="cuda", topology_name="", topology=f"1x1x{count}",
                                                target_config=gpu_target_config(chip))
    except NotImplementedError:
        raise RuntimeError(f"compiling for {chip} here needs JAX_PLATFORMS=cpu: the CUDA plugin failed to start "
                           "without a GPU, and took its compiler with it") from None
    return tuple(topology.devices)


def gpu_target_config(chip: str) -> str:
    """XLA's GpuTargetConfigProto for ``chip``, in text form."""
    return importlib.resources.files("jspec.tools").joinpath("gpu_targets", GPU_TARGETS[chip][0]).read_text()


def chip_figures(chip: str) -> dict:
    """One device of ``chip``: HBM bytes, HBM bytes/s and bf16 flop/s (Pallas's TPU table, per TensorCore, times the
    device's cores for a TPU; XLA's target description and the datasheet's dense peak for a GPU)."""
    if chip in GPU_TARGETS:
        text = gpu_target_config(chip)
        field = lambda name: int(text.split(f"{name}:")[1].split()[0])
        return {"hbm_bytes": field("device_memory_size"), "hbm_bytes_per_second": field("memory_bandwidth"),
                "bf16_flops_per_second": GPU_TARGETS[chip][1]}
    from jax.experimental.pallas import tpu as pltpu

    device = tpu_devices(chip)[0]
    with jax.default_device(device):
        info = pltpu.get_tpu_info()
    cores = getattr(device, "num_cores", 1)  # the table is a TensorCore's; a v5p device is a chip of two (megacore)
    return {"hbm_bytes": cores * info.hbm_capacity_bytes, "hbm_bytes_per_second": cores * info.mem_bw_bytes_per_second,
            "bf16_flops_per_second": cores * info.bf16_ops_per_second}


def cost_of(compiled) -> dict:
    """{"flops", "bytes accessed"} of one device's part of a compiled program: its compiler's own analysis where it
    gives one (TPU); a compile-only GPU program has none, so XLA's HloCostAnalysis of its optimized module (bytes at
    the fusions' boundaries; custom calls, a Pallas kernel or a cuBLAS gemm, count nothing: ``custom_calls``)."""
    cost = compiled.cost_analysis()
    if cost:
        return {"flops": float(cost["flops"]), "bytes accessed": float(cost["bytes accessed"])}
    from jax._src.lib import xla_client

    (module,) = compiled.runtime_executable().hlo_modules()
    cost = xla_client._xla.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
    calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', compiled.as_text())))
    return {"flops": float(cost["flops"]), "bytes accessed": float(cost["bytes accessed"]), "custom_calls": calls}


def compile_for(fun: Callable, args: Sequence[Any], devices: Sequence[Any], **jit_kwargs: Any):
    """``jax.jit(fun, **jit_kwargs)`` lowered for ``args`` (pytrees of ``jax.ShapeDtypeStruct``; a leaf without a
    sharding is replicated over ``devices``) and compiled by their platform's compiler -> the ``Compiled`` program
    (``cost_analysis()``, ``memory_analysis()``, ``output_shardings``)."""
    replicated = NamedSharding(Mesh(np.array(devices), ("model",)), PartitionSpec())
    placed = jax.tree.map(lambda leaf: leaf if getattr(leaf, "sharding", None) is not None else
                          jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=replicated), list(args))
    # Pallas's lowerings (and impl="auto") read the platform from the default device, this machine's CPU otherwise.
    # A compile-only program cannot be loaded back from the persistent compilation cache (no client): kept out of it.
    cache = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        with jax.default_device(devices[0]):
            return jax.jit(fun, **jit_kwargs).lower(*placed).compile()
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)
