"""Tree building on a TPU (Mosaic): the buffers of ``pallas_kernels.tree_build`` from [Tp, Tp] vector tiles.

One grid step builds one sequence's tree. The node axis is padded to a multiple of 128 (a vreg's lanes; the tile's
rows are then a multiple of 8 sublanes too), and every step is an elementwise compare and a reduction over one axis
of a ``[Tp, Tp]`` int32 tile, the operations a TPU's vector unit does natively: a node's values are held as a row
``[1, Tp]`` (node on the lanes) or a column ``[Tp, 1]`` (node on the sublanes), and a row becomes a column by
selecting the tile's diagonal and reducing across lanes (no transposes, no gathers). The ancestor mask is built by
T - 1 pointer-chasing steps as in the GPU kernel; a dynamic tree's slot lookup ``candidate // topk`` is a range
compare against the slots (no vector division). Inputs arrive as ``[B, 1, width]`` arrays so each block's last two
dimensions are whole (TPU tiling), outputs leave the same way.

Same inputs, outputs and chain fallback as the GPU kernel, compared with the same reference.
Checked two ways on a CPU: against the reference in Pallas's TPU interpret mode (``impl="tpu_interpret"``), and
compiled by the real TPU compiler for v5e, v6e and v5p at the engine's shapes (tests/aot). It has not run on a TPU
yet.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANE_TILE = 128


def _iotas(size):
    """(row index, column index) i32[size, size]: the sublane and lane number of each tile element."""
    return (lax.broadcasted_iota(jnp.int32, (size, size), 0), lax.broadcasted_iota(jnp.int32, (size, size), 1))


def _to_column(row, sub, lane):
    """i32[1, N] -> i32[N, 1] through the tile's diagonal."""
    return jnp.sum(jnp.where(sub == lane, row, 0), axis=1, keepdims=True)


def _to_row(column, sub, lane):
    """i32[N, 1] -> i32[1, N] through the tile's diagonal."""
    return jnp.sum(jnp.where(sub == lane, column, 0), axis=0, keepdims=True)


def _first(hit, index, axis):
    """The smallest index with a hit along axis (-1 where none); keeps the reduced axis as 1."""
    none = hit.shape[axis]
    first = jnp.min(jnp.where(hit, index, none), axis=axis, keepdims=True)
    return jnp.where(first == none, -1, first)


def _dynamic_parents_column(parent_list, candidate, sub, lane, *, num_nodes, num_slots, topk):
    """parent_list: i32[1, Lp] (-1 padded), candidate: i32[1, Tp] (lane 0 and padding: -1) -> (parents i32[Tp, 1],
    ok i32[Tp, 1]: 1 where node i's parent was found or i is no node)."""
    num_slots_padded = parent_list.shape[1]
    candidate_col = _to_column(candidate, sub, lane)                                   # [Tp, 1]
    slot = lax.broadcasted_iota(jnp.int32, (1, num_slots_padded), 1)                   # [1, Lp]
    in_slot = (candidate_col >= slot * topk) & (candidate_col < (slot + 1) * topk)    # [Tp, Lp]
    in_slot &= slot < num_slots
    parent_candidate = jnp.sum(jnp.where(in_slot, parent_list, 0), axis=1, keepdims=True)
    from_root = jnp.sum(jnp.where(in_slot & (slot == 0), 1, 0), axis=1, keepdims=True) > 0
    in_range = jnp.sum(jnp.where(in_slot, 1, 0), axis=1, keepdims=True) > 0
    earlier_node = (lane >= 1) & (lane < sub)
    parent_node = _first((candidate == parent_candidate) & earlier_node, lane, axis=1)
    parents = jnp.where(from_root, 0, parent_node)
    row = sub[:, :1]
    is_node = (row >= 1) & (row < num_nodes)
    ok = ~is_node | (in_range & (candidate_col >= 0) & (parents >= 0))
    return parents, ok.astype(jnp.int32)


def _write_tree(parents_col, ok_col, seq_len, sub, lane, mask_ref, positions_ref, next_token_ref, next_sibling_ref,
                valid_ref, *, num_nodes, packed):
    """Writes one sequence's buffers from the parent of each node (column; chain fallback when not every ok)."""
    row = sub[:, :1]
    valid = jnp.min(ok_col, axis=0, keepdims=True)                                       # [1, 1]
    parents_col = jnp.where(valid == 1, parents_col, row - 1)
    parents_col = jnp.where(row == 0, -1, jnp.where(row < num_nodes, parents_col, -2))  # -2: padding, no one's parent
    parents_row = _to_row(parents_col, sub, lane)

    # The mask is carried as int32 0/1: Mosaic cannot carry a vector of i1 through a loop ("failed to legalize
    # operation 'scf.for'").
    def climb(_, carry):
        mask, ancestor = carry                          # i32[Tp, Tp] (0/1), i32[Tp, 1]
        mask = jnp.where(ancestor == lane, 1, mask)
        grand = jnp.sum(jnp.where(ancestor == lane, parents_row, 0), axis=1, keepdims=True)
        return mask, jnp.where(ancestor >= 0, grand, -1)

    mask, _ = lax.fori_loop(0, num_nodes - 1, climb, (jnp.where(sub == lane, 1, 0), parents_col))
    depth_col = jnp.sum(mask, axis=1, keepdims=True)
    mask = mask == 1
    positions_ref[...] = seq_len + _to_row(depth_col, sub, lane) - 1
    # Transposed tiles (child / sibling on the sublanes, node on the lanes) give rows directly.
    is_node_col = row < num_nodes
    next_token_ref[...] = _first((parents_col == lane) & is_node_col, sub, axis=0)
    next_sibling_ref[...] = _first((parents_col == parents_row) & (sub > lane) & (parents_row >= 0) & is_node_col,
                                   sub, axis=0)
    valid_ref[...] = jnp.broadcast_to(valid, valid_ref.shape)
    if packed:
        bit = jnp.left_shift(jnp.ones_like(lane), lane & 31)
        words = lax.broadcasted_iota(jnp.int32, mask_ref.shape, 1)
        packed_mask = jnp.zeros(mask_ref.shape, jnp.int32)
        for w in range(mask_ref.shape[1]):
            word = jnp.sum(jnp.where(mask & ((lane >> 5) == w), bit, 0), axis=1, keepdims=True)
            packed_mask = jnp.where(words == w, word, packed_mask)
        mask_ref[...] = packed_mask
    else:
        mask_ref[...] = mask.astype(jnp.int32)


def _dynamic_kernel(parent_list_ref, candidate_ref, seq_len_ref, mask_ref, positions_ref, next_token_ref,
                    next_sibling_ref, valid_ref, *, num_nodes, num_slots, topk, packed):
    """parent_list [1, Lp], candidate [1, Tp], seq_len [1, 1] -> mask [Tp, Tp | W], rows [1, Tp], valid [1, 1]."""
    sub, lane = _iotas(candidate_ref.shape[1])
    parents, ok = _dynamic_parents_column(parent_list_ref[...], candidate_ref[...], sub, lane, num_nodes=num_nodes,
                                          num_slots=num_slots, topk=topk)
    _write_tree(parents, ok, seq_len_ref[...], sub, lane, mask_ref, positions_ref, next_token_ref,
                next_sibling_ref, valid_ref, num_nodes=num_nodes, packed=packed)


def _static_kernel(parents_ref, seq_len_ref, mask_ref, positions_ref, next_token_ref, next_sibling_ref, valid_ref,
                   *, num_nodes, packed):
    """parents [1, Tp], seq_len [1, 1] -> as _dynamic_kernel."""
    sub, lane = _iotas(parents_ref.shape[1])
    parents = _to_column(parents_ref[...], sub, lane)
    row = sub[:, :1]
    ok = ~((row >= 1) & (row < num_nodes)) | ((parents >= 0) & (parents < row))
    _write_tree(parents, ok.astype(jnp.int32), seq_len_ref[...], sub, lane, mask_ref, positions_ref,
                next_token_ref, next_sibling_ref, valid_ref, num_nodes=num_nodes, packed=packed)


def _padded(n):
    return -(-n // LANE_TILE) * LANE_TILE


def _as_rows(x, width, value):
    """i32[B, N] -> i32[B, 1, width], padded with value."""
    return jnp.pad(x.astype(jnp.int32), [(0, 0), (0, width - x.shape[1])], constant_values=value)[:, None, :]


def call_tree_kernel_tpu(kernel, row_inputs, seq_lens, *, num_nodes, num_words, packed, interpret):
    """Runs kernel over grid (B,) on row_inputs i32[B, 1, width] and seq_lens i32[B].

    Returns (mask i32[B, Tp, Tp] or packed i32[B, Tp, W], positions, next_token, next_sibling i32[B, Tp],
    valid i32[B]), Tp = T padded to a multiple of 128.
    """
    batch = seq_lens.shape[0]
    nodes = _padded(num_nodes)
    mask_width = num_words if packed else nodes
    row_spec = lambda width: pl.BlockSpec((None, 1, width), lambda b: (b, 0, 0))
    row_shape = jax.ShapeDtypeStruct((batch, 1, nodes), jnp.int32)
    mask, positions, next_token, next_sibling, valid = pl.pallas_call(
        kernel,
        grid=(batch,),
        in_specs=[row_spec(x.shape[2]) for x in row_inputs] + [row_spec(1)],
        out_specs=[pl.BlockSpec((None, nodes, mask_width), lambda b: (b, 0, 0)),
                   row_spec(nodes), row_spec(nodes), row_spec(nodes), row_spec(1)],
        out_shape=[jax.ShapeDtypeStruct((batch, nodes, mask_width), jnp.int32), row_shape, row_shape, row_shape,
                   jax.ShapeDtypeStruct((batch, 1, 1), jnp.int32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="tree_build_tpu",
    )(*row_inputs, seq_lens.astype(jnp.int32)[:, None, None])
    return mask, positions[:, 0], next_token[:, 0], next_sibling[:, 0], valid[:, 0, 0]


@functools.partial(jax.jit, static_argnames=("topk", "num_words", "packed", "interpret"))
def dynamic_tree_tpu(parent_list, selected_index, seq_lens, *, topk, num_words, packed, interpret=False):
    """parent_list i32[B, L], selected_index i32[B, T - 1], seq_lens i32[B] -> call_tree_kernel_tpu's outputs."""
    batch = parent_list.shape[0]
    num_nodes = selected_index.shape[1] + 1
    candidate = jnp.concatenate([jnp.full((batch, 1), -1, jnp.int32), selected_index.astype(jnp.int32)], axis=1)
    rows = [_as_rows(parent_list, _padded(parent_list.shape[1]), -1), _as_rows(candidate, _padded(num_nodes), -1)]
    kernel = functools.partial(_dynamic_kernel, num_nodes=num_nodes, num_slots=parent_list.shape[1], topk=topk,
                               packed=packed)
    return call_tree_kernel_tpu(kernel, rows, seq_lens, num_nodes=num_nodes, num_words=num_words, packed=packed,
                                interpret=interpret)


@functools.partial(jax.jit, static_argnames=("num_words", "packed", "interpret"))
def static_tree_tpu(parents, seq_lens, *, num_words, packed, interpret=False):
    """parents i32[B, T], seq_lens i32[B] -> call_tree_kernel_tpu's outputs."""
    num_nodes = parents.shape[1]
    kernel = functools.partial(_static_kernel, num_nodes=num_nodes, packed=packed)
    return call_tree_kernel_tpu(kernel, [_as_rows(parents, _padded(num_nodes), -1)], seq_lens, num_nodes=num_nodes,
                                num_words=num_words, packed=packed, interpret=interpret)
