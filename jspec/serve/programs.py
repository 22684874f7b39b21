"""The server's jitted programs over a decode state of ``max_batch_size`` slots (every shape fixed at start-up).

- :func:`idle_slots`: the state every slot starts in (a finished one-token row per slot).
- :func:`admit`: prefill one request and write its row (K/V, drafter state, tokens, per-slot parameters and key)
  into a free slot; the slot state is donated, so the write is in place. One program per prompt-width bucket.
- :func:`run_chunk`: finish the slots named in ``cancel``, then up to ``max_steps`` steps of the loop
  ``jspec.generate`` runs (the same step functions; no second implementation), over all slots; finished and idle
  slots are frozen (``done``). One program per step kind: speculative, or plain with drafter upkeep
  (``jspec.step.root_step``).
- :func:`admit_row`: the host arrays :func:`admit` takes for one request; :func:`compile_programs`: every program
  the scheduler runs, compiled ahead (the server's warm-up).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec.compile_options import setup_jit
from jspec.config import SamplingParams
from jspec.generate import prefill, run_loop, shard_state
from jspec.generate_setup import GenerateSetup
from jspec.sampling import SamplingArrays, seed_keys
from jspec.sharding import traced_on
from jspec.state import DecodeState
from jspec.step import StepInputs


def start_state(params_t, params_d, prompt_ids, prompt_lens, keys, max_new_tokens, stop_ids, sampling, *,
                setup: GenerateSetup) -> tuple[DecodeState, StepInputs]:
    """Prefilled rows of the slot engine -> (state, inputs): keys is one key per row."""
    inputs = StepInputs(max_new_tokens, stop_ids, sampling, keys)
    return prefill(params_t, params_d, prompt_ids, prompt_lens, inputs, setup=setup), inputs


@functools.partial(setup_jit, static_argnames=("setup", "num_slots", "num_stop_ids"))
def idle_slots(params_t, params_d, *, setup: GenerateSetup, num_slots: int,
               num_stop_ids: int) -> tuple[DecodeState, StepInputs]:
    """-> (state, inputs) of ``num_slots`` finished slots: each prefilled with token 0 and a budget of one token,
    so every leaf (the drafter's state included) has the shape and kind :func:`admit` writes into."""
    ones = jnp.ones((num_slots,), jnp.int32)
    sampling = SamplingArrays.full(num_slots)
    keys = jax.vmap(jax.random.key)(jnp.zeros((num_slots,), jnp.uint32))
    with traced_on(setup.mesh):
        return start_state(params_t, params_d, jnp.zeros((num_slots, 1), jnp.int32), ones, keys, ones,
                            jnp.full((num_slots, num_stop_ids), -1, jnp.int32), sampling, setup=setup)


def _batch_axes(setup: GenerateSetup, params_t, params_d, num_stop_ids: int) -> Any:
    """The row axis of every leaf of (state, inputs), found by comparing the shapes of 1- and 2-slot states at
    trace time (the drafter's state keeps rows where it likes, e.g. behind a layer axis); None for leaves without
    rows (the loop's step counter)."""
    one, two = (jax.eval_shape(functools.partial(idle_slots, setup=setup, num_slots=n, num_stop_ids=num_stop_ids),
                               params_t, params_d) for n in (1, 2))

    def axis(a, b):
        differ = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
        return differ[0] if differ else None

    return jax.tree.map(axis, one, two)


@functools.partial(setup_jit, static_argnames=("setup",), donate_argnames=("state", "inputs"))
def admit(params_t, params_d, state: DecodeState, inputs: StepInputs, prompt_ids: jax.Array, prompt_len: jax.Array,
          key_data: jax.Array, max_new_tokens: jax.Array, stop_ids: jax.Array, sampling: SamplingArrays,
          slot: jax.Array, *, setup: GenerateSetup) -> tuple[DecodeState, StepInputs]:
    """Prefills one request and writes it into ``slot`` (the slot state is donated).

    prompt_ids: i32[1, P] right-padded (P a width bucket); prompt_len, max_new_tokens: i32[1]; key_data: u32[1, ...]
    the raw data of the request's own key; stop_ids: i32[1, K] -1 padded (K the slots' width); sampling: [1] each
    (all of them before ``slot``: :func:`admit_row`); slot: i32[] a free slot. The new row's first token is
    committed by the prefill, as in ``generate``.
    """
    num_stop_ids = inputs.stop_ids.shape[1]
    axes = _batch_axes(setup, params_t, params_d, num_stop_ids)
    with traced_on(setup.mesh):
        key = jax.random.wrap_key_data(key_data)
        row_state, row_inputs = start_state(params_t, params_d, prompt_ids, prompt_len, key, max_new_tokens,
                                             stop_ids, sampling, setup=setup)

        def write(axis, whole, row):
            if axis is None:
                return whole
            return jax.lax.dynamic_update_slice_in_dim(whole, row.astype(whole.dtype), slot, axis)

        row_state = row_state._replace(step=state.step)
        state = jax.tree.map(write, axes[0], state, row_state, is_leaf=lambda x: x is None)
        inputs = jax.tree.map(write, axes[1], inputs, row_inputs, is_leaf=lambda x: x is None)
        return shard_state(state), inputs


@functools.partial(setup_jit, static_argnames=("setup", "speculate", "rows", "seq_len"),
                   donate_argnames=("state",))
def run_chunk(params_t, params_d, state: DecodeState, inputs: StepInputs, cancel: jax.Array, max_steps: jax.Array,
              *, setup: GenerateSetup, speculate: bool = True, rows: int | None = None,
              seq_len: int | None = None) -> DecodeState:
    """Finishes the slots where ``cancel`` (bool[B]) is set, then runs at most ``max_steps`` (i32[]) steps (until
    every slot is done): speculative steps, or with ``speculate=False`` plain steps that keep the drafter current
    (``jspec.step.root_step``). Plain servers (no drafter) ignore ``speculate``.

    rows, seq_len: step only slots [0, rows) over their first ``seq_len`` token slots (the occupancy and length
    buckets: the scheduler fills the lowest free slots first, and picks seq_len >= prompt + max_tokens of every
    running slot among them), so a chunk pays for the rows and the context its requests use, as ``generate``'s
    buckets do: attention reads every slot of the cache it is given. Every leaf of (state, inputs) is cut to the
    shape the state of ``rows`` slots of ``seq_len`` tokens has (slot = position in every buffer, the drafter's
    too), stepped, and written back in place. None: all of them. A finished slot among the rows may hold a longer
    sequence; it is frozen, and its slot is rewritten whole when the next request is admitted there.
    """
    with traced_on(setup.mesh):
        state = state._replace(done=state.done | cancel)
        rows = state.done.shape[0] if rows is None else rows
        small = setup if seq_len is None else setup.with_max_seq_len(seq_len)
        shapes = jax.eval_shape(functools.partial(idle_slots, setup=small, num_slots=rows,
                                                  num_stop_ids=inputs.stop_ids.shape[1]), params_t, params_d)
        if jax.tree.map(lambda x: x.shape, shapes) == jax.tree.map(lambda x: x.shape, (state, inputs)):
            return run_loop(params_t, params_d, state, inputs, setup=setup, max_steps=max_steps,
                            speculate=speculate)

        def cut(x, like):
            return jax.lax.slice(x, (0,) * x.ndim, like.shape)

        part = run_loop(params_t, params_d, jax.tree.map(cut, state, shapes[0]),
                        jax.tree.map(cut, inputs, shapes[1]), setup=small, max_steps=max_steps,
                        speculate=speculate)

        def write_back(whole, part_leaf):
            return jax.lax.dynamic_update_slice(whole, part_leaf.astype(whole.dtype), (0,) * whole.ndim)

        return shard_state(jax.tree.map(write_back, state, part))


def admit_row(prompt_ids: Sequence[int], params: SamplingParams, stop_ids: Sequence[int], *, width: int,
              num_stop_ids: int) -> tuple:
    """The host arrays :func:`admit` takes for one request, before ``slot``: its prompt right-padded to ``width``,
    its length, the raw data of its key (``jspec.sampling.seed_keys([params.seed], 1)``: it draws as
    ``SpecEngine.generate([prompt], seed=[seed])`` does), its budget (``params.max_new_tokens``), ``stop_ids``
    (EOS included) -1 padded to ``num_stop_ids``, and its sampling arrays."""
    prompt = np.zeros((1, width), np.int32)
    prompt[0, :len(prompt_ids)] = prompt_ids
    stops = sorted(set(stop_ids))
    stop = np.full((1, num_stop_ids), -1, np.int32)
    stop[0, :len(stops)] = stops
    key_data = np.asarray(jax.random.key_data(seed_keys([params.seed], 1)))
    return (prompt, np.asarray([len(prompt_ids)], np.int32), key_data, np.asarray([params.max_new_tokens], np.int32),
            stop, SamplingArrays.full(1, params))


def compile_programs(params_t, params_d, state: DecodeState, inputs: StepInputs, admit_rows: dict[int, tuple],
                     slot: jax.Array, cancel: jax.Array, max_steps: jax.Array, *, setup: GenerateSetup,
                     step_kinds: Sequence[bool], row_buckets: Sequence[int],
                     seq_buckets: Sequence[int]) -> dict[tuple, Any]:
    """Every program the scheduler runs, compiled: ``("admit", width)`` for each width of ``admit_rows`` (width ->
    an :func:`admit_row` of that width, placed as the scheduler places them) and ``("chunk", speculate, rows,
    seq_len)`` for each step kind (``speculate``), occupancy bucket and length bucket. The other arguments are
    examples of what the scheduler passes (their shapes and placement are what is compiled for)."""
    lowered = {}
    for width, row in admit_rows.items():
        lowered["admit", width] = admit.lower(params_t, params_d, state, inputs, *row, slot, setup=setup)
    for speculate in step_kinds:
        for rows in row_buckets:
            for seq_len in seq_buckets:
                lowered["chunk", speculate, rows, seq_len] = run_chunk.lower(
                    params_t, params_d, state, inputs, cancel, max_steps, setup=setup, speculate=speculate,
                    rows=rows, seq_len=seq_len)
    return {name: program.compile() for name, program in lowered.items()}
