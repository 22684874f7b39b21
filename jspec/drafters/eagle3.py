"""EAGLE-3 drafter: the head of models/eagle3.py, fed by the target's hidden states, drafting chains and trees.

Alignment (as in EAGLE and SGLang): the head's slot p pairs the token at position p + 1 with the target's
feature at position p, and predicts the token at p + 2. Per sequence, between steps::

    target:  tokens 0 .. R-1 in its cache, root token R pending          (R = cache_len)
    head:    slots 0 .. R-1 hold pairs (token p + 1, feature p); its last output predicts the root's children

Drafting (``propose``) runs the head on the tree's nodes depth by depth in its window, pairing each node with
the head's own pre-norm output of the forward that drafted it (the target's feature is not known yet).
``commit`` then re-runs the head over the committed tokens with the target's true features at the accepted
path (the "extend"): pairs (accepted token i, feature of path node i - 1), overwriting the window.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jspec.config import SpecConfig
from jspec.drafters.base import CommitContext, DraftTree, DrafterSource, PrefillContext
from jspec.drafters.common import DrafterBase
from jspec.drafters.tree_search import search_tree
from jspec.sharding import param_specs, replicated_specs, splits_evenly
from jspec.state_layout import PerRow, per_position
from models.attention import KVCache, pad_slots, recent_attention
from models.checkpoint import DTYPES, load_eagle3
from models.config import ModelConfig
from models.eagle3 import Eagle3Config, Eagle3Head


class Eagle3State(NamedTuple):
    cache: KVCache      # the head's K/V: [1, B, S_draft, Hkv, D]
    logits: jax.Array   # f32[B, V_draft] the head's prediction for the root's children
    hidden: jax.Array   # [B, H] its pre-norm output there: the feature paired with those children


def _last_row(count: jax.Array, width: int) -> jax.Array:
    """i32[B]: the row of the count[b]-th (last) of ``width`` rows (row 0 when count is 0)."""
    return jnp.clip(count - 1, 0, width - 1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Eagle3Drafter(DrafterBase):
    """Static description of the drafter (hashable: part of the generate setup).

    params_d = {"head": head params, "d2t": i32[V_draft]} (target id = d + d2t[d]). attention_span: the head reads
    only its last ``attention_span`` committed slots (and its window), at a cost that does not grow with the
    sequence (``models.attention.recent_attention``); None: all of them, as trained.
    """

    head: Eagle3Config
    target: ModelConfig
    spec: SpecConfig
    max_seq_len: int
    dtype: str = "float32"
    attention_span: int | None = None

    def __post_init__(self):
        self.head.check_target(self.target)
        if self.attention_span is not None and self.attention_span < 1:
            raise ValueError(f"attention_span={self.attention_span}: expected a positive number of slots, or None")

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return self.head.target_taps(self.target)

    def _model(self) -> Eagle3Head:
        if self.attention_span is None:
            return Eagle3Head(self.head, DTYPES[self.dtype])
        return Eagle3Head(self.head, DTYPES[self.dtype], recent_attention(self.attention_span))

    def _embed(self, params_t: Any, tokens: jax.Array) -> jax.Array:
        """The target's input embeddings of tokens, as its ``embed_tokens`` module gives them (Gemma-3 scales)."""
        embeds = jnp.take(params_t["embed_tokens"]["embedding"], tokens, axis=0)
        if self.target.embedding_multiplier != 1.0:
            embeds = embeds * jnp.asarray(self.target.embedding_multiplier, embeds.dtype)
        return embeds

    @staticmethod
    def _features(taps: jax.Array) -> jax.Array:
        """[3, B, N, H] -> [B, N, 3H] in tap order (the head's taps, by default layers 2, L//2, L-3)."""
        return jnp.concatenate(list(taps), axis=-1)

    def _run(self, params_t, params_d, cache, tokens, hidden, positions, cache_len, local_mask=None,
             write_offset=0, output_at=None):
        return self._model().apply({"params": params_d["head"]}, self._embed(params_t, tokens), hidden, positions,
                                   cache, cache_len, local_mask, write_offset, output_at)

    def param_specs(self, params_d: Any, tensor_parallel_size: int) -> Any:
        """Split like the target (fc by input) when the head's heads, KV heads and MLP divide by tp; see
        ``jspec.sharding`` for the cost. d2t stays whole."""
        if not splits_evenly(self.head.layer, tensor_parallel_size):
            return replicated_specs(params_d)
        return {"head": param_specs(params_d["head"], self.head.layer, tensor_parallel_size),
                "d2t": replicated_specs(params_d["d2t"])}

    # --- the protocol ------------------------------------------------------------------------------------------

    def state_layout(self, state: Eagle3State) -> Eagle3State:
        """The head's K/V paged (stacked layers first, then rows and slots); its next prediction per row."""
        return Eagle3State(per_position(state.cache, "EAGLE-3 K/V", self.model_cache_slots, row_axis=1, slot_axis=2),
                           PerRow(), PerRow())

    def prefill(self, params_t: Any, params_d: Any, ctx: PrefillContext) -> Eagle3State:
        batch, width = ctx.prompt_ids.shape
        rows = jnp.arange(batch)
        shifted = jnp.concatenate([ctx.prompt_ids[:, 1:], jnp.zeros((batch, 1), jnp.int32)], axis=1)
        shifted = shifted.at[rows, ctx.prompt_lens - 1].set(ctx.first_token)
        cfg = self.head.layer
        # On a cache of the prompt's width, padded after (as the target's prefill: jspec.generate.prefill).
        cache = KVCache.zeros(1, batch, width, cfg.num_kv_heads, cfg.head_dim, DTYPES[self.dtype])
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
        out = self._run(params_t, params_d, cache, shifted, self._features(ctx.taps), positions,
                        jnp.zeros((batch,), jnp.int32), output_at=_last_row(ctx.prompt_lens, width))
        return Eagle3State(pad_slots(out.cache, self.model_cache_slots), out.logits[:, 0], out.hidden[:, 0])

    @property
    def caches_prefix(self) -> bool:
        return True

    def prefill_cached(self, params_t: Any, params_d: Any, state: Eagle3State, ctx: PrefillContext,
                       cached_lens: jax.Array) -> Eagle3State:
        """Slots from cached_lens[b] on, as :meth:`prefill` writes them, over the cached ones in ``state.cache``
        (``DrafterBase.prefill_cached`` has the shapes). Slot cached_lens[b] - 1 pairs its feature with the token
        at cached_lens[b]: the server reuses a page only when the next page matched too
        (``BlockManager.allocate(drop_last_hit=True)``)."""
        batch, width = ctx.taps.shape[1:3]
        positions = cached_lens[:, None] + jnp.arange(width, dtype=jnp.int32)[None]
        buffer = ctx.prompt_ids
        following = jnp.take_along_axis(buffer, jnp.minimum(positions + 1, buffer.shape[1] - 1), axis=1)
        following = jnp.where(positions + 1 == ctx.prompt_lens[:, None], ctx.first_token[:, None], following)
        out = self._run(params_t, params_d, state.cache, following, self._features(ctx.taps), positions,
                        cached_lens, output_at=_last_row(ctx.prompt_lens - cached_lens, width))
        return Eagle3State(out.cache, out.logits[:, 0], out.hidden[:, 0])

    def propose(self, params_t: Any, params_d: Any, state: Eagle3State, root: jax.Array, cache_len: jax.Array,
                *, sampling: Any = None, key: jax.Array | None = None) -> tuple[Eagle3State, DraftTree]:
        del sampling, key  # top-k drafts: deterministic, verified as such
        def forward(cache, tokens, hidden, positions, offset, mask):
            out = self._run(params_t, params_d, cache, tokens, hidden, positions, cache_len, mask, offset)
            return out.cache, out.logits, out.hidden

        d2t = params_d["d2t"]
        cache, tree = search_tree(forward, state.cache, root, state.logits, state.hidden, cache_len,
                                  spec=self.spec, static_tree=self.static_tree,
                                  to_target=lambda ids: ids + jnp.take(d2t, ids))
        return state._replace(cache=cache), tree

    def commit(self, params_t: Any, params_d: Any, state: Eagle3State, ctx: CommitContext) -> Eagle3State:
        batch, width = ctx.new_tokens.shape
        path = jnp.maximum(ctx.accept_index, 0)
        features = jnp.take_along_axis(self._features(ctx.taps), path[:, :, None], axis=1)  # [B, D+1, 3H]
        positions = ctx.cache_len[:, None] + jnp.arange(width, dtype=jnp.int32)[None]
        out = self._run(params_t, params_d, state.cache, ctx.new_tokens, features, positions, ctx.cache_len,
                        output_at=_last_row(ctx.num_committed, width))  # only the last committed row is kept
        return Eagle3State(out.cache, out.logits[:, 0], out.hidden[:, 0])


def load(source: DrafterSource) -> tuple[Eagle3Drafter, Any]:
    """A converted EAGLE-3 head directory -> (drafter, {"head": params, "d2t": i32[V_draft]})."""
    head_config, head_params, d2t, _ = load_eagle3(source.path, source.dtype)
    drafter = Eagle3Drafter(head_config, source.target, source.spec, source.max_seq_len, source.dtype)
    return drafter, {"head": head_params, "d2t": d2t}
