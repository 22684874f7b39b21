"""Programs compiled ahead of time for hardware this machine does not have: a TPU slice's compile-only devices
from libtpu (``pip install -e ".[tpu]"``), through the real TPU compiler, Mosaic kernels included.

    devices = tpu_devices("v5e")
    compiled = compile_for(fun, [jax.ShapeDtypeStruct(shape, dtype), ...], devices[:1])
    compiled.cost_analysis(), compiled.memory_analysis()

The interpreters do not apply the compilers' layout rules; this is how a kernel or a program is known to build
where users run it (tests/aot, ``jspec bench --aot``).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Compile-only topologies of each TPU generation (the smallest slice libtpu names; a program on fewer chips takes
# the first of its devices).
TPU_TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}


@functools.cache
def tpu_devices(chip: str) -> tuple:
    """The compile-only devices of ``chip``'s topology (:data:`TPU_TOPOLOGIES`); no TPU needed, libtpu is."""
    if chip not in TPU_TOPOLOGIES:
        raise ValueError(f"chip={chip!r}: expected one of {sorted(TPU_TOPOLOGIES)}")
    if importlib.util.find_spec("libtpu") is None:
        raise RuntimeError('compiling for a TPU needs libtpu on this machine: pip install -e ".[tpu]"')
    from jax.experimental import topologies

    # Compile-only: several processes may hold libtpu at once (pytest's workers), which its lockfile forbids.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return tuple(topologies.get_topology_desc(platform="tpu", topology_name=TPU_TOPOLOGIES[chip]).devices)


def compile_for(fun: Callable, args: Sequence[Any], devices: Sequence[Any], **jit_kwargs: Any):
    """``jax.jit(fun, **jit_kwargs)`` lowered for ``args`` (pytrees of ``jax.ShapeDtypeStruct``; a leaf without a
    sharding is replicated over ``devices``) and compiled by their platform's compiler -> the ``Compiled`` program
    (``cost_analysis()``, ``memory_analysis()``, ``output_shardings``)."""
    replicated = NamedSharding(Mesh(np.array(devices), ("model",)), PartitionSpec())
    placed = jax.tree.map(lambda leaf: leaf if getattr(leaf, "sharding", None) is not None else
                          jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=replicated), list(args))
    # Pallas's TPU lowering reads the chip's generation from the default device, this machine's CPU otherwise. A
    # compile-only program cannot be loaded back from the persistent compilation cache (no client): kept out of it.
    cache = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        with jax.default_device(devices[0]):
            return jax.jit(fun, **jit_kwargs).lower(*placed).compile()
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)
