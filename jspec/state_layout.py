"""What each leaf of the decode state holds, declared by whoever owns the leaf: the target's (``DecodeState``) here,
a drafter's by its ``state_layout`` (``jspec.drafters.Drafter``). The paged server (``jspec.serve.kv_store``) stores
each leaf as declared; nothing is inferred from shapes.

- :class:`PerPosition`: one slot per position of the sequence (the target's K/V, the token buffer, a drafter's K/V
  or token buffer, captured states, log-probabilities): paged, in the pool the declaration names.
- :class:`PerRow`: a value per sequence whose size does not depend on the context (lengths, budgets, sampling
  parameters, keys, a drafter's next prediction): one row of the row store per request.
- :data:`SHARED`: neither (the loop's step counter): stored once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

TARGET_KV = "target K/V"  # the pool the model reads through its page table (models.paged_kv); split by KV heads
# The K/V of the target's layers whose sliding window binds: a pool of its own, whose pages a request holds only
# while they are in the window (jspec.serve.kv_cache_coordinator); read and split as TARGET_KV.
TARGET_WINDOW_KV = "target K/V (sliding window)"
TARGET_POOLS = (TARGET_KV, TARGET_WINDOW_KV)


@dataclasses.dataclass(frozen=True)
class PerPosition:
    """A buffer with a slot per position. pool: the name of the pool it is stored in (leaves of one pool share its
    pages); slots: the length of its slot axis in a state of the owner's ``max_seq_len`` (the context, then any
    window past it: a draft tree's slots, a commit's extend); row_axis, slot_axis: the axes of the dense leaf."""

    pool: str
    slots: int
    row_axis: int = 0
    slot_axis: int = 1


@dataclasses.dataclass(frozen=True)
class PerRow:
    """A value per sequence along ``row_axis``, the same size at every context length."""

    row_axis: int = 0


@dataclasses.dataclass(frozen=True)
class Shared:
    """A value of the whole batch (no row axis)."""


SHARED = Shared()
Declaration = PerPosition | PerRow | Shared


def per_row(tree: Any, row_axis: int = 0) -> Any:
    """``tree`` with every leaf declared :class:`PerRow` (None subtrees stay None)."""
    return jax.tree.map(lambda _: PerRow(row_axis), tree)


def per_position(tree: Any, pool: str, slots: int, *, row_axis: int = 0, slot_axis: int = 1) -> Any:
    """``tree`` (a KV cache, a tuple of buffers) with every leaf declared :class:`PerPosition` in ``pool``."""
    return jax.tree.map(lambda _: PerPosition(pool, slots, row_axis, slot_axis), tree)


def is_declaration(x: Any) -> bool:
    return isinstance(x, (PerPosition, PerRow, Shared))
