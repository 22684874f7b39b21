"""The target's sampling distribution: temperature, then top-k, then top-p (the order of HF and vLLM).

This is the one definition of "the target's distribution" in jspec: plain decoding draws from it and lossless
verification must reproduce it. Parameters are per-sequence arrays (changing them never recompiles):
temperature f32[B] (0 = greedy: all mass on the argmax), top_k i32[B] (0 = off), top_p f32[B] (1 = off).
Ties at the top-k threshold are kept, as in HF's TopKLogitsWarper; top-p keeps the smallest prefix of the
sorted distribution whose mass reaches top_p (at least one token).

Keys: a call's per-row keys come from its seed alone (:func:`seed_keys`, for the engine and the server alike), and
each step folds in a row's own position (:func:`keys_at`).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config import SamplingParams
from jspec.sharding import put
from pallas_kernels.tree_verify import sample_each_node


UNCAPPED_DRAFTS = 1 << 30  # a row's max_drafts when it keeps the drafter's own tree


class SamplingArrays(NamedTuple):
    """Per-sequence sampling parameters: temperature f32[B], top_k i32[B], top_p f32[B]; max_drafts i32[B] the most
    drafts a step accepts for each row (``SamplingParams.num_speculative_tokens``; None: every row the drafter's)."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    max_drafts: jax.Array | None = None

    @property
    def is_greedy(self) -> jax.Array:
        """bool[]: every sequence is greedy (lets a step skip the sort)."""
        return jnp.all(self.temperature <= 0.0)

    @classmethod
    def full(cls, rows: int, params: SamplingParams = SamplingParams()) -> "SamplingArrays":
        """Host arrays for ``rows`` rows that all sample with ``params``' temperature, top_k and top_p (the
        default: greedy) and draft at most its num_speculative_tokens."""
        cap = UNCAPPED_DRAFTS if params.num_speculative_tokens is None else params.num_speculative_tokens
        return cls(np.full((rows,), params.temperature, np.float32), np.full((rows,), params.top_k, np.int32),
                   np.full((rows,), params.top_p, np.float32), np.full((rows,), cap, np.int32))


def _per_row(value: jax.Array, logits: jax.Array) -> jax.Array:
    """value: [B] broadcast against logits: [B, ..., V]."""
    return value.reshape(value.shape + (1,) * (logits.ndim - 1))


def filtered_logits(logits: jax.Array, params: SamplingArrays) -> jax.Array:
    """logits: f32[B, ..., V] -> temperature-scaled logits with tokens outside top-k/top-p set to -inf.

    Greedy rows (temperature 0) keep only their argmax; rows with top-k and top-p off keep every token (the sort
    that top-k and top-p need runs only when some row has one on).
    """
    logits = logits.astype(jnp.float32)
    greedy = _per_row(params.temperature <= 0.0, logits)
    scaled = logits / jnp.where(greedy, 1.0, _per_row(params.temperature, logits))
    is_max = jnp.arange(logits.shape[-1]) == jnp.argmax(logits, axis=-1, keepdims=True)
    argmax_only = jnp.where(is_max, 0.0, -jnp.inf)
    unfiltered = (params.top_k <= 0) & (params.top_p >= 1.0)
    kept = jax.lax.cond(jnp.all(unfiltered), lambda: scaled,
                        lambda: jnp.where(_per_row(unfiltered, logits), scaled, _top_k_top_p(scaled, params)))
    return jnp.where(greedy, argmax_only, kept)


def _top_k_top_p(scaled: jax.Array, params: SamplingArrays) -> jax.Array:
    """Temperature-scaled logits f32[B, ..., V] with the tokens outside each row's top-k, then top-p, at -inf."""
    vocab = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(params.top_k <= 0, vocab, jnp.minimum(params.top_k, vocab))
    kth_index = jnp.broadcast_to(_per_row(k - 1, scaled), sorted_desc.shape[:-1] + (1,))
    kth = jnp.take_along_axis(sorted_desc, kth_index, axis=-1)
    sorted_desc = jnp.where(sorted_desc >= kth, sorted_desc, -jnp.inf)
    probs_desc = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs_desc, axis=-1) - probs_desc
    keep_sorted = (mass_before < _per_row(params.top_p, scaled)) & (sorted_desc > -jnp.inf)
    keep_sorted = keep_sorted.at[..., 0].set(True)
    threshold = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def sampling_probs(logits: jax.Array, params: SamplingArrays) -> jax.Array:
    """logits: f32[B, ..., V] -> probabilities f32[B, ..., V] of the target's sampling distribution."""
    return jax.nn.softmax(filtered_logits(logits, params), axis=-1)


def seed_keys(seed: int | Sequence[int], rows: int, sharding: jax.sharding.Sharding | None = None) -> jax.Array:
    """The per-row keys key[rows] of a call with ``seed`` (``SamplingParams.seed``): for one integer, row b gets
    fold_in(key(seed), b); for one seed per prompt, fold_in(key(seed[b]), 0) (padding rows: seed 0), so row b draws
    as a one-prompt call with seed[b] (or seed=seed[b]) would, and a server's request with seed s as
    ``seed_keys([s], 1)``. ``sharding``: where the rows go (split by rows on a mesh, also across processes)."""
    per_prompt = not isinstance(seed, int)
    seeds = list(seed) + [0] * (rows - len(seed)) if per_prompt else [seed] * rows
    data = np.stack([np.asarray(jax.random.key_data(jax.random.key(s))) for s in seeds])
    salts = np.zeros((rows,), np.uint32) if per_prompt else np.arange(rows, dtype=np.uint32)
    if sharding is not None:
        data, salts = put(data, sharding), put(salts, sharding)
    return _fold_keys(data, salts)


@jax.jit
def _fold_keys(key_data: jax.Array, salts: jax.Array) -> jax.Array:
    """u32[B, ...] raw keys, u32[B] -> key[B]: fold_in(key_b, salt_b) (rows stay where their data is)."""
    return jax.vmap(lambda data, salt: jax.random.fold_in(jax.random.wrap_key_data(data), salt))(key_data, salts)


def row_keys(key: jax.Array, batch: int) -> jax.Array:
    """The per-row base keys key[B] of a call: a single key gives row b ``fold_in(key, b)``; an array of B keys is
    used as it is (a caller that wants a row's tokens independent of its neighbours passes its own key per row)."""
    if jnp.ndim(key) == 0:
        return jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(batch, dtype=jnp.uint32))
    if key.shape != (batch,):
        raise ValueError(f"key.shape={key.shape}: expected one key or one per row ({batch},)")
    return key


def keys_at(keys: jax.Array, positions: jax.Array) -> jax.Array:
    """key[B] folded with each row's own position i32[B]: a row's randomness at a step depends only on its base
    key and where in its sequence it is, never on its slot or the loop's step count."""
    return jax.vmap(jax.random.fold_in)(keys, positions.astype(jnp.uint32))


def fold_rows(keys: jax.Array, data: int) -> jax.Array:
    """key[B] each folded with the same integer (independent streams for different uses at one step)."""
    return jax.vmap(lambda k: jax.random.fold_in(k, data))(keys)


def sample_tokens(logits: jax.Array, params: SamplingArrays, keys: jax.Array) -> jax.Array:
    """logits: f32[B, V], keys: key[B] -> i32[B], row b drawn with keys[b] alone; the argmax when every row is
    greedy (no sort paid).

    The draw is the verifier's own (``pallas_kernels.tree_verify.sample_each_node``: inverse CDF at the key's first
    uniform), so a row whose tree has no drafts gets the same token whether the step verifies a tree for its
    neighbours' sake or decodes its root alone."""
    def draw(_):
        probs = sampling_probs(logits, params)
        return jax.vmap(lambda key, row: sample_each_node(key, row[None])[0])(keys, probs).astype(jnp.int32)

    def argmax(_):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    return jax.lax.cond(params.is_greedy, argmax, draw, None)
