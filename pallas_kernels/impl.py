"""Choosing between a kernel's Pallas lowering and its pure-jnp reference.

Every op in this package, and any caller that passes the choice on, takes ``impl: Literal["auto", "pallas", "interpret",
"reference"]``:

- ``"reference"``: the pure-jnp specification (what runs fast on CPU, and what tests compare against).
- ``"pallas"``: the Pallas GPU kernel, compiled for the device.
- ``"interpret"``: the same Pallas kernel run by the Pallas interpreter (works on CPU; used by tests).
- ``"auto"``: ``"pallas"`` when the default backend is a GPU, ``"reference"`` elsewhere.

The string is mapped to an enum once here, so kernel files never compare strings.
"""

from __future__ import annotations

import enum
from typing import Literal

import jax

ImplName = Literal["auto", "pallas", "interpret", "reference"]


class Impl(enum.Enum):
    REFERENCE = "reference"
    PALLAS = "pallas"
    INTERPRET = "interpret"


def resolve_impl(impl: str) -> Impl:
    """Maps the user's ``impl`` string to an :class:`Impl`; ``"auto"`` picks by the default backend."""
    if impl == "auto":
        return Impl.PALLAS if jax.default_backend() == "gpu" else Impl.REFERENCE
    try:
        return Impl(impl)
    except ValueError:
        raise ValueError(
            f"impl={impl!r} is not one of 'auto', 'pallas', 'interpret', 'reference'") from None
