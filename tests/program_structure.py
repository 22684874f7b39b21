"""Walking a jaxpr: which primitives run where (top-level loop count, callbacks anywhere)."""

from __future__ import annotations

from typing import Iterator

import jax

CALLBACK_PRIMITIVES = ("pure_callback", "io_callback", "debug_callback", "callback", "host_callback")


def _sub_jaxprs(eqn) -> Iterator:
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jax.extend.core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jax.extend.core.Jaxpr):
                yield item


def all_primitives(jaxpr) -> Iterator[str]:
    for eqn in jaxpr.eqns:
        yield eqn.primitive.name
        for sub in _sub_jaxprs(eqn):
            yield from all_primitives(sub)


def top_level_eqns(jaxpr) -> list:
    """Equations of the program's own body, looking through jit (pjit) wrappers only."""
    eqns = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("pjit", "jit"):
            eqns += top_level_eqns(eqn.params["jaxpr"].jaxpr)
        else:
            eqns.append(eqn)
    return eqns


def find_eqns(jaxpr, name: str) -> list:
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            found.append(eqn)
        for sub in _sub_jaxprs(eqn):
            found += find_eqns(sub, name)
    return found


def memory_as_users_compile(lowered):
    """``lowered`` compiled with XLA:CPU's fusion emitters, as users' programs are (the test session turns them off
    to compile faster, tests/conftest.py; the legacy emitters give a dynamic update of a loop's buffers a
    temporary copy, which the fusion emitters update in place) -> its memory analysis. Buffer assignment does not
    depend on LLVM's optimisation level, which stays the session's."""
    return lowered.compile({"xla_cpu_use_fusion_emitters": True}).memory_analysis()
