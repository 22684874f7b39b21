"""The server's KV store: the decode state of every request in pools of pages and a row store, laid out as the
state's owners declare (``jspec.state_layout``: the target's leaves in ``jspec.state.declare_layout``, a drafter's
in its ``state_layout``).

The store has the type of the slot engine's (``DecodeState``, ``StepInputs``), leaf for leaf:

- a :class:`~jspec.state_layout.PerPosition` leaf is a pool ``[num_pages, page_size, *per_token]`` (the row axis
  dropped, the slot axis cut into pages): row r's position p lives at ``pool[page_table[r, p // page_size],
  p % page_size]``. Page 0 is the null page every unused page-table entry points to (never -1: gathers would wrap
  it), so padded rows and positions past a row's pages read and write garbage there and nowhere else. So
  ``store[0].cache.k[l]`` is the target's layer-l K pool and ``store[0].draft.cache`` a drafter's K/V pools;
  :attr:`PagedLayout.pools` lists them by name (:class:`KVPool`).
- the K/V of the target's layers whose sliding window binds fill a pool of their own
  (:data:`~jspec.state_layout.TARGET_WINDOW_KV`), its pages numbered apart and read through a page table of their
  own, the *window group*'s: a request holds only the pages its window still reads (vLLM's hybrid allocator;
  ``jspec.serve.kv_cache_coordinator``), its other entries the null page. The page table of R rows is
  ``i32[R, G, P]``: group 0 (every other paged leaf) and, where a window binds, group 1.
- a :class:`~jspec.state_layout.PerRow` leaf is ``[max_rows + 1, *rest]``; row ``max_rows`` is the null row padded
  rows point to, idle (done) forever.
- a shared leaf (the loop's step counter) is stored as it is.

A program over R rows at context ``seq_len`` gathers the dense state those rows have in an engine of
``max_seq_len = seq_len`` (:func:`gather_view`; the target's K/V stay in their pools, read and written through the
page table) and writes back what it changed (:func:`scatter_view`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jspec.generate_setup import GenerateSetup
from jspec.serve.programs import idle_slots
from jspec.sharding import KV_POOL, constrain, kv_spec
from jspec.state import DecodeState, declare_layout
from jspec.state_layout import TARGET_POOLS, TARGET_WINDOW_KV, PerPosition, PerRow, is_declaration
from jspec.step import StepInputs
from models.paged_kv import PagedKV

SLOT, ROW, SHARED = "slot", "row", "shared"
FULL_GROUP, WINDOW_GROUP = 0, 1  # the page-table groups: every paged leaf, but the binding windows' K/V
Store = tuple[DecodeState, StepInputs]  # the (state, inputs) of every row: pools and rows, as the module says


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """Where one leaf keeps its rows and positions. kind: SLOT, ROW or SHARED; row_axis, slot_axis: the axes in the
    dense leaf (None where absent); extra_slots: the slot axis holds ``seq_len + extra_slots`` slots (a tree
    window past the context, for instance); pool: the pool of a SLOT leaf ("" otherwise); kv: the target's K/V
    (its pool is read through the page table and split by KV heads on a mesh); group: its page table's group
    (WINDOW_GROUP: a layer whose sliding window binds)."""

    kind: str
    row_axis: int | None = None
    slot_axis: int | None = None
    extra_slots: int = 0
    pool: str = ""

    @property
    def kv(self) -> bool:
        return self.pool in TARGET_POOLS

    @property
    def group(self) -> int:
        return WINDOW_GROUP if self.pool == TARGET_WINDOW_KV else FULL_GROUP


@dataclasses.dataclass(frozen=True)
class KVPool:
    """One named pool of pages. buffers: (per-token shape, dtype) of each leaf stored in it (a K/V pool: K and V of
    each layer, [num_kv_heads, head_dim] each); every buffer has ``num_pages * page_size`` token slots."""

    name: str
    buffers: tuple[tuple[tuple[int, ...], str], ...]

    @property
    def bytes_per_token(self) -> int:
        return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in self.buffers)

    def describe(self) -> str:
        kinds = sorted({f"[{', '.join(map(str, shape))}] {dtype}" for shape, dtype in self.buffers})
        return f"{self.name}: {len(self.buffers)} buffers of {' or '.join(kinds)} ({self.bytes_per_token} bytes/token)"


@dataclasses.dataclass(frozen=True)
class PagedLayout:
    """The paged form of a setup's decode state (hashable: a static argument of the programs).

    treedef: the structure of (DecodeState, StepInputs); leaves: one :class:`LeafLayout` per leaf, in flattening
    order; pools: the named pools the SLOT leaves fill; page_size: tokens per page; num_pages: pages in each pool,
    the null page included; max_rows: requests held at once (``--max-num-seqs``); max_seq_len: the longest context
    a row may reach."""

    treedef: Any
    leaves: tuple[LeafLayout, ...]
    pools: tuple[KVPool, ...]
    page_size: int
    num_pages: int
    max_rows: int
    max_seq_len: int
    window: int = 0        # the widest binding sliding window over the target's layers (0: none binds)
    window_pages: int = 0  # pages in the window group's pool, the null page included

    @property
    def num_groups(self) -> int:
        """Page-table groups: 2 where a sliding window binds (FULL_GROUP, WINDOW_GROUP), else 1."""
        return 2 if self.window else 1

    def group_pages(self, group: int) -> int:
        """Pages in each pool of ``group``, the null page included."""
        return self.window_pages if group == WINDOW_GROUP else self.num_pages

    @property
    def extra_slots(self) -> int:
        """The widest window past the context over the slot leaves (a tree's, a commit's extend)."""
        return max((leaf.extra_slots for leaf in self.leaves if leaf.kind == SLOT), default=0)

    def pages_in_view(self, seq_len: int) -> int:
        """Page-table entries a view of ``seq_len`` context reads (the widest slot leaf's)."""
        return math.ceil((seq_len + self.extra_slots) / self.page_size)

    @property
    def pages_per_row(self) -> int:
        """Page-table width: the pages of a row at ``max_seq_len``."""
        return self.pages_in_view(self.max_seq_len)

    @property
    def null_row(self) -> int:
        return self.max_rows

    def bytes_per_token(self, kv_split: int = 1, group: int = FULL_GROUP) -> float:
        """Device bytes one token slot of ``group`` takes over its pools on one device (the target's K/V divided
        over ``kv_split`` devices)."""
        return sum(pool.bytes_per_token / (kv_split if pool.name in TARGET_POOLS else 1) for pool in self.pools
                   if (pool.name == TARGET_WINDOW_KV) == (group == WINDOW_GROUP))

    def pool(self, name: str) -> KVPool:
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise KeyError(f"no pool {name!r}; pools: {[pool.name for pool in self.pools]}")


def _paths(tree: Any) -> list[str]:
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def binding_windows(setup: GenerateSetup) -> dict[int, int]:
    """{layer: window} of the target's layers whose sliding window binds at ``setup.max_seq_len`` (a window
    shorter than the context; a wider one is full attention there)."""
    windows = {layer: setup.target.layer_window(layer) for layer in range(setup.target.num_layers)}
    return {layer: window for layer, window in windows.items() if window is not None and window < setup.max_seq_len}


def declared_layout(setup: GenerateSetup, state: Any, inputs: StepInputs,
                    window_layers: frozenset[int] = frozenset()) -> tuple:
    """(DecodeState, StepInputs) of declarations for a state of ``setup`` (shapes or arrays; only its structure is
    read): the target's (``window_layers``' K/V in the window pool), the drafter's, and every step input per row."""
    declared = declare_layout(state, max_seq_len=setup.max_seq_len, cache_slots=setup.cache_slots,
                              drafter=setup.drafter, window_layers=window_layers)
    return declared, jax.tree.map(lambda _: PerRow(), inputs)


def paged_layout(params_t, params_d, *, setup: GenerateSetup, num_stop_ids: int, page_size: int, num_pages: int,
                 max_rows: int, window_pages: int | None = None) -> PagedLayout:
    """The :class:`PagedLayout` of ``setup``'s slot-engine state, from its owners' declarations (shapes only:
    nothing runs). The target's layers whose window binds (:func:`binding_windows`) keep their K/V in the window
    group's pool of ``window_pages`` pages (default: ``num_pages``). The declarations are checked against the
    state's shapes at two context lengths: ValueError naming a leaf whose declaration its shapes contradict (a row
    axis of another size, a slot axis not of its declared length, a per-row leaf growing with the context)."""
    rows, short, long = 3, 32, 48

    def shapes(seq_len: int):
        return jax.eval_shape(functools.partial(idle_slots, setup=setup.with_max_seq_len(seq_len), num_slots=rows,
                                                num_stop_ids=num_stop_ids), params_t, params_d)

    at_short, at_long = shapes(short), shapes(long)
    windows = binding_windows(setup)
    declared = declared_layout(setup.with_max_seq_len(short), *at_short, window_layers=frozenset(windows))
    flat, structure = jax.tree.flatten(declared, is_leaf=is_declaration)
    if structure != jax.tree.structure(at_short) or not all(map(is_declaration, flat)):
        raise ValueError(f"the state's declarations {structure} do not match the state {jax.tree.structure(at_short)}"
                         f": expected one jspec.state_layout declaration per leaf")
    short_leaves, long_leaves = jax.tree.leaves(at_short), jax.tree.leaves(at_long)
    leaves, pools = [], {}
    for path, decl, a, b in zip(_paths(at_short), flat, short_leaves, long_leaves):
        def wrong(expected: str):
            return ValueError(f"decode-state leaf {path} of shape {a.shape} (context {short}; {b.shape} at {long}) is "
                              f"declared {decl}: expected {expected}")
        if isinstance(decl, PerPosition):
            extra = decl.slots - short
            if (a.ndim <= max(decl.row_axis, decl.slot_axis) or a.shape[decl.row_axis] != rows
                    or a.shape[decl.slot_axis] != decl.slots or b.shape[decl.slot_axis] != long + extra):
                raise wrong(f"{rows} rows on axis {decl.row_axis} and the context plus {extra} slots on axis "
                            f"{decl.slot_axis}")
            leaves.append(LeafLayout(SLOT, decl.row_axis, decl.slot_axis, extra, decl.pool))
            per_token = tuple(n for i, n in enumerate(a.shape) if i not in (decl.row_axis, decl.slot_axis))
            pools[decl.pool] = pools.get(decl.pool, ()) + ((per_token, str(a.dtype)),)
        elif isinstance(decl, PerRow):
            if a.ndim <= decl.row_axis or a.shape[decl.row_axis] != rows or a.shape != b.shape:
                raise wrong(f"{rows} rows on axis {decl.row_axis} and no axis growing with the context (declare "
                            f"a buffer per position jspec.state_layout.PerPosition)")
            leaves.append(LeafLayout(ROW, row_axis=decl.row_axis))
        else:
            leaves.append(LeafLayout(SHARED))
    return PagedLayout(jax.tree.structure(at_short), tuple(leaves),
                       tuple(KVPool(name, buffers) for name, buffers in pools.items()), page_size, num_pages,
                       max_rows, setup.max_seq_len, max(windows.values(), default=0),
                       (num_pages if window_pages is None else window_pages) if windows else 0)


def empty_store(params_t, params_d, layout: PagedLayout, *, setup: GenerateSetup, num_stop_ids: int) -> Store:
    """The store of an empty server, a (DecodeState, StepInputs) of pools and rows: zeroed pools, every row idle
    (done), placed on ``setup.mesh`` (pools of the target's K/V split by KV heads over "model", everything else
    replicated)."""
    idle = jax.tree.leaves(idle_slots(params_t, params_d, setup=setup.with_max_seq_len(32), num_slots=1,
                                      num_stop_ids=num_stop_ids))
    store = []
    for spec, leaf in zip(layout.leaves, idle):
        if spec.kind == SLOT:
            rest = tuple(n for i, n in enumerate(leaf.shape) if i not in (spec.row_axis, spec.slot_axis))
            value = jnp.zeros((layout.group_pages(spec.group), layout.page_size) + rest, leaf.dtype)
        elif spec.kind == ROW:
            value = jnp.repeat(jnp.moveaxis(leaf, spec.row_axis, 0), layout.max_rows + 1, axis=0)
        else:
            value = leaf
        if setup.mesh is not None:
            value = jax.device_put(value, NamedSharding(setup.mesh, kv_spec(KV_POOL, value.shape, setup.mesh)
                                                        if spec.kv else P()))
        store.append(value)
    return jax.tree.unflatten(layout.treedef, store)


def store_shapes(params_t, params_d, layout: PagedLayout, *, setup: GenerateSetup, num_stop_ids: int) -> Store:
    """:func:`empty_store`'s shapes, dtypes and shardings, allocating nothing (params may be abstract): what a
    program over the store is lowered for before (or without) the store."""
    store = jax.eval_shape(functools.partial(empty_store, layout=layout, setup=setup, num_stop_ids=num_stop_ids),
                           params_t, params_d)
    placed = []
    for spec, leaf in zip(layout.leaves, jax.tree.leaves(store)):
        sharding = None if setup.mesh is None else NamedSharding(
            setup.mesh, kv_spec(KV_POOL, leaf.shape, setup.mesh) if spec.kv else P())
        placed.append(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding))
    return jax.tree.unflatten(layout.treedef, placed)


def gather_view(layout: PagedLayout, store: Store, row_ids: jax.Array, page_table: jax.Array, seq_len: int, *,
                paged_kv: bool = False) -> Any:
    """The dense (state, inputs) of rows ``row_ids`` (i32[R]) at context ``seq_len``; page_table: i32[R, G, >= pages
    of the view] (0: the null page), each leaf reading its group's. paged_kv: the target's K/V stay in their pools,
    each layer's a ``models.paged_kv.PagedKV`` over its group's page table (the step reads them through it), not a
    dense copy."""
    leaves = []
    for spec, stored in zip(layout.leaves, jax.tree.leaves(store)):
        if spec.kind == SHARED:
            leaves.append(stored)
        elif spec.kind == ROW:
            leaves.append(jnp.moveaxis(stored[row_ids], 0, spec.row_axis))
        elif spec.kv and paged_kv:
            leaves.append(PagedKV(stored, page_table[:, spec.group, :layout.pages_in_view(seq_len)]))
        else:
            extent = seq_len + spec.extra_slots
            pages = math.ceil(extent / layout.page_size)
            gathered = stored[page_table[:, spec.group, :pages]]  # [R, pages, page_size, *rest]
            gathered = gathered.reshape((gathered.shape[0], pages * layout.page_size) + gathered.shape[3:])
            leaves.append(jnp.moveaxis(gathered[:, :extent], (0, 1), (spec.row_axis, spec.slot_axis)))
    return jax.tree.unflatten(layout.treedef, leaves)


def scatter_view(layout: PagedLayout, store: Store, view: Any, row_ids: jax.Array, page_table: jax.Array,
                 seq_len: int, *, since: jax.Array | None = None, write_pages: int | None = None,
                 unchanged: frozenset[int] = frozenset()) -> Store:
    """Writes a view (as :func:`gather_view` returns) back into the store -> the new store. since: i32[R], with
    ``write_pages``: only the ``write_pages`` pages from the one holding position since[r] are written back (the
    rest of each row is unchanged since the gather, so a chunk writes what its steps touched, not the whole
    context). A target K/V kept in pages (:func:`gather_view`'s ``paged_kv``) is stored as the step left it.
    unchanged: indices of leaves the program left as gathered: stored as they were (their gather, unused, is
    compiled away)."""
    out = []
    stored_leaves, view_leaves = jax.tree.leaves(store), jax.tree.leaves(view, is_leaf=_is_paged)
    for index, (spec, stored, leaf) in enumerate(zip(layout.leaves, stored_leaves, view_leaves)):
        if index in unchanged:
            out.append(stored)
        elif isinstance(leaf, PagedKV):
            out.append(leaf.pages)
        elif spec.kind == SHARED:
            out.append(leaf.astype(stored.dtype))
        elif spec.kind == ROW:
            out.append(stored.at[row_ids].set(jnp.moveaxis(leaf, spec.row_axis, 0).astype(stored.dtype)))
        else:
            out.append(_scatter_pages(layout, spec, stored, leaf, page_table, seq_len, since, write_pages))
    # Placed as the store was (empty_store): a leaf the partitioner left split (a drafter's pool after a split step)
    # would neither alias its donated input (a whole-pool temporary) nor match the program's next call.
    out = [constrain(leaf, kv_spec(KV_POOL, leaf.shape) if spec.kv else P()) for spec, leaf in zip(layout.leaves, out)]
    return jax.tree.unflatten(layout.treedef, out)


def _scatter_pages(layout: PagedLayout, spec: LeafLayout, stored: jax.Array, leaf: jax.Array, page_table: jax.Array,
                   seq_len: int, since: jax.Array | None, write_pages: int | None) -> jax.Array:
    """A slot leaf's dense view written into its pool (:func:`scatter_view`)."""
    if not stored.size:  # a zero-wide buffer (multi-head latent attention's V: the latent in K stands for it)
        return stored
    extent = seq_len + spec.extra_slots
    pages = math.ceil(extent / layout.page_size)
    rows = jnp.moveaxis(leaf, (spec.row_axis, spec.slot_axis), (0, 1))  # [R, extent, *rest]
    table = page_table[:, spec.group, :pages]
    if since is not None:
        first = since // layout.page_size
        pages += write_pages  # room for a window that starts at the last page
        table = jnp.pad(table, ((0, 0), (0, write_pages)))  # past the row's pages: the null page
        table = jnp.take_along_axis(table, first[:, None] + jnp.arange(write_pages)[None], axis=1)
    widths = [(0, 0)] * rows.ndim
    widths[1] = (0, pages * layout.page_size - extent)
    rows = jnp.pad(rows, widths)
    if since is not None:
        span = write_pages * layout.page_size
        rows = jax.vmap(lambda row, at: jax.lax.dynamic_slice_in_dim(row, at, span, axis=0))(
            rows, first * layout.page_size)
    rows = rows.reshape((-1, layout.page_size) + rows.shape[2:])
    return stored.at[table.reshape(-1)].set(rows.astype(stored.dtype))


def _is_paged(x: Any) -> bool:
    return isinstance(x, PagedKV)


def api_feature_leaves(layout: PagedLayout) -> frozenset[int]:
    """Indices of the leaves only the API features use: the log-probability buffers, the output token counts and
    the logits processors' parameters (empty for a setup without them)."""
    state, inputs = jax.tree.unflatten(layout.treedef, list(range(len(layout.leaves))))
    return frozenset(jax.tree.leaves((state.features.api_parts(), inputs.features.api_parts())))


def non_kv_leaves(layout: PagedLayout) -> frozenset[int]:
    """Indices of every leaf but the target's K/V pools: what a program that only runs the target on the rows'
    last tokens (``paged.forward_rows``) leaves as gathered."""
    return frozenset(i for i, spec in enumerate(layout.leaves) if not spec.kv)
