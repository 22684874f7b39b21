"""``JSPEC_FORCE_ACCEPT=N``: the benchmark knob, read here at the tools' edge and passed to the library as the
explicit argument ``SpecEngine.from_pretrained(..., force_accept=N)`` (the library never reads the environment).
Verification then accepts exactly min(N, depth) drafts per step, for timing without trained weights; the output
is no longer the target's."""

from __future__ import annotations

import os

FORCE_ACCEPT_ENV = "JSPEC_FORCE_ACCEPT"


def force_accept_from_env(environ=os.environ) -> int | None:
    """The value of JSPEC_FORCE_ACCEPT (None when unset or empty); ValueError naming it when it is not an
    integer >= 0."""
    raw = environ.get(FORCE_ACCEPT_ENV)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{FORCE_ACCEPT_ENV}={raw!r}: expected a non-negative integer") from None
    if value < 0:
        raise ValueError(f"{FORCE_ACCEPT_ENV}={raw!r}: expected a non-negative integer")
    return value
