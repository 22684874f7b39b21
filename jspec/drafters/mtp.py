"""MTP drafter: the multi-token-prediction modules a target ships in its own checkpoint (models/mtp.py), drafting
chains and trees with the shared search of ``tree_search.py``. Two modes, as TensorRT-LLM names them:

- ``mtp_eagle`` (TensorRT-LLM's MTP_EAGLE, vLLM's default): module 0 applied recurrently, exactly as an EAGLE head:
  depth d + 1 is drafted by module 0 reading the depth-d node's token and the module's own output ``x`` of the
  forward that drafted that node (the target's hidden state is not known yet).
- ``vanilla`` (DeepSeek-V3's MTP as trained): module d drafts depth d + 1; each module keeps its own KV cache.

Alignment (as eagle3.py). Module 0's slot p pairs the token at position p + 1 with the target's last hidden state
(tap ``num_layers``, before the final norm) at position p, and predicts the token at p + 2. Module k's DeepSeek
slot p pairs token p + k + 1 with module k - 1's output at its slot p. Here module k's slot p lives at cache slot
and rope position p + k (the position of the token it reads, minus one), so every module shares the target's
cache_len R and positions, and a module's slot reads the same token as module 0's at that cache slot; module k's
first k cache slots (DeepSeek slots p < 0) hold nothing and its attention never reads them (``_attention_from``).
Per sequence, between steps (R = cache_len, root token R pending)::

    cache slot s:  0 ... k-1 | k ........... R-1 | window
    module 0:      (h_s, token s + 1) for every s < R; its last output predicts the root's children
    module k:      unused    | (x^{k-1}_{s-1}, token s + 1)     (x^{k-1}_{s-1}: module k-1's output at slot s - 1)

Drafting (vanilla). A depth-d node (token R + d) is read by module d at position R + d - 1 ("the parent's slot" of
its children) with hidden = the output of module d - 1 that drafted the node, writing into module d's own window
and seeing module d's committed slots and itself only: module d's slots R .. R + d - 2 (the d - 1 positions
between its committed frontier and the node, i.e. its ancestors below the root) are not in its context.
TensorRT-LLM re-runs each module over them; we do not (an approximation of the draft only: output is unchanged).
``tree_search`` calls ``forward`` once per depth, shallowest first, so the closure counts its calls to know the
depth (no change to the shared search, eagle3/draft_model untouched).

``commit`` re-runs ("extends") every module over the n committed tokens at cache slots R .. R + n - 1: the token at
local j is new_tokens[j] for every module; module 0 reads the target's true hidden states at the accepted path,
module k at local j module k - 1's output of this commit at local j - 1, and at j = 0 module k - 1's last output
of the previous commit (``MtpState.hidden[k - 1]``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jspec.config import SpecConfig
from jspec.drafters.base import CommitContext, DraftTree, DrafterSource, PrefillContext
from jspec.drafters.common import DrafterBase
from jspec.drafters.tree_search import search_tree
from jspec.sharding import param_specs, splits_evenly
from jspec.state_layout import PerRow, per_position
from models.attention import AttentionFn, KVCache, dense_attention, masked_attention, visibility_mask
from models.checkpoint import DTYPES
from models.config import ModelConfig
from models.mtp import MtpConfig, MtpModule

MTP_MODES = ("mtp_eagle", "vanilla")


class MtpState(NamedTuple):
    caches: tuple[KVCache, ...]  # one per module used: [1, B, S_draft, Hkv, D]
    logits: jax.Array            # f32[B, V] module 0's prediction for the root's children
    hidden: jax.Array            # [M, B, H] each module's output x at its last committed slot (cache slot R - 1)


def _last(x: jax.Array, count: jax.Array) -> jax.Array:
    """x: [B, N, ...] -> x[b, count[b] - 1] (row 0 when count is 0)."""
    index = jnp.clip(count - 1, 0, x.shape[1] - 1)
    return jnp.take_along_axis(x, index.reshape((-1, 1) + (1,) * (x.ndim - 2)), axis=1)[:, 0]


def _shift_right(x: jax.Array, first: jax.Array) -> jax.Array:
    """x: [B, N, H], first: [B, H] -> [B, N, H] with row j = x[:, j - 1] and row 0 = first."""
    return jnp.concatenate([first[:, None].astype(x.dtype), x[:, :-1]], axis=1)


@functools.lru_cache(maxsize=None)
def _attention_from(first_slot: int) -> AttentionFn:
    """dense_attention that never reads cache slots < first_slot (module k's first k slots hold nothing)."""
    if first_slot == 0:
        return dense_attention

    def attention(q, k_cache, v_cache, k_new, v_new, cache_len, local_mask, write_offset, *, scale):
        del k_new, v_new, write_offset  # read from the cache, wherever the model wrote them
        mask = visibility_mask(cache_len, local_mask, q.shape[1], k_cache.shape[1])
        mask = mask & (jnp.arange(k_cache.shape[1]) >= first_slot)[None, None]
        return masked_attention(q, k_cache, v_cache, mask, scale=scale)

    return attention


@dataclasses.dataclass(frozen=True)
class MtpDrafter(DrafterBase):
    """Static description of the drafter (hashable: part of the generate setup).

    params_d = {"modules": (module params, ...)} (models/mtp.py; a module may hold its own "lm_head"); the
    embedding and, by default, the lm_head are the target's (params_t). mode: "mtp_eagle" (module 0 recurrently)
    or "vanilla" (module d drafts depth d + 1; needs spec.max_depth <= mtp.num_modules). On a mesh the modules
    are replicated (one decoder layer each, small beside a dense target), but a module holding a mixture of
    experts (DeepSeek-V3's: a sparse layer of 256 experts, 11.5B parameters) is split as the target's layers are.
    """

    mtp: MtpConfig
    target: ModelConfig
    spec: SpecConfig
    max_seq_len: int
    dtype: str = "float32"
    mode: str = "mtp_eagle"

    def __post_init__(self):
        if self.mode not in MTP_MODES:
            raise ValueError(f"MtpDrafter mode={self.mode!r}: expected one of {MTP_MODES}")
        self.mtp.check_target(self.target)
        if self.mode == "vanilla" and self.spec.max_depth > self.mtp.num_modules:
            raise ValueError(f"vanilla MTP drafts depth d + 1 with module d: spec.max_depth={self.spec.max_depth} "
                             f"needs as many modules, but the checkpoint has num_modules={self.mtp.num_modules} "
                             f"(lower num_steps / the tree's depth, or use mode 'mtp_eagle')")

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return (self.target.num_layers,)  # the target's last hidden state before its final norm

    @property
    def num_used(self) -> int:
        """Modules that draft: module 0 only (mtp_eagle), else modules 0 .. max_depth - 1."""
        return 1 if self.mode == "mtp_eagle" else self.spec.max_depth

    def _run(self, params_t, params_d, index: int, cache, tokens, hidden, positions, cache_len, local_mask=None,
             write_offset=0):
        """Module ``index`` over tokens i32[B, N] -> (x [B, N, H], logits f32[B, N, V], cache)."""
        module = MtpModule(self.mtp, DTYPES[self.dtype], _attention_from(index if self.mode == "vanilla" else 0))
        params = params_d["modules"][index]
        embeds = jnp.take(params_t["embed_tokens"]["embedding"], tokens, axis=0)
        out = module.apply({"params": {k: v for k, v in params.items() if k != "lm_head"}}, embeds, hidden,
                           positions, cache, cache_len, local_mask, write_offset)
        kernel = (params.get("lm_head") or params_t["lm_head"])["kernel"]
        logits = jnp.einsum("bnh,hv->bnv", out.normed, kernel.astype(out.normed.dtype))
        return out.x, logits.astype(jnp.float32), out.cache

    def param_specs(self, params_d: Any, tensor_parallel_size: int) -> Any:
        """Replicated, but modules with experts split by the target's rules (``jspec.sharding.param_specs``) where
        they split evenly."""
        layer = self.mtp.layer
        if layer.num_experts and splits_evenly(layer, tensor_parallel_size):
            return param_specs(params_d, layer, tensor_parallel_size)
        return super().param_specs(params_d, tensor_parallel_size)

    # --- the protocol ------------------------------------------------------------------------------------------

    def state_layout(self, state: MtpState) -> MtpState:
        """Each module's K/V paged (stacked layers first, then rows and slots); the next prediction per row, and
        each module's last output ([M, B, H]: rows on axis 1)."""
        return MtpState(per_position(state.caches, "MTP K/V", self.model_cache_slots, row_axis=1, slot_axis=2),
                        PerRow(), PerRow(row_axis=1))

    def prefill(self, params_t: Any, params_d: Any, ctx: PrefillContext) -> MtpState:
        batch, width = ctx.prompt_ids.shape
        shifted = jnp.concatenate([ctx.prompt_ids[:, 1:], jnp.zeros((batch, 1), jnp.int32)], axis=1)
        shifted = shifted.at[jnp.arange(batch), ctx.prompt_lens - 1].set(ctx.first_token)
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
        cfg = self.mtp.layer
        zeros = jnp.zeros((batch,), jnp.int32)
        hidden, caches, lasts, logits = ctx.taps[0], [], [], None
        for index in range(self.num_used):
            if index > 0:  # module k's cache slot s reads module k - 1's output at slot s - 1
                hidden = _shift_right(hidden, jnp.zeros((batch, hidden.shape[-1]), hidden.dtype))
            cache = KVCache.for_model(cfg, batch, self.model_cache_slots, DTYPES[self.dtype], num_layers=1)
            hidden, out_logits, cache = self._run(params_t, params_d, index, cache, shifted, hidden, positions, zeros)
            logits = _last(out_logits, ctx.prompt_lens) if index == 0 else logits
            caches.append(cache)
            lasts.append(_last(hidden, ctx.prompt_lens))
        return MtpState(tuple(caches), logits, jnp.stack(lasts))

    def propose(self, params_t: Any, params_d: Any, state: MtpState, root: jax.Array, cache_len: jax.Array,
                *, sampling: Any = None, key: jax.Array | None = None) -> tuple[MtpState, DraftTree]:
        del sampling, key  # top-k drafts: deterministic, verified as such
        depths = itertools.count(1)  # search_tree calls forward once per depth, shallowest first
        vanilla = self.mode == "vanilla"

        def forward(caches, tokens, hidden, positions, offset, mask):
            index = next(depths) if vanilla else 0
            if vanilla:  # module d's window holds depth d's nodes only: each sees itself
                own = offset + jnp.arange(tokens.shape[1])
                mask = mask & (jnp.arange(mask.shape[-1])[None, None, :] == own[None, :, None])
            x, logits, cache = self._run(params_t, params_d, index, caches[index], tokens, hidden, positions,
                                         cache_len, mask, offset)
            return caches[:index] + (cache,) + caches[index + 1:], logits, x

        caches, tree = search_tree(forward, state.caches, root, state.logits, state.hidden[0], cache_len,
                                   spec=self.spec, static_tree=self.static_tree, to_target=lambda ids: ids)
        return state._replace(caches=caches), tree

    def commit(self, params_t: Any, params_d: Any, state: MtpState, ctx: CommitContext) -> MtpState:
        batch, width = ctx.new_tokens.shape
        path = jnp.maximum(ctx.accept_index, 0)
        hidden = jnp.take_along_axis(ctx.taps[0], path[:, :, None], axis=1)  # [B, D+1, H] target states on the path
        positions = ctx.cache_len[:, None] + jnp.arange(width, dtype=jnp.int32)[None]
        caches, lasts, logits = [], [], None
        for index in range(self.num_used):
            if index > 0:
                hidden = _shift_right(hidden, state.hidden[index - 1])
            hidden, out_logits, cache = self._run(params_t, params_d, index, state.caches[index], ctx.new_tokens,
                                                  hidden, positions, ctx.cache_len)
            logits = _last(out_logits, ctx.num_committed) if index == 0 else logits
            caches.append(cache)
            lasts.append(_last(hidden, ctx.num_committed))
        return MtpState(tuple(caches), logits, jnp.stack(lasts).astype(state.hidden.dtype))


def load(source: DrafterSource, mode: str = "mtp_eagle") -> tuple[MtpDrafter, Any]:
    """The MTP modules inside the converted target directory (``source.target_dir``/mtp/) -> (drafter,
    {"modules": (module params, ...)}); the registry's names "mtp" and "mtp_vanilla" resolve to that directory."""
    from models.checkpoint import load_mtp  # the target's mtp/ directory

    if source.target_dir is None:
        raise ValueError("the MTP drafter loads the modules inside the target directory: target_dir is None "
                         "(load the target with SpecEngine.from_pretrained(target_dir, drafter='mtp'))")
    config, params_d = load_mtp(source.target_dir, source.dtype)
    drafter = MtpDrafter(config, source.target, source.spec, source.max_seq_len, source.dtype, mode)
    return drafter, params_d


def load_vanilla(source: DrafterSource) -> tuple[MtpDrafter, Any]:
    """As :func:`load`, module d drafting depth d + 1."""
    return load(source, mode="vanilla")
