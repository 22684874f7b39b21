"""DFlash and DSpark drafters: the block drafter of models/dflash.py, fed by the target's hidden states, drafting a
whole block in one forward.

Per sequence, between steps (R = cache_len, the root's position)::

    target:   tokens 0 .. R-1 in its cache, root token R pending
    drafter:  cache slots 0 .. R-1 hold each committed token's context K/V (from the target's features there)

``propose`` runs one forward over the block ``[root, mask, ..., mask]`` at positions R .. R + block_size - 1 and
reads each mask slot's distribution over the token at its position. A chain takes each position's top-1; a static
tree takes at depth d the rank-r token of position d (the block's positions are drafted independently of one
another, so a node's children depend on its depth only); a dynamic tree is EAGLE-2's best-first search over
those per-position distributions (the shared ``tree_search.search_tree``, each depth's "forward" a lookup of its
slot): the tree of the most probable paths, as DDTree builds one from a block. ``commit`` appends the accepted
path's context K/V, the target's features at those nodes (root included), at positions R .. R + accepted: the
root's features exist only after the verify pass, so the token committed last (the new root) enters the context
one step later, as in z-lab's reference.

DSpark (``DFlashConfig.layout == "dspark"``): every block slot k drafts the token at R + k + 1, and its Markov head
makes draft k's logits depend on draft k - 1 (a ``lax.scan`` over the block after the one forward for a chain;
in a dynamic tree each node's children get its own token's bias): chains and dynamic trees. Its
confidence head estimates each draft's acceptance; with ``confidence_threshold`` > 0 a row's draft is cut at the
first draft below it (DeepSpec's rule): a row with none left proposes nothing (``DraftTree.drafted``; a step where
no row proposes runs the target on the roots alone), and with ``short_drafts`` a row cut to at most that many is
not ``full`` (a step where no row is full verifies only the first ``short_drafts``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config import SpecConfig
from jspec.drafters.base import CommitContext, DraftTree, DrafterSource, PrefillContext
from jspec.drafters.common import DrafterBase
from jspec.drafters.tree_search import search_tree, static_draft_tree
from jspec.state_layout import per_position
from models.attention import KVCache, pad_slots
from models.checkpoint import DTYPES, load_dflash
from models.config import ModelConfig
from models.dflash import DFlashConfig, DFlashDraft


class DFlashState(NamedTuple):
    cache: KVCache  # per layer [B, S_draft, Hkv, D]: slot p the context K/V of the committed token at position p


def target_logits(params_t: Any, target: ModelConfig, normed: jax.Array) -> jax.Array:
    """f32[..., V]: the target's lm_head (or its tied embedding) over ``normed`` [..., H]."""
    if target.tie_word_embeddings:
        kernel = params_t["embed_tokens"]["embedding"].T
    else:
        kernel = params_t["lm_head"]["kernel"]
    return jnp.einsum("...h,hv->...v", normed.astype(kernel.dtype), kernel, preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class DFlashDrafter(DrafterBase):
    """Static description of the drafter (hashable: part of the generate setup). params_d: the DFlashDraft tree.

    spec: a chain, static or dynamic tree no deeper than ``model.num_drafts`` (with a Markov head: no static
    tree). confidence_threshold, short_drafts: DSpark's truncation of a chain (module docstring; 0 and None:
    off)."""

    model: DFlashConfig
    target: ModelConfig
    spec: SpecConfig
    max_seq_len: int
    dtype: str = "float32"
    confidence_threshold: float = 0.0
    short_drafts: int | None = None

    def __post_init__(self):
        self.model.check_target(self.target)
        if self.model.markov_rank and self.spec.tree == "static":
            raise ValueError("DSpark's Markov head makes each draft depend on the one before: a chain or a dynamic "
                             "tree, not tree='static'")
        if not 0.0 <= self.confidence_threshold < 1.0:
            raise ValueError(f"confidence_threshold={self.confidence_threshold!r}: expected a number in [0, 1)")
        if self.confidence_threshold and not self.model.confidence_head:
            raise ValueError(f"confidence_threshold={self.confidence_threshold}: the drafter has no confidence head")
        if self.confidence_threshold and self.spec.tree != "chain":
            raise ValueError(f"confidence_threshold cuts a chain, not tree={self.spec.tree!r}")
        if self.short_drafts is not None and not (self.confidence_threshold and 1 <= self.short_drafts
                                                  < self.spec.num_steps):
            raise ValueError(f"short_drafts={self.short_drafts!r}: expected 1 .. num_steps - 1 = "
                             f"{self.spec.num_steps - 1} with a confidence_threshold")
        if self.spec.max_depth > self.model.num_drafts:
            raise ValueError(f"the {self.spec.tree} of depth {self.spec.max_depth} is deeper than the "
                             f"{self.model.layout} block drafts (block_size={self.model.block_size}: at most "
                             f"{self.model.num_drafts})")

    @property
    def short_chain_nodes(self) -> int | None:
        return None if self.short_drafts is None else self.short_drafts + 1

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return self.model.tap_layers(self.target)

    @property
    def model_cache_slots(self) -> int:
        """Committed slots, then the larger of the block's window (block_size slots) and a commit's (max_depth + 1)."""
        return self.max_seq_len + max(self.model.block_size, self.spec.max_depth + 1)

    def _draft(self) -> DFlashDraft:
        return DFlashDraft(self.model, DTYPES[self.dtype])

    @staticmethod
    def _features(taps: jax.Array) -> jax.Array:
        """[n_ctx, B, N, H] -> [B, N, n_ctx * H] in target_layer_ids order."""
        return jnp.concatenate(list(taps), axis=-1)

    def _context(self, params_d, cache, taps, positions, start):
        return self._draft().apply({"params": params_d}, self._features(taps), positions, cache, start,
                                   method=DFlashDraft.context)

    def _empty_cache(self, batch: int, slots: int) -> KVCache:
        cfg = self.model.layer
        return KVCache.zeros(cfg.num_layers, batch, slots, cfg.num_kv_heads, cfg.head_dim, DTYPES[self.dtype],
                             per_layer=True)

    # --- the protocol ------------------------------------------------------------------------------------------

    def state_layout(self, state: DFlashState) -> DFlashState:
        """The drafter's context K/V paged."""
        return DFlashState(per_position(state.cache, "DFlash K/V", self.model_cache_slots))

    def prefill(self, params_t: Any, params_d: Any, ctx: PrefillContext) -> DFlashState:
        del params_t
        batch, width = ctx.prompt_ids.shape
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
        cache = self._context(params_d, self._empty_cache(batch, width), ctx.taps, positions,
                              jnp.zeros((batch,), jnp.int32))
        return DFlashState(pad_slots(cache, self.model_cache_slots))

    @property
    def caches_prefix(self) -> bool:
        return True

    def prefill_cached(self, params_t: Any, params_d: Any, state: DFlashState, ctx: PrefillContext,
                       cached_lens: jax.Array) -> DFlashState:
        """The context of positions cached_lens[b] on, over the cached slots (``DrafterBase.prefill_cached``)."""
        del params_t
        width = ctx.taps.shape[2]
        positions = cached_lens[:, None] + jnp.arange(width, dtype=jnp.int32)[None]
        return DFlashState(self._context(params_d, state.cache, ctx.taps, positions, cached_lens))

    def block_outputs(self, params_t: Any, params_d: Any, state: DFlashState, root: jax.Array,
                      cache_len: jax.Array) -> tuple[KVCache, jax.Array, jax.Array]:
        """The block's forward: (the cache, its window written; the outputs of the spec's D = max_depth draft slots
        [B, D, H]; their logits f32[B, D, V] before any Markov bias): slot i's is the token at cache_len + 1 + i
        (the lm_head runs on the slots the tree reads only)."""
        batch, size = root.shape[0], self.model.block_size
        tokens = jnp.concatenate([root[:, None], jnp.full((batch, size - 1), self.model.mask_token_id, jnp.int32)],
                                 axis=1)
        embeds = jnp.take(params_t["embed_tokens"]["embedding"], tokens, axis=0)
        positions = cache_len[:, None] + jnp.arange(size, dtype=jnp.int32)[None]
        normed, cache = self._draft().apply({"params": params_d}, embeds, positions, state.cache, cache_len)
        first = self.model.first_draft_slot
        normed = normed[:, first:first + self.spec.max_depth]
        return cache, normed, target_logits(params_t, self.target, normed)

    def _markov_chain(self, params_d, normed, logits, root):
        """DSpark's chain: draft k = argmax(logits_k + bias(draft k - 1)), draft -1 = the root -> (i32[B, n]
        drafts, f32[B, n] confidence logits, zeros without a confidence head), n = spec.num_steps."""
        draft = self._draft()

        def step(previous, slot):
            h, base = slot
            bias = draft.apply({"params": params_d}, previous, method=DFlashDraft.markov_bias)
            token = jnp.argmax(base + bias, axis=-1).astype(jnp.int32)
            confidence = (draft.apply({"params": params_d}, h, previous, method=DFlashDraft.confidence)
                          if self.model.confidence_head else jnp.zeros(previous.shape, jnp.float32))
            return token, (token, confidence)

        slots = (jnp.swapaxes(normed, 0, 1), jnp.swapaxes(logits, 0, 1))
        _, (tokens, confidence) = jax.lax.scan(step, root, slots)
        return tokens.T, confidence.T

    def _best_first_tree(self, params_d, logits, root, cache_len) -> DraftTree:
        """EAGLE-2's dynamic tree over the block's per-position distributions: a depth-d node's children are drawn
        from slot d's logits (plus, for DSpark, its own token's Markov bias), so the search needs no forward."""
        batch = root.shape[0]
        rows = jnp.arange(batch)[:, None]

        def markov(tokens):
            if not self.model.markov_rank:
                return 0.0
            return self._draft().apply({"params": params_d}, tokens, method=DFlashDraft.markov_bias)

        def forward(carry, tokens, hidden, positions, offset, mask):
            slot = positions - cache_len[:, None] + 1  # search_tree runs a depth-d node at the root's position + d - 1
            return carry, logits[rows, slot] + markov(tokens), hidden

        _, tree = search_tree(forward, (), root, logits[:, 0] + markov(root), jnp.zeros((batch, 1), jnp.float32),
                              cache_len, spec=self.spec, static_tree=None, to_target=lambda ids: ids)
        return tree

    def propose(self, params_t: Any, params_d: Any, state: DFlashState, root: jax.Array, cache_len: jax.Array,
                *, sampling: Any = None, key: jax.Array | None = None) -> tuple[DFlashState, DraftTree]:
        del sampling, key  # top-k drafts: deterministic, verified as such
        cache, normed, logits = self.block_outputs(params_t, params_d, state, root, cache_len)
        if self.model.layout == "dspark" and self.spec.tree == "chain":
            nodes, confidence = self._markov_chain(params_d, normed, logits, root)
            tree = static_draft_tree(self.static_tree, jnp.concatenate([root[:, None], nodes], axis=1), cache_len)
            if self.confidence_threshold:
                below = jax.nn.sigmoid(confidence) < self.confidence_threshold
                count = jnp.where(jnp.any(below, axis=1), jnp.argmax(below, axis=1), nodes.shape[1])
                tree = tree._replace(drafted=count >= 1,
                                     full=None if self.short_drafts is None else count > self.short_drafts)
            return state._replace(cache=cache), tree
        if self.spec.tree == "dynamic":
            return state._replace(cache=cache), self._best_first_tree(params_d, logits, root, cache_len)
        tree = self.static_tree
        depth, rank = tree.depth[1:] - 1, tree.rank[1:]  # per non-root node: its block position and rank there
        top = jax.lax.top_k(logits, tree.topk)[1]  # [B, depth, k]
        nodes = top[:, np.asarray(depth), np.asarray(rank)]
        tokens = jnp.concatenate([root[:, None], nodes.astype(jnp.int32)], axis=1)
        return state._replace(cache=cache), static_draft_tree(tree, tokens, cache_len)

    def commit(self, params_t: Any, params_d: Any, state: DFlashState, ctx: CommitContext) -> DFlashState:
        del params_t
        width = ctx.accept_index.shape[1]
        path = jnp.maximum(ctx.accept_index, 0)
        taps = jnp.take_along_axis(ctx.taps, path[None, :, :, None], axis=2)  # [n_ctx, B, D + 1, H]
        positions = ctx.cache_len[:, None] + jnp.arange(width, dtype=jnp.int32)[None]
        return DFlashState(self._context(params_d, state.cache, taps, positions, ctx.cache_len))


def default_spec(path: str | None) -> SpecConfig:
    """The whole block as a chain: block_size - 1 drafts per step."""
    from models.checkpoint import read_hf_config
    from models.dflash import dflash_config_from_hf

    return SpecConfig(tree="chain", num_steps=dflash_config_from_hf(read_hf_config(path)).num_drafts)


def load(source: DrafterSource) -> tuple[DFlashDrafter, Any]:
    """A converted DFlash directory -> (drafter, params)."""
    config, params, _ = load_dflash(source.path, source.dtype)
    return DFlashDrafter(config, source.target, source.spec, source.max_seq_len, source.dtype), params
