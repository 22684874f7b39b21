"""A separate draft model: any Llama-family checkpoint sharing the target's vocabulary, inside the same program.

TensorRT-LLM calls this the "external drafter, one model" mode; here the draft model is a second
``models.llama.LlamaModel`` with its own KV cache, run by the same jitted step as the target.

Alignment. The draft model runs one position ahead of the target: it has already read the root. Per sequence,
between steps (R = cache_len, the root's position)::

    target:  slots 0 .. R-1 committed, root token R pending (its logits are the verify pass's job)
    draft:   slots 0 .. R   committed (root included); state.logits = its prediction for the root's children
             slot:  0 ......... R | R+1 ............ R+W | ...
                    committed      | window (tree nodes) | garbage

Drafting (``propose``) grows the tree with the shared search of ``tree_search.py``: a node at depth d holds the
token at position R + d, and the forward that reads it (to draft its children) runs at position R + d with
the draft's committed length R + 1, writing into the window. ``commit`` then runs the draft model over the
step's committed tokens (accepted drafts, then the bonus) at slots R+1 .. (an "extend" that overwrites the
window, so no drafting K/V survives), and keeps the logits at the last committed one: the new root's children.
Prefill reads the prompt and the first generated token (the first root) in one causal pass.

Drafts. Top-k trees (``tree_search.expand_top_k``) for greedy requests and for dynamic trees: deterministic
drafts, verified as such. For static trees and chains at temperature > 0, each node's children are i.i.d. draws
from q, the draft model's distribution after the request's temperature/top-k/top-p (``jspec.sampling``);
``DraftTree.draft_probs[b, i]`` holds q at node i and verification runs recursive rejection sampling (a chain:
standard speculative sampling; Leviathan et al. 2023, SpecInfer). Greedy rows of a mixed batch keep top-k drafts
and report a uniform q, under which the rejection walk accepts exactly the target's argmax.
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
from jspec.tokenizer import load_tokenizer
from jspec.drafters.tree_search import expand_top_k, search_tree
from jspec.sampling import SamplingArrays, sampling_probs
from jspec.state_layout import PerRow, per_position
from models.attention import KVCache
from models.checkpoint import DTYPES, load_llama
from models.config import ModelConfig
from models.llama import LlamaModel, unstack_layers, unstack_layers_jit


class DraftModelState(NamedTuple):
    cache: KVCache     # the draft model's K/V, per layer [B, S_draft, Hkv, D]; slots 0..R committed
    logits: jax.Array  # f32[B, V] its prediction for the root's children


def check_same_vocab(draft: ModelConfig, target: ModelConfig) -> None:
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model's vocab_size={draft.vocab_size} differs from the target's "
                         f"vocab_size={target.vocab_size}: a draft model must share the target's tokenizer")


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter(DrafterBase):
    """Static description of the drafter (hashable: part of the generate setup). params_d: the draft model's
    LlamaModel params."""

    draft: ModelConfig
    target: ModelConfig
    spec: SpecConfig
    max_seq_len: int
    dtype: str = "float32"

    def __post_init__(self):
        check_same_vocab(self.draft, self.target)

    def _model(self) -> LlamaModel:
        """Unrolled over per-layer params and cache, as the target is (see models.llama.unstack_layers)."""
        return LlamaModel(self.draft, DTYPES[self.dtype], scan_layers=False)

    def _params(self, params_d: Any) -> dict:
        """The inference layout (a no-op when the engine already unstacked them, as ``load_drafter`` does)."""
        return {"params": unstack_layers(params_d, self.draft)}

    # --- the protocol ------------------------------------------------------------------------------------------

    def state_layout(self, state: DraftModelState) -> DraftModelState:
        """The draft model's K/V paged; its next prediction per row."""
        return DraftModelState(per_position(state.cache, "draft model K/V", self.model_cache_slots), PerRow())

    def prefill(self, params_t: Any, params_d: Any, ctx: PrefillContext) -> DraftModelState:
        del params_t
        batch, width = ctx.prompt_ids.shape
        tokens = jnp.concatenate([ctx.prompt_ids, jnp.zeros((batch, 1), jnp.int32)], axis=1)
        tokens = tokens.at[jnp.arange(batch), ctx.prompt_lens].set(ctx.first_token)  # the first root
        positions = jnp.broadcast_to(jnp.arange(width + 1, dtype=jnp.int32), (batch, width + 1))
        cfg = self.draft
        cache = KVCache.for_model(cfg, batch, self.model_cache_slots, DTYPES[self.dtype], per_layer=True)
        out = self._model().apply(self._params(params_d), tokens, positions, cache, jnp.zeros((batch,), jnp.int32),
                                  logits_index=ctx.prompt_lens[:, None])
        return DraftModelState(out.cache, out.logits[:, 0])

    def propose(self, params_t: Any, params_d: Any, state: DraftModelState, root: jax.Array, cache_len: jax.Array,
                *, sampling: SamplingArrays | None = None,
                key: jax.Array | None = None) -> tuple[DraftModelState, DraftTree]:
        del params_t
        model, committed = self._model(), cache_len + 1  # the draft has read the root already
        variables = self._params(params_d)

        def forward(carry, tokens, hidden, positions, offset, mask):
            # tree_search runs depth-d nodes at root position + d - 1 (EAGLE's lag); this model has no lag
            out = model.apply(variables, tokens, positions + 1, carry[0], committed, local_mask=mask,
                              write_offset=offset)
            return (out.cache,) + carry[1:], out.logits, hidden

        batch, tree = root.shape[0], self.static_tree
        no_hidden = jnp.zeros((batch, 1), jnp.float32)  # a draft model pairs its tokens with no feature
        sample = sampling is not None and key is not None and tree is not None
        if not sample:
            (cache,), draft = search_tree(forward, (state.cache,), root, state.logits, no_hidden, cache_len,
                                          spec=self.spec, static_tree=tree, to_target=lambda ids: ids)
            return state._replace(cache=cache), draft
        vocab = self.draft.vocab_size
        uniform = jnp.full((batch, tree.num_nodes, vocab), 1.0 / vocab, jnp.float32)
        (cache, _, draft_probs), draft = search_tree(
            forward, (state.cache, key, uniform), root, state.logits, no_hidden, cache_len, spec=self.spec,
            static_tree=tree, to_target=lambda ids: ids, expand=_sampled_expand(sampling))
        return state._replace(cache=cache), draft._replace(draft_probs=draft_probs)

    def commit(self, params_t: Any, params_d: Any, state: DraftModelState, ctx: CommitContext) -> DraftModelState:
        del params_t
        batch, width = ctx.new_tokens.shape
        positions = ctx.cache_len[:, None] + 1 + jnp.arange(width, dtype=jnp.int32)[None]
        last = jnp.maximum(ctx.num_committed - 1, 0)[:, None]
        out = self._model().apply(self._params(params_d), ctx.new_tokens, positions, state.cache, ctx.cache_len + 1,
                                  logits_index=last)
        return DraftModelState(out.cache, out.logits[:, 0])


def _sampled_expand(sampling: SamplingArrays):
    """tree_search expansion drawing each node's k children i.i.d. from q; records q in the carry.

    carry = (cache, key[B] one per row, draft_probs f32[B, T, V]). Rows at temperature 0 take the top-k and record a
    uniform q (the rejection walk then accepts exactly the target's argmax); when every row is greedy nothing is
    drawn.
    """
    def expand(carry, logits: jax.Array, nodes: np.ndarray, k: int):
        cache, key, draft_probs = carry
        vocab = logits.shape[-1]
        top = expand_top_k(None, logits, nodes, k)[1]                   # [B, n, k]
        uniform = jnp.full(logits.shape, 1.0 / vocab, jnp.float32)

        def draw(_):
            q = sampling_probs(logits, sampling)                          # [B, n, V]
            node_keys = jax.vmap(lambda row_key: jax.random.fold_in(row_key, int(nodes[0])))(key)  # per row
            draws = jax.vmap(lambda row_key, row_q: jax.random.categorical(
                row_key, jnp.log(row_q), axis=-1, shape=(k,) + row_q.shape[:-1]), out_axes=1)(node_keys, q)
            # draws: [k, B, n]
            sampled = (sampling.temperature > 0.0)[:, None, None]
            return (jnp.where(sampled, jnp.moveaxis(draws, 0, -1), top).astype(jnp.int32),
                    jnp.where(sampled, q, uniform))

        children, q_rows = jax.lax.cond(sampling.is_greedy, lambda _: (top, uniform), draw, None)
        return (cache, key, draft_probs.at[:, nodes].set(q_rows)), children

    return expand


def load(source: DrafterSource, drafter_class: type = DraftModelDrafter,
         **fields: Any) -> tuple[DraftModelDrafter, Any]:
    """A converted Llama-family directory with the target's vocabulary -> (drafter, per-layer params): a
    ``drafter_class`` (a PARD draft's is ``jspec.drafters.pard.PardDrafter``, with its ``fields``)."""
    draft_config, draft_params, _ = load_llama(source.path, source.dtype)
    check_same_vocab(draft_config, source.target)
    draft_config.check_max_seq_len(source.max_seq_len)  # here, not per setup: a program's buffers may run longer
    if source.target_dir is not None:
        check_same_tokenizer(source.path, source.target_dir)
    drafter = drafter_class(draft_config, source.target, source.spec, source.max_seq_len, source.dtype, **fields)
    return drafter, unstack_layers_jit(draft_params, config=draft_config)


def check_same_tokenizer(drafter_dir: str, target_dir: str) -> None:
    """Refuses a draft model whose tokenizer.json maps tokens differently from the target's (when both ship one)."""
    draft, target = load_tokenizer(drafter_dir), load_tokenizer(target_dir)
    if draft is not None and target is not None and draft.get_vocab() != target.get_vocab():
        raise ValueError(f"the draft model's tokenizer ({drafter_dir!r}) differs from the target's "
                         f"({target_dir!r}): speculative decoding needs one vocabulary")
