"""Verification of a draft tree against the target: greedy, and lossless stochastic.

Glossary. The walk starts at the root (node 0, the last committed token). A child of the current node is
*accepted* when the verification rule takes its token; the walk moves to it and continues, at most
``num_steps`` times. ``accept_index[b]`` lists the local node ids of the walk, root first, -1 padded;
``accept_length[b]`` counts the accepted draft tokens (the root excluded). The *bonus* token is the one the
target contributes after the last accepted node, so every verify step commits ``accept_length + 1`` tokens.
The *residual* is the distribution a rejected draft leaves behind for the tokens still to be drawn.

Greedy (:func:`verify_tree_greedy`): at the current node, accept the first child (in sibling order) whose token
equals the target's argmax there; the bonus is the target's argmax at the last accepted node. The output is
token for token what the target alone would produce.

Sampling (:func:`verify_tree_sampling`), p_i = the target's distribution at node i after temperature, top-k and
top-p (computed by the caller: ``jspec.sampling.sampling_probs``):

- Deterministic drafts (``draft_probs=None``; EAGLE top-k trees, where the children are a function of the
  prefix): draw y_i ~ p_i independently at every node, then walk as greedy with y in place of the argmax.
  Each emitted token is y at the current node, a fresh draw from the target's conditional given the accepted
  prefix, whatever the drafts were; so the output is distributed exactly as the target's. (SGLang's
  ``tree_speculative_sampling_target_only`` with both thresholds at 1 computes the same thing.)
- Sampled drafts (``draft_probs`` given: node i's children are i.i.d. draws from q_i = draft_probs[b, i],
  drawn with replacement, so siblings may repeat), recursive rejection sampling over siblings (SpecInfer,
  Miao et al. 2023; RSD, Jeon et al. 2024; a chain is Leviathan et al. 2023's speculative sampling). At a node
  with residual r (initially r = p_i), for each child c in sibling order with token x: accept with probability
  min(1, r(x) / q(x)); on rejection r <- normalize(max(r - q, 0)) and try the next sibling; when every sibling
  is rejected (or there is none) the bonus is drawn from r and the walk stops.

  Why it is exact: let E_k(r) be the distribution of the token this procedure emits at a node with residual r
  and k siblings still to try. E_0(r) = r. For k >= 1 the sibling x ~ q is emitted with probability
  sum_x q(x) min(1, r(x)/q(x)) [x = y] = min(q(y), r(y)); rejection happens with probability
  Z = 1 - sum_y min(q(y), r(y)) = sum_y max(r(y) - q(y), 0), after which, by induction, the emitted token is
  distributed as r' = max(r - q, 0) / Z. Together: min(q, r) + Z r' = min(q, r) + max(r - q, 0) = r. So
  E_k(p_i) = p_i: the first emitted token below node i is a draw from the target. Given that the accepted
  child is c, its own children were drawn from q_c independently of the decisions above, so the argument
  repeats from c with residual p_c. (It needs i.i.d. siblings: drafts drawn without replacement need the
  residual-adjusted q of RSD-without-replacement, which this op does not implement.)

Randomness is drawn outside the kernel (one uniform per node for the acceptance tests; exponential noise
over the vocabulary for the final draw, whose argmax of r / noise is an exact draw from r), so kernel and
reference see the same numbers and must agree exactly.

Kernel: Pallas with the Triton lowering on GPU (the walk is a short sequential loop of small vector ops per
sequence; Mosaic GPU's warpgroup machinery has nothing to accelerate). One program per sequence
(grid=(B,)); a ``fori_loop`` over the ``num_steps`` depth levels and, inside it, one over at most T siblings,
both with static trip counts; node lookups are one-hot reductions over the node lanes (padded to a power of
two in the wrapper), and rows of the [T, V] probability blocks are read at the current node only. The vocabulary
axis is padded to a power of two as Triton requires (a copy when V is not one already). References are plain
jnp with ``while_loop``.
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
from pallas_kernels.tree_verify_tpu import verify_tree_greedy_tpu, verify_tree_rejection_tpu


class Verified(NamedTuple):
    """The outcome of verifying a batch of trees (num_steps = S)."""

    accept_index: jax.Array   # i32[B, S + 1]: local node ids of the accepted path, root first, -1 padded
    accept_length: jax.Array  # i32[B]: accepted draft tokens, the bonus excluded
    bonus: jax.Array          # i32[B]: the target's token after the last accepted node


# --------------------------------------------------------------------------------------------------------------
# Public ops
# --------------------------------------------------------------------------------------------------------------


def verify_tree_greedy(candidates: jax.Array, retrieve_next_token: jax.Array, retrieve_next_sibling: jax.Array,
                       target_predict: jax.Array, *, num_steps: int, impl: ImplName = "auto") -> Verified:
    """Greedy verification: follow the children whose token is the target's argmax.

    Args:
      candidates: i32[B, T], the token of each node (node 0: the root).
      retrieve_next_token, retrieve_next_sibling: i32[B, T], first child / next sibling, -1 where none.
      target_predict: i32[B, T], the target's argmax at each node.
      num_steps: the most draft tokens to accept (the tree's depth).
      impl: "auto" | "pallas" | "interpret" | "tpu" | "tpu_interpret" | "reference" (pallas_kernels.impl).
    Returns:
      Verified(accept_index i32[B, num_steps + 1], accept_length i32[B], bonus i32[B]).
    """
    _check_tree_args(candidates, retrieve_next_token, retrieve_next_sibling, num_steps)
    _check_shape("target_predict", target_predict, candidates.shape)
    return _verify_greedy(resolve_impl(impl, "tree_verify"), candidates, retrieve_next_token, retrieve_next_sibling,
                          target_predict, num_steps=num_steps)


def verify_tree_sampling(candidates: jax.Array, retrieve_next_token: jax.Array, retrieve_next_sibling: jax.Array,
                         target_probs: jax.Array, key: jax.Array, *, num_steps: int,
                         draft_probs: jax.Array | None = None, impl: ImplName = "auto") -> Verified:
    """Lossless stochastic verification (see the module docstring for the rules and the proof).

    Args:
      candidates: i32[B, T]; retrieve_next_token, retrieve_next_sibling: i32[B, T] (-1 where none).
      target_probs: f32[B, T, V], the target's distribution at each node after temperature/top-k/top-p.
      key: a PRNG key, or one per row (key[B]: row b's draws then use key[b] alone).
      num_steps: the most draft tokens to accept.
      draft_probs: f32[B, T, V] or None. draft_probs[b, i] is the distribution q that node i's children were
        drawn from, i.i.d.; None for deterministic drafts (top-k trees).
      impl: "auto" | "pallas" | "interpret" | "tpu" | "tpu_interpret" | "reference" (pallas_kernels.impl).
    Returns:
      Verified(accept_index i32[B, num_steps + 1], accept_length i32[B], bonus i32[B]).
    """
    _check_tree_args(candidates, retrieve_next_token, retrieve_next_sibling, num_steps)
    if target_probs.ndim != 3 or target_probs.shape[:2] != candidates.shape:
        raise ValueError(f"target_probs.shape={target_probs.shape}, expected {candidates.shape} + (V,)")
    if draft_probs is not None:
        _check_shape("draft_probs", draft_probs, target_probs.shape)
    kind = resolve_impl(impl, "tree_verify")
    if draft_probs is None:
        target_predict = (sample_each_node(key, target_probs) if jnp.ndim(key) == 0
                          else jax.vmap(sample_each_node)(key, target_probs))
        return _verify_greedy(kind, candidates, retrieve_next_token, retrieve_next_sibling, target_predict,
                              num_steps=num_steps)
    if jnp.ndim(key) == 0:
        accept_uniform, final_noise = _rejection_noise(key, target_probs.shape)
    else:  # per row: one row's noise, [1, T] and [1, V], from its own key
        accept_uniform, final_noise = jax.vmap(lambda k: _rejection_noise(k, (1,) + target_probs.shape[1:]))(key)
        accept_uniform, final_noise = accept_uniform[:, 0], final_noise[:, 0]
    args = (candidates, retrieve_next_token, retrieve_next_sibling, target_probs, draft_probs, accept_uniform,
            final_noise)
    if kind is Impl.REFERENCE:
        return verify_tree_rejection_reference(*args, num_steps=num_steps)
    if kind.is_tpu:
        return Verified(*verify_tree_rejection_tpu(*args, num_steps=num_steps, interpret=kind.interpreted))
    return _verify_tree_rejection_pallas(*args, num_steps=num_steps, interpret=kind is Impl.INTERPRET)


@jax.jit
def sample_each_node(key: jax.Array, probs: jax.Array) -> jax.Array:
    """One independent draw y ~ probs[..., :] per row by inverse CDF: f32[..., V] -> i32[...]."""
    cdf = jnp.cumsum(probs.astype(jnp.float32), axis=-1)
    threshold = jax.random.uniform(key, probs.shape[:-1]) * cdf[..., -1]
    token = jnp.sum(cdf <= threshold[..., None], axis=-1)
    vocab = probs.shape[-1]
    last_possible = vocab - 1 - jnp.argmax(probs[..., ::-1] > 0, axis=-1)  # rounding never picks p = 0
    return jnp.minimum(token, last_possible).astype(jnp.int32)


def _rejection_noise(key, probs_shape):
    """(accept_uniform f32[B, T], final_noise f32[B, V]): one uniform per node, exponential noise per token."""
    batch, num_nodes, vocab = probs_shape
    accept_key, final_key = jax.random.split(key)
    return (jax.random.uniform(accept_key, (batch, num_nodes)),
            jax.random.exponential(final_key, (batch, vocab)))


def _verify_greedy(kind: Impl, *args, num_steps):
    if kind is Impl.REFERENCE:
        return verify_tree_greedy_reference(*args, num_steps=num_steps)
    if kind.is_tpu:
        return Verified(*verify_tree_greedy_tpu(*args, num_steps=num_steps, interpret=kind.interpreted))
    return _verify_tree_greedy_pallas(*args, num_steps=num_steps, interpret=kind is Impl.INTERPRET)


def _check_shape(name, x, shape):
    if x.shape != tuple(shape):
        raise ValueError(f"{name}.shape={x.shape}, expected {tuple(shape)}")


def _check_tree_args(candidates, next_token, next_sibling, num_steps):
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps={num_steps!r}, expected an int >= 1")
    if candidates.ndim != 2 or candidates.shape[1] < 1:
        raise ValueError(f"candidates.shape={candidates.shape}, expected (B, T) with T >= 1")
    _check_shape("retrieve_next_token", next_token, candidates.shape)
    _check_shape("retrieve_next_sibling", next_sibling, candidates.shape)


# --------------------------------------------------------------------------------------------------------------
# References (the specification)
# --------------------------------------------------------------------------------------------------------------


def _reader(values):
    """values: [T, ...] -> read(i): values[i], or -1 when i is not a node (only for integer values)."""
    num_nodes = values.shape[0]
    return lambda i: jnp.where((i >= 0) & (i < num_nodes), values[jnp.clip(i, 0, num_nodes - 1)], -1)


def _walk_reference(choose_child, start, *, num_steps):
    """The walk shared by both rules; choose_child(cur, state) -> (child or -1, state).

    Returns (accept_index i32[S+1], accept_length, last node, state).
    """
    def descend(carry):
        accept_index, length, cur, _, state = carry
        child, state = choose_child(cur, state)
        found = child >= 0
        accept_index = accept_index.at[length + 1].set(jnp.where(found, child, -1))
        return accept_index, length + found, jnp.where(found, child, cur), ~found, state

    init = (jnp.full((num_steps + 1,), -1, jnp.int32).at[0].set(0), jnp.int32(0), jnp.int32(0),
            jnp.bool_(False), start)
    accept_index, length, cur, _, state = lax.while_loop(lambda c: (c[1] < num_steps) & ~c[3], descend, init)
    return accept_index, length, cur, state


@functools.partial(jax.jit, static_argnames=("num_steps",))
def verify_tree_greedy_reference(candidates, retrieve_next_token, retrieve_next_sibling, target_predict, *,
                                 num_steps) -> Verified:
    """candidates, next_token, next_sibling, target_predict: i32[B, T] -> Verified."""

    def one_sequence(candidates, next_token, next_sibling, predict):
        token_of, first_child, next_of = _reader(candidates), _reader(next_token), _reader(next_sibling)

        def choose_child(cur, state):
            def keep_looking(c):
                return (c[0] >= 0) & (token_of(c[0]) != predict[cur]) & (c[1] < candidates.shape[0])
            child, _ = lax.while_loop(keep_looking, lambda c: (next_of(c[0]), c[1] + 1), (first_child(cur), 0))
            return child, state

        accept_index, length, last, _ = _walk_reference(choose_child, (), num_steps=num_steps)
        return Verified(accept_index, length, predict[last])

    args = (candidates, retrieve_next_token, retrieve_next_sibling, target_predict)
    return jax.vmap(one_sequence)(*(x.astype(jnp.int32) for x in args))


def _normalized(r, fallback):
    """r: f32[V] -> r / sum(r), or fallback where sum(r) == 0 (a rejection that had probability 0)."""
    total = jnp.sum(r)
    return jnp.where(total > 0, r / jnp.where(total > 0, total, 1.0), fallback)


def _exponential_race(r, noise):
    """r: f32[V] (unnormalized), noise: f32[V] ~ Exp(1) -> argmax r / noise, an exact draw from r."""
    return jnp.argmax(jnp.where(r > 0, r / noise, -1.0), axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("num_steps",))
def verify_tree_rejection_reference(candidates, retrieve_next_token, retrieve_next_sibling, target_probs,
                                    draft_probs, accept_uniform, final_noise, *, num_steps) -> Verified:
    """Recursive rejection sampling over siblings.

    candidates, next_token, next_sibling: i32[B, T]; target_probs, draft_probs: f32[B, T, V];
    accept_uniform: f32[B, T] (one uniform per node); final_noise: f32[B, V] (Exp(1)) -> Verified.
    """

    def one_sequence(candidates, next_token, next_sibling, p, q, uniform, noise):
        token_of, first_child, next_of = _reader(candidates), _reader(next_token), _reader(next_sibling)

        def choose_child(cur, residual):
            def try_sibling(c):
                child, _, residual, _ = c
                x = token_of(child)
                accept = uniform[child] * q[cur, x] < residual[x]   # prob. min(1, r(x) / q(x))
                residual = jnp.where(accept, residual, _normalized(jnp.maximum(residual - q[cur], 0), residual))
                return jnp.where(accept, child, next_of(child)), accept, residual, c[3] + 1

            def keep_looking(c):
                return (c[0] >= 0) & ~c[1] & (c[3] < candidates.shape[0])

            child, accepted, residual, _ = lax.while_loop(keep_looking, try_sibling,
                                                          (first_child(cur), False, residual, 0))
            child = jnp.where(accepted, child, -1)
            return child, jnp.where(accepted, _normalized(p[jnp.maximum(child, 0)], residual), residual)

        accept_index, length, _, residual = _walk_reference(choose_child, _normalized(p[0], p[0]),
                                                            num_steps=num_steps)
        return Verified(accept_index, length, _exponential_race(residual, noise))

    ints = (x.astype(jnp.int32) for x in (candidates, retrieve_next_token, retrieve_next_sibling))
    floats = (x.astype(jnp.float32) for x in (target_probs, draft_probs, accept_uniform, final_noise))
    return jax.vmap(one_sequence)(*ints, *floats)


# --------------------------------------------------------------------------------------------------------------
# Pallas kernels
# --------------------------------------------------------------------------------------------------------------


def _read(values, index, lanes, limit):
    """values: [N] -> values[index] for a scalar index in [0, limit), else -1 (a one-hot reduce)."""
    picked = jnp.sum(jnp.where(lanes == index, values, 0), axis=0)
    return jnp.where((index >= 0) & (index < limit), picked, -1)


def _kernel_walk(first_child, choose_among_siblings, state, accept_ref, *, num_steps, num_nodes):
    """The depth loop of both kernels.

    first_child(cur) -> i32 scalar; choose_among_siblings(cur, first, state) -> (child or -1, state).
    Writes accept_ref (i32[Sp]) and returns (accept_length, last node, state).
    """
    slots = jnp.arange(accept_ref.shape[0])

    def level(depth, carry):
        accept_index, length, cur, done, state = carry
        first = jnp.where(done, -1, first_child(cur))
        child, state = choose_among_siblings(cur, first, state)
        found = child >= 0
        accept_index = jnp.where((slots == depth + 1) & found, child, accept_index)
        return accept_index, length + found.astype(jnp.int32), jnp.where(found, child, cur), done | ~found, state

    init = (jnp.where(slots == 0, 0, -1), jnp.int32(0), jnp.int32(0), jnp.bool_(False), state)
    accept_index, length, cur, _, state = lax.fori_loop(0, num_steps, level, init)
    accept_ref[...] = accept_index
    return length, cur, state


def _greedy_kernel(
        candidates_ref,    # i32[Tp]: token of each node
        next_token_ref,    # i32[Tp]: first child, -1 where none
        next_sibling_ref,  # i32[Tp]: next sibling, -1 where none
        predict_ref,       # i32[Tp]: the target's argmax at each node
        accept_ref,        # i32[Sp]: out, accepted node ids, root first, -1 padded
        length_ref,        # i32[]: out, accepted draft tokens
        bonus_ref,         # i32[]: out, the target's token after the last accepted node
        *, num_steps, num_nodes):
    lanes = jnp.arange(candidates_ref.shape[0])
    candidates, next_token, next_sibling, predict = (
        candidates_ref[...], next_token_ref[...], next_sibling_ref[...], predict_ref[...])
    read = lambda values, i: _read(values, i, lanes, num_nodes)

    def choose_among_siblings(cur, first, state):
        wanted = read(predict, cur)

        def try_sibling(_, carry):
            child, found = carry
            hit = (found < 0) & (child >= 0) & (read(candidates, child) == wanted)
            found = jnp.where(hit, child, found)
            return jnp.where(found < 0, read(next_sibling, child), -1), found

        _, found = lax.fori_loop(0, num_nodes, try_sibling, (first, jnp.int32(-1)))
        return found, state

    length, last, _ = _kernel_walk(lambda cur: read(next_token, cur), choose_among_siblings, (), accept_ref,
                                   num_steps=num_steps, num_nodes=num_nodes)
    length_ref[...] = length
    bonus_ref[...] = read(predict, last)


def _rejection_kernel(
        candidates_ref,    # i32[Tp]: token of each node
        next_token_ref,    # i32[Tp]: first child, -1 where none
        next_sibling_ref,  # i32[Tp]: next sibling, -1 where none
        uniform_ref,       # f32[Tp]: acceptance uniform of each node
        target_ref,        # f32[T, Vp]: p at each node (read one row at a time)
        draft_ref,         # f32[T, Vp]: q each node's children were drawn from
        noise_ref,         # f32[Vp]: Exp(1) noise for the final draw
        accept_ref,        # i32[Sp]: out, accepted node ids, root first, -1 padded
        length_ref,        # i32[]: out
        bonus_ref,         # i32[]: out
        *, num_steps, num_nodes):
    lanes = jnp.arange(candidates_ref.shape[0])
    vocab_lanes = jnp.arange(noise_ref.shape[0])
    candidates, next_token, next_sibling, uniform = (
        candidates_ref[...], next_token_ref[...], next_sibling_ref[...], uniform_ref[...])
    read = lambda values, i: _read(values, i, lanes, num_nodes)
    prob_of = lambda probs, token: jnp.sum(jnp.where(vocab_lanes == token, probs, 0.0), axis=0)

    def choose_among_siblings(cur, first, residual):
        q = draft_ref[cur, :]

        def try_sibling(_, carry):
            child, found, residual = carry
            active = (found < 0) & (child >= 0)
            x = read(candidates, child)
            accept = active & (read(uniform, child) * prob_of(q, x) < prob_of(residual, x))
            reject = active & ~accept
            found = jnp.where(accept, child, found)
            residual = jnp.where(reject, _normalized(jnp.maximum(residual - q, 0.0), residual), residual)
            return jnp.where(found < 0, read(next_sibling, child), -1), found, residual

        _, found, residual = lax.fori_loop(0, num_nodes, try_sibling, (first, jnp.int32(-1), residual))
        accepted_p = target_ref[jnp.maximum(found, 0), :]
        return found, jnp.where(found >= 0, _normalized(accepted_p, residual), residual)

    root_p = target_ref[0, :]
    length, _, residual = _kernel_walk(lambda cur: read(next_token, cur), choose_among_siblings,
                                       _normalized(root_p, root_p), accept_ref, num_steps=num_steps,
                                       num_nodes=num_nodes)
    score = jnp.where(residual > 0, residual / noise_ref[...], -1.0)
    length_ref[...] = length
    bonus_ref[...] = jnp.min(jnp.where(score == jnp.max(score), vocab_lanes, noise_ref.shape[0]))


def _pad_last(x, size, value):
    """x: [..., N] -> [..., size], padded with value."""
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])], constant_values=value)


def _call_walk_kernel(kernel, node_rows, extra_inputs, extra_specs, *, num_steps, interpret, num_warps=4):
    """Runs kernel over grid (B,) on node_rows [B, T] (padded here) and extra inputs; returns Verified. Its
    lowering is named (Triton, ``num_warps`` warps a sequence), not left to JAX's default: JAX 0.10 lowers a GPU
    kernel without compiler params through Mosaic GPU, which rejects these small tiles."""
    batch, num_nodes = node_rows[0].shape
    nodes_padded = pl.next_power_of_2(num_nodes)
    slots_padded = pl.next_power_of_2(num_steps + 1)
    row_spec = lambda width: pl.BlockSpec((None, width), lambda b: (b, 0))
    scalar_spec = pl.BlockSpec((None,), lambda b: (b,))
    accept_index, length, bonus = pl.pallas_call(
        functools.partial(kernel, num_steps=num_steps, num_nodes=num_nodes),
        grid=(batch,),
        in_specs=[row_spec(nodes_padded)] * len(node_rows) + extra_specs,
        out_specs=[row_spec(slots_padded), scalar_spec, scalar_spec],
        out_shape=[jax.ShapeDtypeStruct((batch, slots_padded), jnp.int32),
                   jax.ShapeDtypeStruct((batch,), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.int32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
    )(*(_pad_last(x, nodes_padded, -1) for x in node_rows), *extra_inputs)
    return Verified(accept_index[:, :num_steps + 1], length, bonus)


@functools.partial(jax.jit, static_argnames=("num_steps", "interpret"))
def _verify_tree_greedy_pallas(candidates, retrieve_next_token, retrieve_next_sibling, target_predict, *,
                               num_steps, interpret) -> Verified:
    rows = [x.astype(jnp.int32) for x in (candidates, retrieve_next_token, retrieve_next_sibling, target_predict)]
    return _call_walk_kernel(_greedy_kernel, rows, [], [], num_steps=num_steps, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("num_steps", "interpret"))
def _verify_tree_rejection_pallas(candidates, retrieve_next_token, retrieve_next_sibling, target_probs,
                                  draft_probs, accept_uniform, final_noise, *, num_steps, interpret) -> Verified:
    num_nodes, vocab = target_probs.shape[1:]
    vocab_padded = pl.next_power_of_2(vocab)
    nodes_padded = pl.next_power_of_2(num_nodes)
    rows = [x.astype(jnp.int32) for x in (candidates, retrieve_next_token, retrieve_next_sibling)]
    extra_inputs = [_pad_last(accept_uniform.astype(jnp.float32), nodes_padded, 1.0),
                    _pad_last(target_probs.astype(jnp.float32), vocab_padded, 0.0),
                    _pad_last(draft_probs.astype(jnp.float32), vocab_padded, 0.0),
                    _pad_last(final_noise.astype(jnp.float32), vocab_padded, 1.0)]
    extra_specs = [pl.BlockSpec((None, nodes_padded), lambda b: (b, 0)),
                   pl.BlockSpec((None, num_nodes, vocab_padded), lambda b: (b, 0, 0)),
                   pl.BlockSpec((None, num_nodes, vocab_padded), lambda b: (b, 0, 0)),
                   pl.BlockSpec((None, vocab_padded), lambda b: (b, 0))]
    return _call_walk_kernel(_rejection_kernel, rows, extra_inputs, extra_specs, num_steps=num_steps,
                             interpret=interpret, num_warps=8)
