"""Tree verification on a TPU (Mosaic): the walks of ``pallas_kernels.tree_verify`` on the TPU's scalar core.

A verify walk is a short chain of dependent lookups (a node's first child, its siblings, a token), which on a TPU
is scalar work: the tree's integer rows (candidates, first child, next sibling, and the target's choice at each node
or the acceptance uniforms) are scalar-prefetched into SMEM, flattened to ``[B * T]``, and each grid step walks one
sequence with scalar loads, writing its accepted path, length and bonus to SMEM outputs. Greedy needs nothing else.

Rejection sampling also needs probability rows: ``target_probs`` and ``draft_probs`` stay in HBM and the walk DMAs
the one row it needs (q at the current node, p at an accepted child) into a VMEM buffer; the residual is a float32
value carried through the walk, a token's probability a one-hot reduction, the bonus the exponential race over the
final residual. A row of V probabilities is held as a dense ``[Vp / 128, 128]`` tile (V padded to a multiple of
1024), token v at ``[v // 128, v % 128]``: as ``[1, Vp]`` it would fill one sublane of eight in every vreg, eight
times the VMEM (a 128k vocabulary's residual, rows and noise then overflow v5e's scoped VMEM).

The scalar rows of the whole batch sit in SMEM at once (4 x B x T int32: 64 KiB at B = T = 64), as do the outputs;
a batch whose rows would not fit the chip's SMEM needs the call split over rows by the caller.

Same rules, inputs and outputs as the GPU kernels, compared with the same references.
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
VOCAB_TILE = 8 * LANE_TILE  # a vocabulary row padded to whole [8, 128] vregs


def _walk(first_child, choose_child, state, accept_ref, b, *, num_steps):
    """The depth loop on scalars: writes row b of accept_ref (root first, -1 padded) and returns
    (accept_length, last node, state). first_child(cur) -> i32; choose_child(cur, first, state) -> (child or -1,
    state)."""
    accept_ref[b, 0] = jnp.int32(0)
    for slot in range(1, num_steps + 1):
        accept_ref[b, slot] = jnp.int32(-1)

    def level(carry):
        length, cur, _, state = carry
        child, state = choose_child(cur, first_child(cur), state)
        found = child >= 0

        @pl.when(found)
        def _record():
            accept_ref[b, length + 1] = child

        return length + found.astype(jnp.int32), jnp.where(found, child, cur), ~found, state

    length, cur, _, state = lax.while_loop(lambda c: (c[0] < num_steps) & ~c[2], level,
                                           (jnp.int32(0), jnp.int32(0), jnp.bool_(False), state))
    return length, cur, state


def _node_reader(ref, base, num_nodes):
    """Scalar read of a sequence's node value: i -> ref[base + i], -1 where i is not a node of the tree."""
    def read(i):
        inside = (i >= 0) & (i < num_nodes)
        return jnp.where(inside, ref[base + jnp.clip(i, 0, num_nodes - 1)], -1)
    return read


def _greedy_kernel(candidates_ref, next_token_ref, next_sibling_ref, predict_ref,  # SMEM i32[B * T]
                   accept_ref, length_ref, bonus_ref,  # SMEM out: i32[B, S + 1], i32[B], i32[B]
                   *, num_steps, num_nodes):
    b = pl.program_id(0)
    base = b * num_nodes
    token_of, child_of, sibling_of, predict_of = (_node_reader(ref, base, num_nodes) for ref in (
        candidates_ref, next_token_ref, next_sibling_ref, predict_ref))

    def choose_child(cur, first, state):
        wanted = predict_of(cur)
        child, _ = lax.while_loop(lambda c: (c[0] >= 0) & (token_of(c[0]) != wanted) & (c[1] < num_nodes),
                                  lambda c: (sibling_of(c[0]), c[1] + 1), (first, jnp.int32(0)))
        return jnp.where(token_of(child) == wanted, child, -1), state

    length, last, _ = _walk(child_of, choose_child, (), accept_ref, b, num_steps=num_steps)
    length_ref[b] = length
    bonus_ref[b] = predict_of(last)


def _smem_outputs(batch, num_steps):
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    shapes = [jax.ShapeDtypeStruct((batch, num_steps + 1), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.int32),
              jax.ShapeDtypeStruct((batch,), jnp.int32)]
    return [smem] * 3, shapes


@functools.partial(jax.jit, static_argnames=("num_steps", "interpret"))
def verify_tree_greedy_tpu(candidates, retrieve_next_token, retrieve_next_sibling, target_predict, *, num_steps,
                           interpret=False):
    """i32[B, T] each -> (accept_index i32[B, S + 1], accept_length i32[B], bonus i32[B])."""
    batch, num_nodes = candidates.shape
    out_specs, out_shape = _smem_outputs(batch, num_steps)
    flat = [x.astype(jnp.int32).reshape(-1) for x in (candidates, retrieve_next_token, retrieve_next_sibling,
                                                      target_predict)]
    return pl.pallas_call(
        functools.partial(_greedy_kernel, num_steps=num_steps, num_nodes=num_nodes),
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=4, grid=(batch,), in_specs=[],
                                               out_specs=out_specs),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="verify_tree_greedy_tpu",
    )(*flat)


def _total(x):
    """[R, 128] -> [1, 1]: the sum of every element."""
    return jnp.sum(jnp.sum(x, axis=1, keepdims=True), axis=0, keepdims=True)


def _token_value(row, token, index):
    """row: f32[Vp / 128, 128], token: i32 scalar -> row's probability of token as a [1, 1] value (a one-hot
    reduction); index: each element's token id."""
    return _total(jnp.where(index == token, row, 0.0))


def _normalized(r, fallback):
    """r: f32[Vp / 128, 128] -> r / sum(r), or fallback where sum(r) == 0 (a rejection that had probability 0)."""
    total = _total(r)
    return jnp.where(total > 0, r / jnp.where(total > 0, total, 1.0), fallback)


def _rejection_kernel(candidates_ref, next_token_ref, next_sibling_ref, uniform_ref,  # SMEM [B * T]
                      target_hbm, draft_hbm,   # f32[B, T, Vp / 128, 128] in HBM, one row DMA'd at a time
                      noise_ref,               # f32[Vp / 128, 128] VMEM block: Exp(1) noise for the final draw
                      accept_ref, length_ref, bonus_ref,  # SMEM out
                      row_scr, sem,            # f32[Vp / 128, 128] VMEM, a DMA semaphore
                      *, num_steps, num_nodes, vocab):
    b = pl.program_id(0)
    base = b * num_nodes
    token_of, child_of, sibling_of = (_node_reader(ref, base, num_nodes) for ref in (
        candidates_ref, next_token_ref, next_sibling_ref))
    index = (lax.broadcasted_iota(jnp.int32, row_scr.shape, 0) * LANE_TILE
             + lax.broadcasted_iota(jnp.int32, row_scr.shape, 1))

    def fetch(probs_hbm, node):
        copy = pltpu.make_async_copy(probs_hbm.at[b, node], row_scr, sem)
        copy.start()
        copy.wait()
        return row_scr[...]

    def choose_child(cur, first, residual):
        q = fetch(draft_hbm, cur)

        def keep_looking(c):
            child, found, _, tried = c
            return (child >= 0) & (found < 0) & (tried < num_nodes)

        def try_sibling(c):
            child, _, residual, tried = c
            x = token_of(child)
            u = uniform_ref[base + jnp.clip(child, 0, num_nodes - 1)]
            # Compared as int32: Mosaic turns only 32-bit vectors into scalars.
            accept = jnp.where(u * _token_value(q, x, index) < _token_value(residual, x, index), 1, 0)[0, 0] == 1
            residual = jnp.where(accept, residual, _normalized(jnp.maximum(residual - q, 0.0), residual))
            return (jnp.where(accept, child, sibling_of(child)), jnp.where(accept, child, -1), residual,
                    tried + 1)

        _, found, residual, _ = lax.while_loop(keep_looking, try_sibling, (first, jnp.int32(-1), residual,
                                                                         jnp.int32(0)))
        accepted_p = fetch(target_hbm, jnp.maximum(found, 0))
        return found, jnp.where(found >= 0, _normalized(accepted_p, residual), residual)

    root_p = fetch(target_hbm, 0)
    length, _, residual = _walk(child_of, choose_child, _normalized(root_p, root_p), accept_ref, b,
                                num_steps=num_steps)
    score = jnp.where((residual > 0) & (index < vocab), residual / noise_ref[...], -1.0)
    best = jnp.max(jnp.max(score, axis=1, keepdims=True), axis=0, keepdims=True)
    first = jnp.where(score == best, index, row_scr.size)
    length_ref[b] = length
    bonus_ref[b] = jnp.min(jnp.min(first, axis=1, keepdims=True), axis=0, keepdims=True)[0, 0]


@functools.partial(jax.jit, static_argnames=("num_steps", "interpret"))
def verify_tree_rejection_tpu(candidates, retrieve_next_token, retrieve_next_sibling, target_probs, draft_probs,
                              accept_uniform, final_noise, *, num_steps, interpret=False):
    """Shapes as ``verify_tree_rejection_reference``: i32[B, T] x3, f32[B, T, V] x2, f32[B, T], f32[B, V]."""
    batch, num_nodes, vocab = target_probs.shape
    padded_vocab = -(-vocab // VOCAB_TILE) * VOCAB_TILE
    tile = (padded_vocab // LANE_TILE, LANE_TILE)
    tiled = lambda x, value: jnp.pad(x.astype(jnp.float32), [(0, 0)] * (x.ndim - 1) + [(0, padded_vocab - vocab)],
                                     constant_values=value).reshape(x.shape[:-1] + tile)
    out_specs, out_shape = _smem_outputs(batch, num_steps)
    scalars = [x.astype(jnp.int32).reshape(-1) for x in (candidates, retrieve_next_token, retrieve_next_sibling)]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(batch,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY),
                  pl.BlockSpec((None,) + tile, lambda b, *_: (b, 0, 0))],
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM(tile, jnp.float32), pltpu.SemaphoreType.DMA(())],
    )
    return pl.pallas_call(
        functools.partial(_rejection_kernel, num_steps=num_steps, num_nodes=num_nodes, vocab=vocab),
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="verify_tree_rejection_tpu",
    )(*scalars, accept_uniform.astype(jnp.float32).reshape(-1), tiled(target_probs, 0.0), tiled(draft_probs, 0.0),
      tiled(final_noise, 1.0))
