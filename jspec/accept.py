"""Accepting a verified tree: greedy or lossless sampling (pallas_kernels.tree_verify), or a forced count.

Drafts sampled from the drafter's own distribution (``tree.draft_probs`` set) are verified by recursive
rejection sampling; deterministic drafts by per-node target draws (see pallas_kernels/tree_verify.py).

Greedy rows and sampled rows can share a batch: the sampling distribution of a greedy row is one-hot at the
argmax, so the sampling walk accepts exactly what the greedy walk would. When every row is greedy the cheaper
greedy walk runs (lax.cond on device, no recompilation).

``force_accept`` (``SpecEngine(..., force_accept=N)``, benchmarks only) accepts min(N, depth) drafts along the
first-child path whatever the target says; the bonus is still the target's argmax there. Output is then not the target's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jspec.drafters.base import DraftTree
from jspec.sampling import SamplingArrays, sampling_probs
from jspec.sharding import per_shard
from pallas_kernels.tree_verify import Verified, verify_tree_greedy, verify_tree_sampling


def forced_path(tree: DraftTree, logits: jax.Array, *, accept: int, max_depth: int) -> Verified:
    """Follows first children min(accept, depth) times -> Verified (benchmarks only)."""
    batch = tree.tokens.shape[0]
    node = jnp.zeros((batch,), jnp.int32)
    path, length = [node], jnp.zeros((batch,), jnp.int32)
    for depth in range(max_depth):
        child = jnp.take_along_axis(tree.next_token, node[:, None], axis=1)[:, 0]
        take = (child >= 0) & (depth < accept)
        node = jnp.where(take, child, node)
        length = length + take
        path.append(jnp.where(take, child, -1))
    accept_index = jnp.stack(path, axis=1)
    predict = jnp.argmax(jnp.take_along_axis(logits, node[:, None, None], axis=1)[:, 0], axis=-1)
    return Verified(accept_index, length, predict.astype(jnp.int32))


def accept_tree(tree: DraftTree, logits: jax.Array, sampling: SamplingArrays, keys: jax.Array, *,
                max_depth: int, force_accept: int | None = None, kernels: str = "auto") -> Verified:
    """tree: the drafted tree; logits: f32[B, T, V] the target's at every node; keys: key[B], row b's draws use
    keys[b] alone; kernels: the verify kernel's lowering (``pallas_kernels.impl``) -> Verified (local node ids)."""
    if force_accept is not None:
        return forced_path(tree, logits, accept=force_accept, max_depth=max_depth)

    # On a mesh each data shard walks its own rows (the Pallas kernels cannot be split by the partitioner); the
    # draws are per row, so they equal one device's.
    rows = P("data")

    def greedy(_):
        predict = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        walk = per_shard(lambda *a: verify_tree_greedy(*a, num_steps=max_depth, impl=kernels),
                         in_specs=(rows,) * 4, out_specs=rows)
        return walk(tree.tokens, tree.next_token, tree.next_sibling, predict)

    def sample(_):
        probs = sampling_probs(logits, sampling)
        walk = per_shard(lambda tokens, next_token, next_sibling, probs, draft_probs, keys: verify_tree_sampling(
            tokens, next_token, next_sibling, probs, keys, num_steps=max_depth, draft_probs=draft_probs,
            impl=kernels), in_specs=(rows,) * 6, out_specs=rows)
        return walk(tree.tokens, tree.next_token, tree.next_sibling, probs, tree.draft_probs, keys)

    return jax.lax.cond(sampling.is_greedy, greedy, sample, None)
