"""Choosing between a kernel's Pallas lowerings and its pure-jnp reference.

Every op in this package, and any caller that passes the choice on, takes ``impl: Literal["auto", "pallas",
"interpret", "tpu", "tpu_interpret", "reference"]``:

- ``"reference"``: the pure-jnp specification (what runs fast on CPU, and what tests compare against).
- ``"pallas"``: the Pallas GPU kernel (Triton lowering), compiled for the device.
- ``"interpret"``: the same GPU kernel run by the Pallas interpreter (works on CPU; used by tests).
- ``"tpu"``: the Pallas TPU kernel (Mosaic), compiled for the device.
- ``"tpu_interpret"``: the TPU kernel run by Pallas's TPU interpreter, which simulates TPU memory spaces, DMAs and
  semaphores on a CPU (used by tests).
- ``"auto"``: ``"pallas"`` on a GPU backend, ``"tpu"`` on a TPU backend, ``"reference"`` elsewhere.

The string is mapped to an enum once here, so kernel files never compare strings.
"""

from __future__ import annotations

import enum
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


def resolve_impl(impl: str) -> Impl:
    """Maps the user's ``impl`` string to an :class:`Impl`; ``"auto"`` picks by the default backend."""
    if impl == "auto":
        return {"gpu": Impl.PALLAS, "tpu": Impl.TPU}.get(jax.default_backend(), Impl.REFERENCE)
    try:
        return Impl(impl)
    except ValueError:
        raise ValueError(f"impl={impl!r} is not one of 'auto', 'pallas', 'interpret', 'tpu', 'tpu_interpret', "
                         "'reference'") from None
