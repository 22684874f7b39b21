"""What the server's paged programs (``jspec.serve.paged``) start from, every shape fixed by the setup.

- :func:`start_state`: prefilled rows of the slot engine's decode state and step inputs (``jspec.generate``'s
  prefill, each row with its own key).
- :func:`idle_slots`: the state of ``num_slots`` finished one-token rows: the shapes and kinds every leaf has (the
  paged layout is read off them).
- :func:`admit_row`: the host arrays a prefill takes for one request.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec.compile_options import setup_jit
from jspec.config import SamplingParams
from jspec.features import FeatureInputs
from jspec.generate import prefill
from jspec.generate_setup import GenerateSetup
from jspec.logits_processors import host_arrays
from jspec.sampling import SamplingArrays, seed_keys
from jspec.sharding import traced_on
from jspec.state import DecodeState
from jspec.step import StepInputs


def start_state(params_t, params_d, prompt_ids, prompt_lens, keys, max_new_tokens, stop_ids, sampling,
                processors=None, token_bitmask=None, *, setup: GenerateSetup) -> tuple[DecodeState, StepInputs]:
    """Prefilled rows of the slot engine -> (state, inputs): keys is one key per row; processors: the logits
    processors' arrays (``setup.logits_processors``) or None; token_bitmask: the first tokens' grammar masks
    (``FeatureInputs.token_bitmask``) or None."""
    inputs = StepInputs(max_new_tokens, stop_ids, sampling, keys, FeatureInputs(processors, token_bitmask))
    return prefill(params_t, params_d, prompt_ids, prompt_lens, inputs, setup=setup), inputs


@functools.partial(setup_jit, static_argnames=("setup", "num_slots", "num_stop_ids"))
def idle_slots(params_t, params_d, *, setup: GenerateSetup, num_slots: int,
               num_stop_ids: int) -> tuple[DecodeState, StepInputs]:
    """-> (state, inputs) of ``num_slots`` finished slots: each prefilled with token 0 and a budget of one token,
    so every leaf (the drafter's state included) has the shape and kind a prefill writes."""
    ones = jnp.ones((num_slots,), jnp.int32)
    sampling = SamplingArrays.full(num_slots)
    keys = jax.vmap(jax.random.key)(jnp.zeros((num_slots,), jnp.uint32))
    processors = None
    if setup.logits_processors:
        processors = jax.tree.map(jnp.asarray, host_arrays([SamplingParams()] * num_slots, [[0]] * num_slots,
                                                           num_slots, setup.target.vocab_size))
    with traced_on(setup.mesh):
        return start_state(params_t, params_d, jnp.zeros((num_slots, 1), jnp.int32), ones, keys, ones,
                            jnp.full((num_slots, num_stop_ids), -1, jnp.int32), sampling, processors, setup=setup)


def admit_row(prompt_ids: Sequence[int], params: SamplingParams, stop_ids: Sequence[int], *, width: int,
              num_stop_ids: int, vocab_size: int | None = None, prompt: Sequence[int] | None = None,
              generated_before: int = 0) -> tuple:
    """The host arrays a prefill (``paged.prefill_rows``) takes for one request: its prompt right-padded to ``width``,
    its length, the raw data of its key (``jspec.sampling.seed_keys([params.seed], 1)``: it draws as
    ``SpecEngine.generate([prompt], seed=[seed])`` does), its budget (``params.max_new_tokens``), ``stop_ids``
    (EOS included) -1 padded to ``num_stop_ids``, its sampling arrays, and with ``vocab_size`` (a server with the
    logits processors) their arrays (``prompt``: the request's own prompt, default ``prompt_ids``;
    ``generated_before``: tokens it generated that end the context prefilled now, a preempted request's), else
    None."""
    prompt_row = np.zeros((1, width), np.int32)
    prompt_row[0, :len(prompt_ids)] = prompt_ids
    stops = sorted(set(stop_ids))
    stop = np.full((1, num_stop_ids), -1, np.int32)
    stop[0, :len(stops)] = stops
    key_data = np.asarray(jax.random.key_data(seed_keys([params.seed], 1)))
    processors = None
    if vocab_size is not None:
        own = list(prompt_ids) if prompt is None else list(prompt)
        processors = host_arrays([params], [own], 1, vocab_size, [generated_before])
    return (prompt_row, np.asarray([len(prompt_ids)], np.int32), key_data,
            np.asarray([params.max_new_tokens], np.int32), stop, SamplingArrays.full(1, params), processors)
