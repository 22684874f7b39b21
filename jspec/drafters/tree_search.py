"""Growing a draft tree from a drafter's distributions: static trees (chains included) and EAGLE-2 dynamic trees.

Shared by every model drafter (EAGLE-3 head, separate draft model, MTP modules): they differ only in their
``DraftForward``, one forward of the drafter over the nodes of one depth. Both searches call it once per depth,
shallowest first (the MTP drafter counts the calls to pick module d for depth d). Each node's K/V goes to the drafter's window
(models/attention.py) at its own slot, and its mask row lets it see exactly its ancestors there.

A node at depth d >= 1 holds the token at position root_pos + d; the drafter forward that reads it runs at
position root_pos + d - 1 (EAGLE pairs a token with the feature of the position before it; a draft model
simply lags: the root's own K/V is committed by the drafter's extend, see the drafter files).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jspec.drafters.base import DraftTree
from jspec.sharding import per_shard
from jspec.trees import StaticTree
from pallas_kernels.tree_build import build_dynamic_tree

# forward(carry, tokens i32[B, n], hidden [B, n, H], positions i32[B, n], window_offset int,
#         window_mask bool[B, n, W]) -> (carry, logits f32[B, n, V_draft], hidden_out [B, n, H])
DraftForward = Callable[..., tuple[Any, jax.Array, jax.Array]]
# expand(carry, logits f32[B, n, V_draft], nodes: numpy i32[n] the static tree's node ids, k) ->
#        (carry, children i32[B, n, k]): the draft ids of each node's children by rank (static trees)
Expand = Callable[[Any, jax.Array, np.ndarray, int], tuple[Any, jax.Array]]


def expand_top_k(carry: Any, logits: jax.Array, nodes: np.ndarray, k: int) -> tuple[Any, jax.Array]:
    """The default expansion: a node's children are its drafter's top-k tokens, best first."""
    del nodes
    return carry, jax.lax.top_k(logits, k)[1]


class DynamicDraft(NamedTuple):
    tokens: jax.Array          # i32[B, T] target ids; node 0 the root
    parent_list: jax.Array     # i32[B, 1 + (num_steps - 1) * topk]
    selected_index: jax.Array  # i32[B, T - 1] sorted candidate ids


def _take(x: jax.Array, index: jax.Array) -> jax.Array:
    """x: [B, N, ...], index: i32[B, M] -> [B, M, ...]."""
    return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


def draft_static_tree(forward: DraftForward, carry: Any, root_token: jax.Array, root_logits: jax.Array,
                      root_hidden: jax.Array, root_pos: jax.Array, tree: StaticTree,
                      to_target: Callable[[jax.Array], jax.Array],
                      expand: Expand = expand_top_k) -> tuple[Any, jax.Array]:
    """Fills a static tree (or chain) depth by depth -> (carry, tokens i32[B, T] in target ids).

    root_token: i32[B]; root_logits: f32[B, V_draft] (the drafter's prediction for the root's children);
    root_hidden: [B, H] (the feature to pair with them); root_pos: i32[B] the root's position; expand: how a
    node's children are chosen from its logits (top-k by default; a draft model at temperature > 0 samples).
    """
    batch = root_token.shape[0]
    k = tree.topk
    carry, root_children = expand(carry, root_logits[:, None], np.zeros((1,), np.int32), k)
    top_ids = jnp.zeros((batch, tree.num_nodes, k), jnp.int32).at[:, 0].set(root_children[:, 0])
    hidden = jnp.zeros((batch, tree.num_nodes) + root_hidden.shape[1:], root_hidden.dtype).at[:, 0].set(root_hidden)
    tokens = jnp.zeros((batch, tree.num_nodes), jnp.int32).at[:, 0].set(root_token)
    window_mask = tree.window_mask
    for depth, level in enumerate(tree.levels, start=1):
        parents, ranks = tree.parents[level], tree.rank[level]
        tokens = tokens.at[:, level].set(to_target(top_ids[:, parents, ranks]))
        if depth == tree.max_depth:
            break  # the deepest nodes have no children to draft
        positions = jnp.broadcast_to(root_pos[:, None] + depth - 1, (batch, len(level)))
        mask = jnp.broadcast_to(jnp.asarray(window_mask[level - 1]), (batch,) + window_mask[level - 1].shape)
        carry, logits, out_hidden = forward(carry, tokens[:, level], hidden[:, parents], positions,
                                            int(level[0]) - 1, mask)
        hidden = hidden.at[:, level].set(out_hidden.astype(hidden.dtype))
        carry, children = expand(carry, logits, level, k)
        top_ids = top_ids.at[:, level].set(children)
    return carry, tokens


def dynamic_window_size(topk: int, num_steps: int) -> int:
    """Window slots the dynamic search writes: topk frontier nodes at each of num_steps - 1 depths."""
    return max(1, (num_steps - 1) * topk)


def draft_dynamic_tree(forward: DraftForward, carry: Any, root_token: jax.Array, root_logits: jax.Array,
                       root_hidden: jax.Array, root_pos: jax.Array, *, topk: int, num_steps: int,
                       num_draft_tokens: int, to_target: Callable[[jax.Array], jax.Array],
                       keep_top1_chain: bool = False) -> tuple[Any, DynamicDraft]:
    """EAGLE-2: per depth keep the topk frontier nodes by cumulative log-prob and expand each by its topk
    children; finally keep the num_draft_tokens - 1 best candidates (sorted ids: parents before children).

    keep_top1_chain (``SpecConfig(selection="top1_chain")``): the drafter's top-1 chain (the root's best child,
    its best child, ... to depth num_steps) is always in the frontier, as its slot 0, and always selected; the
    other slots and the other num_draft_tokens - 1 - num_steps nodes go by cumulative log-prob as above. The
    chain's candidates are then the first of each depth's block: ids 0, topk, topk + topk^2, ...

    Candidate ids: depth 1 holds 0..topk-1 (children of the root); depth i + 1 >= 2 holds
    topk + (i - 1) topk^2 + j topk + c for child c of frontier node j. parent_list[1 + (i - 1) topk + j] is the
    candidate id of depth-i frontier node j, so candidate g grew from the root if g // topk == 0, else from
    candidate parent_list[g // topk] (SGLang's scheme; pallas_kernels.tree_build consumes it).
    """
    batch = root_token.shape[0]
    width = dynamic_window_size(topk, num_steps)
    scores, ids = jax.lax.top_k(jax.nn.log_softmax(root_logits.astype(jnp.float32)), topk)  # [B, k]
    frontier_tokens, frontier_scores = to_target(ids), scores
    frontier_hidden = jnp.broadcast_to(root_hidden[:, None], (batch, topk) + root_hidden.shape[1:])
    frontier_ids = jnp.broadcast_to(jnp.arange(topk, dtype=jnp.int32), (batch, topk))
    ancestors = jnp.zeros((batch, topk, width), bool)
    all_scores, all_tokens = [scores], [frontier_tokens]
    parent_list = [jnp.full((batch, 1), -1, jnp.int32)]
    for depth in range(1, num_steps):
        offset = (depth - 1) * topk
        rows = ancestors | (jnp.arange(width) == (offset + jnp.arange(topk))[:, None])[None]
        positions = jnp.broadcast_to(root_pos[:, None] + depth - 1, (batch, topk))
        carry, logits, out_hidden = forward(carry, frontier_tokens, frontier_hidden, positions, offset, rows)
        parent_list.append(frontier_ids)
        child_scores, child_ids = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32)), topk)
        cumulative = (frontier_scores[:, :, None] + child_scores).reshape(batch, topk * topk)
        child_tokens = to_target(child_ids).reshape(batch, topk * topk)
        all_scores.append(cumulative)
        all_tokens.append(child_tokens)
        if keep_top1_chain:  # candidate 0 of the block is child 0 of frontier slot 0: the chain goes on
            _, pick = jax.lax.top_k(cumulative.at[:, 0].set(jnp.inf), topk)
            frontier_scores = jnp.take_along_axis(cumulative, pick, axis=1)
        else:
            frontier_scores, pick = jax.lax.top_k(cumulative, topk)
        parent_slot = pick // topk
        frontier_ids = (topk + (depth - 1) * topk * topk + pick).astype(jnp.int32)
        frontier_tokens = jnp.take_along_axis(child_tokens, pick, axis=1)
        frontier_hidden = _take(out_hidden, parent_slot)
        ancestors = _take(rows, parent_slot)
    scores = jnp.concatenate(all_scores, axis=1)
    tokens = jnp.concatenate(all_tokens, axis=1)
    if keep_top1_chain:
        chain = np.concatenate([[0], topk + topk * topk * np.arange(num_steps - 1)])
        scores = scores.at[:, chain].set(jnp.inf)
    _, selected = jax.lax.top_k(scores, num_draft_tokens - 1)
    selected = jnp.sort(selected, axis=1).astype(jnp.int32)
    tree_tokens = jnp.concatenate([root_token[:, None], jnp.take_along_axis(tokens, selected, axis=1)], axis=1)
    return carry, DynamicDraft(tree_tokens, jnp.concatenate(parent_list, axis=1), selected)


def static_draft_tree(tree: StaticTree, tokens: jax.Array, cache_len: jax.Array) -> DraftTree:
    """Verification buffers of a static tree: numpy constants broadcast over the batch."""
    batch = tokens.shape[0]

    def const(x: np.ndarray) -> jax.Array:
        return jnp.broadcast_to(jnp.asarray(x), (batch,) + x.shape)

    return DraftTree(tokens, const(tree.mask), cache_len[:, None] + jnp.asarray(tree.depth)[None],
                     const(tree.next_token), const(tree.next_sibling))


def dynamic_draft_tree(draft: DynamicDraft, cache_len: jax.Array, *, topk: int, num_steps: int,
                       kernels: str = "auto") -> DraftTree:
    """Verification buffers of a dynamic tree, built on device by pallas_kernels.tree_build (``kernels``: its
    lowering, ``pallas_kernels.impl``)."""
    build = per_shard(lambda *a: build_dynamic_tree(*a, topk=topk, num_steps=num_steps, impl=kernels),
                      in_specs=(P("data"),) * 3, out_specs=P("data"))  # on a mesh: each data shard its rows
    arrays = build(draft.parent_list, draft.selected_index, cache_len)
    return DraftTree(draft.tokens, arrays.mask, arrays.positions, arrays.retrieve_next_token,
                     arrays.retrieve_next_sibling)


def search_tree(forward: DraftForward, carry: Any, root_token: jax.Array, root_logits: jax.Array,
                root_hidden: jax.Array, cache_len: jax.Array, *, spec, static_tree: StaticTree | None,
                to_target: Callable[[jax.Array], jax.Array],
                expand: Expand = expand_top_k) -> tuple[Any, DraftTree]:
    """Drafts the tree ``spec`` asks for (static trees and chains from ``static_tree``) -> (carry, DraftTree).

    ``expand`` applies to static trees only; dynamic trees always expand by top-k (deterministic drafts).
    """
    if static_tree is not None:
        carry, tokens = draft_static_tree(forward, carry, root_token, root_logits, root_hidden, cache_len,
                                          static_tree, to_target, expand)
        return carry, static_draft_tree(static_tree, tokens, cache_len)
    carry, draft = draft_dynamic_tree(forward, carry, root_token, root_logits, root_hidden, cache_len,
                                      topk=spec.topk, num_steps=spec.num_steps,
                                      num_draft_tokens=spec.num_draft_tokens, to_target=to_target,
                                      keep_top1_chain=spec.selection == "top1_chain")
    return carry, dynamic_draft_tree(draft, cache_len, topk=spec.topk, num_steps=spec.num_steps,
                                         kernels=spec.kernels)
