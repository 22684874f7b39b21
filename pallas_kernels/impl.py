"""Choosing between a kernel's Pallas lowerings and its pure-jnp reference.

Every op in this package, and any caller that passes the choice on, takes ``impl: Literal["auto", "pallas",
"interpret", "tpu", "tpu_interpret", "reference"]``:

- ``"reference"``: the pure-jnp specification (what runs fast on CPU, and what tests compare against).
- ``"pallas"``: the Pallas GPU kernel (Triton lowering), compiled for the device.
- ``"interpret"``: the same GPU kernel run by the Pallas interpreter (works on CPU; used by tests).
- ``"tpu"``: the Pallas TPU kernel (Mosaic), compiled for the device.
- ``"tpu_interpret"``: the TPU kernel run by Pallas's TPU interpreter, which simulates TPU memory spaces, DMAs and
  semaphores on a CPU (used by tests).
- ``"auto"``: the compiled form for the backend (``"pallas"`` on a GPU, ``"tpu"`` on a TPU) where the real
  compiler for it is known to accept the kernel (:data:`COMPILED_FORMS`, what tests/aot compiles), else
  ``"reference"`` (with a one-line log the first time); ``"reference"`` off a GPU or TPU.

The string is mapped to an enum once here, so kernel files never compare strings.
"""

from __future__ import annotations

import enum
import functools
import logging
from typing import Literal

import jax

ImplName = Literal["auto", "pallas", "interpret", "tpu", "tpu_interpret", "reference"]


class Impl(enum.Enum):
    REFERENCE = "reference"
    PALLAS = "pallas"
    INTERPRET = "interpret"
    TPU = "tpu"
    TPU_INTERPRET = "tpu_interpret"

    @property
    def is_tpu(self) -> bool:
        """The Mosaic TPU kernel, compiled or interpreted."""
        return self in (Impl.TPU, Impl.TPU_INTERPRET)

    @property
    def interpreted(self) -> bool:
        """Run by one of Pallas's interpreters rather than compiled."""
        return self in (Impl.INTERPRET, Impl.TPU_INTERPRET)


KernelName = Literal["tree_build", "tree_verify", "tree_attention", "paged_tree_attention"]

# The kernels whose compiled form the backend's real compiler accepts at the engine's shapes (tests/aot compiles each
# at them): on a TPU every Mosaic form, for v5e, v6e and v5p; on a GPU every Triton form, for an H100. A kernel
# left out here runs its jnp reference under "auto" on that backend.
_EVERY_KERNEL = frozenset({"tree_build", "tree_verify", "tree_attention", "paged_tree_attention"})
COMPILED_FORMS: dict[str, frozenset[str]] = {"tpu": _EVERY_KERNEL, "gpu": _EVERY_KERNEL}
_BACKEND_FORMS = {"gpu": "pallas", "tpu": "tpu"}
_log = logging.getLogger("pallas_kernels")


def resolve_impl(impl: str, kernel: KernelName | None = None) -> Impl:
    """Maps the user's ``impl`` string to an :class:`Impl`. ``"auto"`` picks by the default backend: its compiled
    form where :data:`COMPILED_FORMS` lists ``kernel`` for it (any kernel when ``kernel`` is None), else the
    reference."""
    if impl == "auto":
        backend = _backend()
        if backend not in _BACKEND_FORMS:
            return Impl.REFERENCE
        if kernel is not None and kernel not in COMPILED_FORMS[backend]:
            _say_reference_once(kernel, backend)
            return Impl.REFERENCE
        return Impl(_BACKEND_FORMS[backend])
    try:
        return Impl(impl)
    except ValueError:
        raise ValueError(f"impl={impl!r} is not one of 'auto', 'pallas', 'interpret', 'tpu', 'tpu_interpret', "
                         "'reference'") from None


def _backend() -> str:
    """The platform programs are placed on: the default device's where one is set (``jax.default_device``, as
    ``jspec.tools.aot`` sets a TPU's to compile for it on a CPU host), else JAX's default backend."""
    device = jax.config.jax_default_device
    if device is None:
        return jax.default_backend()
    return device if isinstance(device, str) else device.platform


@functools.cache
def _say_reference_once(kernel: str, backend: str) -> None:
    _log.warning("pallas_kernels: %s has no %s form known to compile on %s; impl='auto' runs its jnp reference",
                 kernel, _BACKEND_FORMS[backend], backend)
