"""Draft tree -> verification buffers: attention mask, positions and first-child / next-sibling links.

A draft tree has T nodes per sequence; node 0 is the root (the last committed token) and nodes are in
topological order (a parent's index is smaller than its child's). From the parent of every node this op
computes the buffers that SGLang and TensorRT-LLM users know:

- ``mask[b, i, j]``: node j is node i or an ancestor of it (bool[B, T, T]); packed: i32[B, T, ceil(T/32)]
  whose word ``j // 32`` holds bit ``j % 32``.
- ``positions[b, i] = seq_lens[b] + depth(i)``.
- ``retrieve_index[b, i] = b * T + i``: the flat index of node i in the batch's token array.
- ``retrieve_next_token[b, i]``: the first (smallest-index) child of i; ``retrieve_next_sibling[b, i]``: the
  next larger-index child of i's parent; -1 where there is none.
- ``valid[b]``: false when the input did not describe a tree; that sequence then gets the chain
  0 -> 1 -> ... -> T-1 instead, so no buffer is ever read out of bounds. A chain is a well-formed tree, so
  verification of it stays lossless: it only checks the draft tokens against the target.

Two entry points:

- :func:`build_dynamic_tree`: EAGLE-2 dynamic trees as SGLang's ``build_tree_kernel_efficient`` takes them.
  Candidate ``g`` (an index into the drafter's flattened scores) grew from the root when ``g // topk == 0``
  and otherwise from candidate ``parent_list[g // topk]``; node ``i >= 1`` is candidate
  ``selected_index[i - 1]``. A parent candidate that was not selected (ties, NaN scores) makes the tree invalid.
- :func:`tree_from_parents`: static trees and chains given as ``parents[b, i]`` (``parents[b, 0]`` ignored);
  ``parents[b, i]`` outside ``[0, i)`` makes the tree invalid.

Kernel: Pallas with the Triton lowering on GPU (simple, and the problem is a few T x T integer tiles per
sequence: nothing Mosaic GPU's warpgroup machinery would speed up). One program per sequence (grid=(B,)) loads
that sequence's rows and computes everything with vector ops over the node lanes, padded to a power of two in
the wrapper as Triton requires: gathers become one-hot compare-and-reduce over a [T, T] tile, and the ancestor
mask is built by T-1 pointer-chasing steps of a static ``fori_loop``. The reference is plain jnp and scans the
nodes in order.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.impl import Impl, ImplName, resolve_impl
from pallas_kernels.tree_build_tpu import dynamic_tree_tpu, static_tree_tpu


class TreeArrays(NamedTuple):
    """The buffers of a built tree (B sequences of T nodes; W = ceil(T / 32))."""

    mask: jax.Array                   # bool[B, T, T], or i32[B, T, W] when packed
    positions: jax.Array              # i32[B, T]
    retrieve_index: jax.Array         # i32[B, T]
    retrieve_next_token: jax.Array    # i32[B, T]
    retrieve_next_sibling: jax.Array  # i32[B, T]
    valid: jax.Array                  # bool[B]


def num_mask_words(num_nodes: int) -> int:
    """Number of int32 words of one packed mask row: ceil(T / 32)."""
    return -(-num_nodes // 32)


# --------------------------------------------------------------------------------------------------------------
# Public ops
# --------------------------------------------------------------------------------------------------------------


def build_dynamic_tree(parent_list: jax.Array, selected_index: jax.Array, seq_lens: jax.Array, *, topk: int,
                       num_steps: int, packed: bool = False, impl: ImplName = "auto") -> TreeArrays:
    """Builds an EAGLE-2 dynamic tree from the drafter's candidates (SGLang's semantics).

    Args:
      parent_list: i32[B, topk * (num_steps - 1) + 1]; entry k is the candidate id that expansion slot k
        (candidates ``k * topk ... k * topk + topk - 1``) grew from; entry 0 stands for the root.
      selected_index: i32[B, T - 1], the selected candidate ids; parents must come before their children.
      seq_lens: i32[B], committed tokens before the root's position.
      topk, num_steps: the drafter's branching factor and number of draft steps.
      packed: return the mask as bit-packed int32 words.
      impl: "auto" | "pallas" | "interpret" | "tpu" | "tpu_interpret" | "reference" (pallas_kernels.impl).
    Returns:
      TreeArrays.
    """
    _check_dynamic_args(parent_list, selected_index, seq_lens, topk, num_steps)
    kind = resolve_impl(impl, "tree_build")
    if kind is Impl.REFERENCE:
        return build_dynamic_tree_reference(parent_list, selected_index, seq_lens, topk=topk, packed=packed)
    if kind.is_tpu:
        num_nodes = selected_index.shape[1] + 1
        return _tree_arrays(dynamic_tree_tpu(parent_list, selected_index, seq_lens, topk=topk,
                                             num_words=num_mask_words(num_nodes), packed=packed,
                                             interpret=kind.interpreted), num_nodes=num_nodes, packed=packed)
    return _build_dynamic_tree_pallas(parent_list, selected_index, seq_lens, topk=topk, packed=packed,
                                      interpret=kind is Impl.INTERPRET)


def tree_from_parents(parents: jax.Array, seq_lens: jax.Array, *, packed: bool = False,
                      impl: ImplName = "auto") -> TreeArrays:
    """Builds a tree given the parent of every node (static trees, chains).

    Args:
      parents: i32[B, T]; parents[b, i] in [0, i) for i >= 1; parents[b, 0] is ignored.
      seq_lens: i32[B].
      packed: return the mask as bit-packed int32 words.
      impl: "auto" | "pallas" | "interpret" | "tpu" | "tpu_interpret" | "reference" (pallas_kernels.impl).
    Returns:
      TreeArrays.
    """
    if parents.ndim != 2 or parents.shape[1] < 1:
        raise ValueError(f"parents.shape={parents.shape}, expected (B, T) with T >= 1")
    if seq_lens.shape != (parents.shape[0],):
        raise ValueError(f"seq_lens.shape={seq_lens.shape}, expected ({parents.shape[0]},)")
    kind = resolve_impl(impl, "tree_build")
    if kind is Impl.REFERENCE:
        return tree_from_parents_reference(parents, seq_lens, packed=packed)
    if kind.is_tpu:
        num_nodes = parents.shape[1]
        return _tree_arrays(static_tree_tpu(parents, seq_lens, num_words=num_mask_words(num_nodes), packed=packed,
                                            interpret=kind.interpreted), num_nodes=num_nodes, packed=packed)
    return _tree_from_parents_pallas(parents, seq_lens, packed=packed, interpret=kind is Impl.INTERPRET)


def _check_dynamic_args(parent_list, selected_index, seq_lens, topk, num_steps):
    if not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk={topk!r}, expected an int >= 1")
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps={num_steps!r}, expected an int >= 1")
    if selected_index.ndim != 2:
        raise ValueError(f"selected_index.shape={selected_index.shape}, expected (B, T - 1)")
    batch = selected_index.shape[0]
    expected = (batch, topk * (num_steps - 1) + 1)
    if parent_list.shape != expected:
        raise ValueError(f"parent_list.shape={parent_list.shape}, expected {expected} "
                         f"(B, topk * (num_steps - 1) + 1) for {topk=}, {num_steps=}")
    if seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens.shape={seq_lens.shape}, expected ({batch},)")


# --------------------------------------------------------------------------------------------------------------
# Reference (the specification)
# --------------------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("topk", "packed"))
def build_dynamic_tree_reference(parent_list, selected_index, seq_lens, *, topk, packed=False) -> TreeArrays:
    """parent_list: i32[B, L], selected_index: i32[B, T-1], seq_lens: i32[B] -> TreeArrays."""
    parents = jax.vmap(functools.partial(_dynamic_parents_reference, topk=topk))(
        parent_list.astype(jnp.int32), selected_index.astype(jnp.int32))
    return tree_from_parents_reference(parents, seq_lens, packed=packed)


def _dynamic_parents_reference(parent_list, selected, *, topk):
    """parent_list: i32[L], selected: i32[T-1] -> parents i32[T] (-1 at the root; < 0 where missing)."""
    root = jnp.array([-1], jnp.int32)
    if selected.shape[0] == 0:
        return root
    num_slots = parent_list.shape[0]
    slot = selected // topk
    in_range = (selected >= 0) & (slot < num_slots)
    parent_candidate = parent_list[jnp.clip(slot, 0, num_slots - 1)]
    # Node k + 1 holds candidate selected[k]; a parent must be an earlier node.
    is_earlier = jnp.arange(selected.shape[0])[None, :] < jnp.arange(selected.shape[0])[:, None]
    found = (selected[None, :] == parent_candidate[:, None]) & is_earlier
    parent_node = jnp.where(found.any(axis=1), jnp.argmax(found, axis=1) + 1, -1)
    parents = jnp.where(slot == 0, 0, parent_node)
    parents = jnp.where(in_range, parents, -1)
    return jnp.concatenate([root, parents.astype(jnp.int32)])


@functools.partial(jax.jit, static_argnames=("packed",))
def tree_from_parents_reference(parents, seq_lens, *, packed=False) -> TreeArrays:
    """parents: i32[B, T], seq_lens: i32[B] -> TreeArrays."""
    batch, num_nodes = parents.shape
    node = jnp.arange(num_nodes)
    parents = parents.astype(jnp.int32)
    valid = jnp.all((node[None, 1:] > parents[:, 1:]) & (parents[:, 1:] >= 0), axis=1)
    parents = jnp.where(valid[:, None], parents, node[None, :] - 1)
    parents = parents.at[:, 0].set(-1)
    mask = jax.vmap(_ancestor_mask_reference)(parents)
    is_child = parents[:, None, :] == node[None, :, None]                          # [B, parent i, child j]
    is_next_sibling = ((parents[:, :, None] == parents[:, None, :]) & (node[None, None, :] > node[None, :, None])
                       & (parents[:, :, None] >= 0))                               # [B, node i, sibling j]
    tree = TreeArrays(
        mask=mask,
        positions=(seq_lens.astype(jnp.int32)[:, None] + mask.sum(axis=2) - 1).astype(jnp.int32),
        retrieve_index=(jnp.arange(batch)[:, None] * num_nodes + node[None, :]).astype(jnp.int32),
        retrieve_next_token=_first_true_or_minus_one(is_child),
        retrieve_next_sibling=_first_true_or_minus_one(is_next_sibling),
        valid=valid)
    return tree._replace(mask=pack_mask_reference(mask)) if packed else tree


def _ancestor_mask_reference(parents):
    """parents: i32[T] (topologically ordered, -1 at the root) -> bool[T, T], row i = i and its ancestors."""
    num_nodes = parents.shape[0]

    def add_node(i, mask):
        return mask.at[i].set(mask[jnp.maximum(parents[i], 0)] | (jnp.arange(num_nodes) == i))

    return lax.fori_loop(0, num_nodes, add_node, jnp.zeros((num_nodes, num_nodes), bool))


def _first_true_or_minus_one(x):
    """bool[..., N] -> i32[...]: index of the first true entry, -1 where none."""
    return jnp.where(x.any(axis=-1), jnp.argmax(x, axis=-1), -1).astype(jnp.int32)


def pack_mask_reference(mask):
    """bool[..., T] -> i32[..., ceil(T / 32)]; bit j % 32 of word j // 32 is mask[..., j]."""
    num_nodes = mask.shape[-1]
    num_words = num_mask_words(num_nodes)
    padded = jnp.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, 32 * num_words - num_nodes)])
    bits = padded.reshape(*mask.shape[:-1], num_words, 32).astype(jnp.uint32)
    words = jnp.sum(bits << jnp.arange(32, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)
    return lax.bitcast_convert_type(words, jnp.int32)


# --------------------------------------------------------------------------------------------------------------
# Pallas kernel
# --------------------------------------------------------------------------------------------------------------


def _lookup(values, index, lanes):
    """values: i32[N], index: i32[M] -> i32[M], values[index] (0 where index is not a lane): a one-hot reduce."""
    return jnp.sum(jnp.where(index[:, None] == lanes[None, :], values[None, :], 0), axis=1)


def _first_lane(hit, lanes):
    """hit: bool[M, N], lanes: i32[N] -> i32[M]: the first lane with a hit, -1 where there is none."""
    none = lanes.shape[0]
    first = jnp.min(jnp.where(hit, lanes[None, :], none), axis=1)
    return jnp.where(first == none, -1, first)


def _dynamic_parents(parent_list, candidate, lanes, *, num_nodes, num_slots, topk):
    """The parent of each node of a dynamic tree, in registers.

    parent_list: i32[Lp]; candidate: i32[Tp] (candidate id of each node, lane 0 and padding unused);
    lanes: i32[Tp] -> (parents i32[Tp], ok i32[Tp]: 1 where the node's parent was found or the lane is no node).
    """
    is_node = (lanes >= 1) & (lanes < num_nodes)
    in_range = (candidate >= 0) & (candidate < num_slots * topk)
    slot = lax.div(jnp.maximum(candidate, 0), topk)
    parent_candidate = _lookup(parent_list, slot, jnp.arange(parent_list.shape[0]))
    earlier_node = (lanes[None, :] >= 1) & (lanes[None, :] < lanes[:, None])
    hit = (candidate[None, :] == parent_candidate[:, None]) & earlier_node
    parent_node = _first_lane(hit, lanes)
    parents = jnp.where(slot == 0, 0, parent_node)
    ok = ~is_node | (in_range & (parents >= 0))
    return parents, ok.astype(jnp.int32)


def _static_parents(parents, lanes, *, num_nodes):
    """parents: i32[Tp] -> (parents i32[Tp], ok i32[Tp]: 1 where parents[i] in [0, i) or the lane is no node)."""
    is_node = (lanes >= 1) & (lanes < num_nodes)
    ok = ~is_node | ((parents >= 0) & (parents < lanes))
    return parents, ok.astype(jnp.int32)


def _tree_kernel_body(parents, ok, seq_len, lanes, mask_ref, positions_ref, next_token_ref, next_sibling_ref,
                      valid_ref, *, num_nodes, packed):
    """Writes one sequence's buffers from the parents of its nodes (i32[Tp]; chain fallback when not ok)."""
    valid = jnp.min(ok)
    is_node = lanes < num_nodes
    parents = jnp.where(valid == 1, parents, lanes - 1)
    parents = jnp.where(lanes == 0, -1, jnp.where(is_node, parents, -2))   # -2: padding lanes, nobody's parent

    def climb(_, carry):
        mask, ancestor = carry
        mask = mask | (ancestor[:, None] == lanes[None, :])
        grand = _lookup(parents, ancestor, lanes)
        return mask, jnp.where(ancestor >= 0, grand, -1)

    mask, _ = lax.fori_loop(0, num_nodes - 1, climb, (lanes[:, None] == lanes[None, :], parents))
    positions = seq_len + jnp.sum(mask.astype(jnp.int32), axis=1) - 1
    is_child = (parents[None, :] == lanes[:, None]) & is_node[None, :]
    is_next_sibling = ((parents[None, :] == parents[:, None]) & (lanes[None, :] > lanes[:, None])
                       & (parents[:, None] >= 0) & is_node[None, :])
    next_token = _first_lane(is_child, lanes)
    next_sibling = _first_lane(is_next_sibling, lanes)

    mask_ref[...] = _pack_mask(mask, lanes, mask_ref.shape[1]) if packed else mask.astype(jnp.int32)
    positions_ref[...] = positions
    next_token_ref[...] = next_token
    next_sibling_ref[...] = next_sibling
    valid_ref[...] = valid


def _pack_mask(mask, lanes, num_words_padded):
    """mask: bool[Tp, Tp] -> i32[Tp, Wp]; bits add without carries, so an int32 sum is a bitwise or."""
    bit = jnp.left_shift(jnp.ones_like(lanes), lanes & 31)
    word_of_lane = lanes >> 5
    words = jnp.arange(num_words_padded)
    packed = jnp.zeros((lanes.shape[0], num_words_padded), jnp.int32)
    for w in range(min(num_words_padded, num_mask_words(lanes.shape[0]))):
        word = jnp.sum(jnp.where(mask & (word_of_lane[None, :] == w), bit[None, :], 0), axis=1)
        packed = jnp.where(words[None, :] == w, word[:, None], packed)
    return packed


def _dynamic_tree_kernel(
        parent_list_ref,   # i32[Lp]: this sequence's parent_list, padded with -1
        candidate_ref,     # i32[Tp]: candidate id of each node (lane 0 and padding: -1)
        seq_len_ref,       # i32[]: committed length
        mask_ref,          # i32[Tp, Tp] (0/1), or i32[Tp, Wp] when packed
        positions_ref,     # i32[Tp]
        next_token_ref,    # i32[Tp]
        next_sibling_ref,  # i32[Tp]
        valid_ref,         # i32[]
        *, num_nodes, num_slots, topk, packed):
    lanes = jnp.arange(candidate_ref.shape[0])
    parents, ok = _dynamic_parents(parent_list_ref[...], candidate_ref[...], lanes, num_nodes=num_nodes,
                                   num_slots=num_slots, topk=topk)
    _tree_kernel_body(parents, ok, seq_len_ref[...], lanes, mask_ref, positions_ref, next_token_ref,
                      next_sibling_ref, valid_ref, num_nodes=num_nodes, packed=packed)


def _static_tree_kernel(
        parents_ref,       # i32[Tp]: parent of each node, padded with -1
        seq_len_ref,       # i32[]
        mask_ref,          # i32[Tp, Tp] (0/1), or i32[Tp, Wp] when packed
        positions_ref,     # i32[Tp]
        next_token_ref,    # i32[Tp]
        next_sibling_ref,  # i32[Tp]
        valid_ref,         # i32[]
        *, num_nodes, packed):
    lanes = jnp.arange(parents_ref.shape[0])
    parents, ok = _static_parents(parents_ref[...], lanes, num_nodes=num_nodes)
    _tree_kernel_body(parents, ok, seq_len_ref[...], lanes, mask_ref, positions_ref, next_token_ref,
                      next_sibling_ref, valid_ref, num_nodes=num_nodes, packed=packed)


# Named, not left to JAX's default: JAX 0.10 lowers a GPU kernel without compiler params through Mosaic GPU, which
# rejects these small integer tiles. Triton's default of 4 warps: the tiles are at most 64 x 64 int32.
TRITON_PARAMS = pltriton.CompilerParams(num_warps=4, num_stages=1)


def _pad_last(x, size, value):
    """x: [..., N] -> [..., size], padded with value."""
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])], constant_values=value)


def _row_spec(width):
    return pl.BlockSpec((None, width), lambda b: (b, 0))


def _call_tree_kernel(kernel, row_inputs, seq_lens, *, num_nodes, packed, interpret):
    """Runs kernel over grid (B,) on rows [B, width] and seq_lens [B]; unpads its outputs into TreeArrays."""
    batch = seq_lens.shape[0]
    nodes_padded = pl.next_power_of_2(num_nodes)
    mask_width = pl.next_power_of_2(num_mask_words(num_nodes)) if packed else nodes_padded
    scalar_spec = pl.BlockSpec((None,), lambda b: (b,))
    vector = jax.ShapeDtypeStruct((batch, nodes_padded), jnp.int32)
    mask, positions, next_token, next_sibling, valid = pl.pallas_call(
        kernel,
        grid=(batch,),
        in_specs=[_row_spec(x.shape[1]) for x in row_inputs] + [scalar_spec],
        out_specs=[pl.BlockSpec((None, nodes_padded, mask_width), lambda b: (b, 0, 0)),
                   _row_spec(nodes_padded), _row_spec(nodes_padded), _row_spec(nodes_padded), scalar_spec],
        out_shape=[jax.ShapeDtypeStruct((batch, nodes_padded, mask_width), jnp.int32), vector, vector, vector,
                   jax.ShapeDtypeStruct((batch,), jnp.int32)],
        compiler_params=TRITON_PARAMS,
        interpret=interpret,
    )(*row_inputs, seq_lens.astype(jnp.int32))
    return _tree_arrays((mask, positions, next_token, next_sibling, valid), num_nodes=num_nodes, packed=packed)


def _tree_arrays(outputs, *, num_nodes, packed):
    """A kernel's padded outputs (mask [B, Tp, Tp | >= W], positions, next_token, next_sibling [B, Tp], valid [B])
    -> TreeArrays over the T real nodes."""
    mask, positions, next_token, next_sibling, valid = outputs
    batch = valid.shape[0]
    mask = mask[:, :num_nodes, :num_mask_words(num_nodes)] if packed else mask[:, :num_nodes, :num_nodes] != 0
    node = jnp.arange(num_nodes, dtype=jnp.int32)
    return TreeArrays(mask=mask, positions=positions[:, :num_nodes],
                      retrieve_index=jnp.arange(batch, dtype=jnp.int32)[:, None] * num_nodes + node[None, :],
                      retrieve_next_token=next_token[:, :num_nodes],
                      retrieve_next_sibling=next_sibling[:, :num_nodes], valid=valid != 0)


@functools.partial(jax.jit, static_argnames=("topk", "packed", "interpret"))
def _build_dynamic_tree_pallas(parent_list, selected_index, seq_lens, *, topk, packed, interpret):
    """parent_list: i32[B, L], selected_index: i32[B, T-1], seq_lens: i32[B] -> TreeArrays."""
    batch, num_slots = parent_list.shape
    num_nodes = selected_index.shape[1] + 1
    candidate = jnp.concatenate([jnp.full((batch, 1), -1, jnp.int32), selected_index.astype(jnp.int32)], axis=1)
    row_inputs = [_pad_last(parent_list.astype(jnp.int32), pl.next_power_of_2(num_slots), -1),
                  _pad_last(candidate, pl.next_power_of_2(num_nodes), -1)]
    kernel = functools.partial(_dynamic_tree_kernel, num_nodes=num_nodes, num_slots=num_slots, topk=topk,
                               packed=packed)
    return _call_tree_kernel(kernel, row_inputs, seq_lens, num_nodes=num_nodes, packed=packed,
                             interpret=interpret)


@functools.partial(jax.jit, static_argnames=("packed", "interpret"))
def _tree_from_parents_pallas(parents, seq_lens, *, packed, interpret):
    """parents: i32[B, T], seq_lens: i32[B] -> TreeArrays."""
    num_nodes = parents.shape[1]
    row_inputs = [_pad_last(parents.astype(jnp.int32), pl.next_power_of_2(num_nodes), -1)]
    kernel = functools.partial(_static_tree_kernel, num_nodes=num_nodes, packed=packed)
    return _call_tree_kernel(kernel, row_inputs, seq_lens, num_nodes=num_nodes, packed=packed,
                             interpret=interpret)
