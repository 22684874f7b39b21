"""DFlash block drafter (z-lab, "DFlash: Block Diffusion for Flash Speculative Decoding"): a few Qwen3 decoder
layers that fill a block of mask tokens in one forward, conditioned on the target's hidden states, numerics as
z-lab's ``DFlashDraftModel`` and SGLang's / vLLM's ports; and DSpark (deepseek-ai/DeepSpec's
``Qwen3DSparkModel``): the same backbone with a Markov head and a confidence head.

Per sequence, between steps::

    context   ctx = hidden_norm(fc(concat(h[l] for l in target_layer_ids)))   one row per committed token
              (h[l] = the output of target layer l, HF ``hidden_states[l + 1]``; fc: n_ctx * H_target -> H)
              each draft layer's own k_proj / v_proj of ctx (k_norm, RoPE at the token's position): its cache
    block     [bonus, mask, ..., mask] (block_size tokens, the target's embedding) at positions R .. R + bs - 1
              (R = the bonus token's position); each layer: queries from the block, keys and values = the
              cached context (< R) then the block's own, all visible (no causal mask inside the block)
    drafts    z-lab's layout: lm_head(norm(x))[1:]: block slot j predicts the token at R + j (slot 0 unread);
              DSpark's: every slot k predicts the token at R + k + 1 (block_size drafts), and a Markov head adds
              a rank-r bias from the token before: logits_k = lm_head(h_k) + markov_w2(markov_w1[x_{k-1}])
              (x_{-1} = the bonus, x_k = slot k's draft: a scan over the block), and a confidence head
              c_k = proj([h_k; markov_w1[x_{k-1}]]) estimates whether draft k is accepted (sigmoid)

The context rows are not layer-normed before k_proj / v_proj (they do not pass through ``input_layernorm``), and
every layer reads the same projected ctx. The embedding and lm_head are the target's (the checkpoint has
neither); the caller passes embedded tokens and applies the lm_head.

Parameter tree (HF names; Dense kernels are HF weights transposed, [in, out])::

    fc/kernel                            [n_ctx * H_target, H]
    hidden_norm/weight                   [H]
    layers_i/input_layernorm/weight      [H]
    layers_i/self_attn/{q,k,v,o}_proj/kernel (+bias)
    layers_i/self_attn/{q,k}_norm/weight [D]
    layers_i/post_attention_layernorm/weight
    layers_i/mlp/{gate,up,down}_proj/kernel
    norm/weight                          [H]
    markov_head/markov_w1/embedding      [V, r]           (DSpark)
    markov_head/markov_w2/kernel         [r, V]           (DSpark)
    confidence_head/proj/kernel, bias    [H (+ r), 1], [1]  (DSpark)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.attention import AttentionFn, KVCache, dense_attention, write_new_tokens
from models.config import ModelConfig, from_hf_config
from models.dense import Dense
from models.llama import MLP, RMSNorm, apply_rope, rope_cos_sin
from models.random_params import cached_shapes, random_params

DFLASH_ARCHITECTURES = ("DFlashDraftModel",)
DSPARK_ARCHITECTURES = ("Qwen3DSparkModel",)
LAYOUTS = ("dflash", "dspark")
# Options other ports add that change the network (vLLM's, SpecForge's): refused unless absent or at the value that
# means z-lab's model.
REFUSED_UNLESS: dict[str, tuple] = {"use_swa": (None, False), "causal": (None, False), "is_causal": (None, False),
                                    "attention_sink_bias": (None, False), "projector_type": (None, "linear")}


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    """layer: the draft decoder's shapes (num_layers = draft layers; vocab_size = the target's, whose embedding and
    lm_head it uses); block_size: tokens per block (the bonus and block_size - 1 masks: block_size - 1 drafts);
    mask_token_id: the mask token's id in the target's vocabulary; target_layer_ids: the target layers whose
    outputs fc reads, in its order (HF ``hidden_states[id + 1]``; -1: the embedding's, DSpark); target_hidden_size:
    H of the target. layout: "dflash" (z-lab: slot j predicts the token at R + j, block_size - 1 drafts) or
    "dspark" (DeepSpec: slot k predicts R + k + 1, block_size drafts); markov_rank: r of DSpark's Markov head (0:
    none); confidence_head: DSpark's confidence head, reading the Markov embedding too with
    confidence_with_markov."""

    layer: ModelConfig
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    target_hidden_size: int
    layout: str = "dflash"
    markov_rank: int = 0
    confidence_head: bool = False
    confidence_with_markov: bool = False

    def __post_init__(self):
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise ValueError(f"DFlash block_size={self.block_size!r}: expected an integer >= 2 (the bonus token "
                             f"and at least one mask)")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r}: expected one of {LAYOUTS}")
        lowest = -1 if self.layout == "dspark" else 0  # DSpark's -1: the embedding output
        if not self.target_layer_ids or any(not isinstance(i, int) or i < lowest for i in self.target_layer_ids):
            raise ValueError(f"{self.layout} target_layer_ids={list(self.target_layer_ids)!r}: expected one or more "
                             f"layer indices >= {lowest}")
        if not isinstance(self.markov_rank, int) or self.markov_rank < 0:
            raise ValueError(f"markov_rank={self.markov_rank!r}: expected an integer >= 0")
        if self.confidence_with_markov and not (self.confidence_head and self.markov_rank):
            raise ValueError("confidence_with_markov needs a confidence head and a Markov head (markov_rank > 0)")
        if not 0 <= self.mask_token_id < self.layer.vocab_size:
            raise ValueError(f"DFlash mask_token_id={self.mask_token_id}: expected an id below vocab_size="
                             f"{self.layer.vocab_size}")

    @property
    def num_drafts(self) -> int:
        """Drafts one block gives: z-lab's slots 1 .. block_size - 1, or every slot (DSpark)."""
        return self.block_size if self.layout == "dspark" else self.block_size - 1

    @property
    def first_draft_slot(self) -> int:
        """The block slot whose output is the first draft: 1 (z-lab: slot j is the token at R + j) or 0 (DSpark)."""
        return 0 if self.layout == "dspark" else 1

    def check_target(self, target: ModelConfig) -> None:
        """Raises ValueError when this drafter was not made for ``target``."""
        for what, mine, theirs in (("hidden_size", self.target_hidden_size, target.hidden_size),
                                   ("vocab_size", self.layer.vocab_size, target.vocab_size)):
            if mine != theirs:
                raise ValueError(f"DFlash drafter expects target {what}={mine}, but the target has {what}={theirs}")
        if self.layer.hidden_size != target.hidden_size:
            raise ValueError(f"DFlash hidden_size={self.layer.hidden_size} differs from the target's hidden_size="
                             f"{target.hidden_size}, whose embedding and lm_head it uses")
        self.tap_layers(target)

    def tap_layers(self, target: ModelConfig) -> tuple[int, ...]:
        """The target layers whose residual-stream inputs are the outputs fc reads: id + 1 for each target layer
        id; ValueError where that is past the last layer (HF's last hidden state is after the final norm)."""
        taps = tuple(i + 1 for i in self.target_layer_ids)
        bad = [i for i in self.target_layer_ids if i + 1 >= target.num_layers]
        if bad:
            raise ValueError(f"DFlash target_layer_ids={list(self.target_layer_ids)}: {bad} must be below the "
                             f"target's last layer {target.num_layers - 1} (the output of the last layer is HF's "
                             f"hidden_states[{target.num_layers}], after the final norm, which jspec does not tap)")
        return taps



def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab's rule when a config names no ``target_layer_ids``: one per draft layer, spread over layers 1 ..
    L - 3 (the middle layer for a single draft layer)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers))


def dflash_config_from_hf(hf: dict[str, Any]) -> DFlashConfig:
    """DFlashConfig from z-lab's config.json (``DFlashDraftModel``: a Qwen3 config plus top-level ``block_size``,
    ``num_target_layers`` and ``dflash_config.{mask_token_id, target_layer_ids}``) or DeepSpec's
    (``Qwen3DSparkModel``: the same knobs at top level, plus ``markov_rank``, ``markov_head_type``,
    ``enable_confidence_head``, ``confidence_head_with_markov``); options that change the network and that jspec
    does not implement are refused by name."""
    dspark = any(arch in DSPARK_ARCHITECTURES for arch in hf.get("architectures") or [])
    dflash = dict(hf.get("dflash_config") or {})
    if dspark:
        head_type = hf.get("markov_head_type", "vanilla")
        if head_type != "vanilla":
            raise ValueError(f"DSpark markov_head_type={head_type!r} is not supported: jspec implements 'vanilla' "
                             f"(logits + markov_w2(markov_w1[previous token]))")
    for option, allowed in REFUSED_UNLESS.items():
        for where, value in (("dflash_config", dflash.get(option)), ("config.json", hf.get(option))):
            if value not in allowed:
                raise ValueError(f"DFlash {where} {option}={value!r} is not supported: jspec implements z-lab's "
                                 f"DFlashDraftModel (bidirectional full attention in the block, a linear fc); "
                                 f"expected one of {allowed}")
    layer_types = hf.get("layer_types") or []
    if any(kind != "full_attention" for kind in layer_types):
        raise ValueError(f"DFlash layer_types={layer_types!r}: only 'full_attention' layers are supported")
    block_size = dflash.get("block_size", hf.get("block_size"))
    mask_token_id = dflash.get("mask_token_id", hf.get("mask_token_id"))
    if not isinstance(block_size, int) or isinstance(block_size, bool):
        raise ValueError(f"DFlash config.json block_size={block_size!r}: expected an integer")
    if not isinstance(mask_token_id, int) or isinstance(mask_token_id, bool):
        raise ValueError(f"DFlash config.json dflash_config.mask_token_id={mask_token_id!r}: expected an integer")
    layer = from_hf_config({**hf, "model_type": "qwen3", "use_sliding_window": False, "tie_word_embeddings": False})
    ids = dflash.get("target_layer_ids", hf.get("target_layer_ids"))
    if ids is None:
        num_target = dflash.get("num_target_layers", hf.get("num_target_layers"))
        if not isinstance(num_target, int) or num_target < 1:
            raise ValueError(f"DFlash config.json names no dflash_config.target_layer_ids and num_target_layers="
                             f"{num_target!r}: expected a positive integer to derive them")
        ids = default_target_layer_ids(num_target, layer.num_layers)
    if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"DFlash dflash_config.target_layer_ids={ids!r}: expected a list of layer indices")
    extra = {}
    if dspark:
        rank = hf.get("markov_rank", 0)
        confidence = bool(hf.get("enable_confidence_head", False))
        extra = dict(layout="dspark", markov_rank=rank, confidence_head=confidence,
                     confidence_with_markov=confidence and bool(rank) and bool(hf.get("confidence_head_with_markov",
                                                                                        False)))
    return DFlashConfig(layer, block_size, mask_token_id, tuple(ids),
                        int(hf.get("target_hidden_size") or hf["hidden_size"]), **extra)


def _dense(features: int, bias: bool, dtype, name: str) -> Dense:
    return Dense(features, use_bias=bias, dtype=dtype, param_dtype=dtype, name=name)


class DFlashAttention(nn.Module):
    config: ModelConfig
    attention_fn: AttentionFn
    dtype: jnp.dtype

    def setup(self):
        cfg = self.config
        self.q_proj = _dense(cfg.num_heads * cfg.head_dim, cfg.qkv_bias, self.dtype, "q_proj")
        self.k_proj = _dense(cfg.num_kv_heads * cfg.head_dim, cfg.qkv_bias, self.dtype, "k_proj")
        self.v_proj = _dense(cfg.num_kv_heads * cfg.head_dim, cfg.qkv_bias, self.dtype, "v_proj")
        self.o_proj = _dense(cfg.hidden_size, cfg.o_bias, self.dtype, "o_proj")
        self.q_norm = RMSNorm(cfg.rms_norm_eps, self.dtype, name="q_norm")
        self.k_norm = RMSNorm(cfg.rms_norm_eps, self.dtype, name="k_norm")

    def kv(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x: [B, N, H] -> keys (k_norm, RoPE) and values, each [B, N, Hkv, D]."""
        cfg = self.config
        batch, num = x.shape[:2]
        k = self.k_norm(self.k_proj(x).reshape(batch, num, cfg.num_kv_heads, cfg.head_dim))
        v = self.v_proj(x).reshape(batch, num, cfg.num_kv_heads, cfg.head_dim)
        return apply_rope(k, cos, sin), v

    def __call__(self, x, cos, sin, k_cache, v_cache, cache_len):
        """The block x [B, T, H] over the context in the cache (slots < cache_len) and itself, all visible: its
        K/V go to the window at cache_len (past the committed context, overwritten by the next commit)."""
        cfg = self.config
        batch, num = x.shape[:2]
        q = apply_rope(self.q_norm(self.q_proj(x).reshape(batch, num, cfg.num_heads, cfg.head_dim)), cos, sin)
        k, v = self.kv(x, cos, sin)
        k_cache, v_cache = write_new_tokens(k_cache, k, cache_len), write_new_tokens(v_cache, v, cache_len)
        everything = jnp.ones((batch, num, num), bool)
        out = self.attention_fn(q, k_cache, v_cache, k, v, cache_len, everything, 0, scale=cfg.head_dim ** -0.5)
        return self.o_proj(out.reshape(batch, num, cfg.num_heads * cfg.head_dim).astype(self.dtype)), k_cache, v_cache


class DFlashLayer(nn.Module):
    config: ModelConfig
    attention_fn: AttentionFn
    dtype: jnp.dtype

    def setup(self):
        cfg = self.config
        self.input_layernorm = RMSNorm(cfg.rms_norm_eps, self.dtype)
        self.self_attn = DFlashAttention(cfg, self.attention_fn, self.dtype)
        self.post_attention_layernorm = RMSNorm(cfg.rms_norm_eps, self.dtype)
        self.mlp = MLP(cfg, self.dtype)

    def context_kv(self, ctx, cos, sin):
        return self.self_attn.kv(ctx, cos, sin)

    def __call__(self, x, cos, sin, k_cache, v_cache, cache_len):
        attn, k_cache, v_cache = self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, cache_len)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), k_cache, v_cache


class MarkovHead(nn.Module):
    """DSpark's vanilla Markov head: a rank-r bias on the logits from the previous token."""

    vocab_size: int
    rank: int
    dtype: jnp.dtype

    def setup(self):
        self.markov_w1 = nn.Embed(self.vocab_size, self.rank, dtype=self.dtype, param_dtype=self.dtype)
        self.markov_w2 = _dense(self.vocab_size, False, self.dtype, "markov_w2")

    def embed(self, previous: jax.Array) -> jax.Array:
        return self.markov_w1(previous)

    def __call__(self, previous: jax.Array) -> jax.Array:
        """previous: i32[...] -> f32[..., V] the bias of the next token's logits."""
        return self.markov_w2(self.markov_w1(previous)).astype(jnp.float32)


class ConfidenceHead(nn.Module):
    dtype: jnp.dtype

    def setup(self):
        self.proj = _dense(1, True, self.dtype, "proj")

    def __call__(self, features: jax.Array) -> jax.Array:
        return self.proj(features)[..., 0].astype(jnp.float32)


class DFlashDraft(nn.Module):
    """The draft network. :meth:`context` writes committed tokens' context K/V into the cache; ``__call__`` runs a
    block over it. The cache is a per-layer ``KVCache`` (tuples of [B, S, Hkv, D]) in the target's slot layout
    (models/attention.py): slot p holds the context of the token at position p."""

    config: DFlashConfig
    dtype: jnp.dtype = jnp.float32
    attention_fn: AttentionFn = dense_attention

    def setup(self):
        cfg = self.config.layer
        self.fc = _dense(cfg.hidden_size, False, self.dtype, "fc")
        self.hidden_norm = RMSNorm(cfg.rms_norm_eps, self.dtype)
        self.layers = [DFlashLayer(cfg, self.attention_fn, self.dtype, name=f"layers_{i}")
                       for i in range(cfg.num_layers)]
        self.norm = RMSNorm(cfg.rms_norm_eps, self.dtype)
        if self.config.markov_rank:
            self.markov_head = MarkovHead(cfg.vocab_size, self.config.markov_rank, self.dtype)
        if self.config.confidence_head:
            self.confidence_head = ConfidenceHead(self.dtype)

    def markov_bias(self, previous: jax.Array) -> jax.Array:
        """i32[...] -> f32[..., V]: DSpark's Markov bias of the token after ``previous`` (zeros without a head)."""
        if not self.config.markov_rank:
            return jnp.zeros(previous.shape + (self.config.layer.vocab_size,), jnp.float32)
        return self.markov_head(previous)

    def confidence(self, normed: jax.Array, previous: jax.Array) -> jax.Array:
        """normed: [..., H] a slot's output, previous: i32[...] the token before its draft -> f32[...] the logit of
        the draft being accepted."""
        features = normed
        if self.config.confidence_with_markov:
            features = jnp.concatenate([normed, self.markov_head.embed(previous).astype(normed.dtype)], axis=-1)
        return self.confidence_head(features)

    def _rope(self, positions):
        layer = self.config.layer
        return rope_cos_sin(positions, layer.rope_inv_freq(), self.dtype, layer.rope_attention_scaling())

    def context(self, features: jax.Array, positions: jax.Array, cache: KVCache, start: jax.Array) -> KVCache:
        """features: [B, N, n_ctx * H_target] (the target layers' outputs, concatenated in target_layer_ids
        order) of the tokens at ``positions`` i32[B, N]; their K/V written at slots start[b] .. start[b] + N - 1
        of every layer's cache."""
        ctx = self.hidden_norm(self.fc(features.astype(self.dtype)))
        cos, sin = self._rope(positions)
        ks, vs = [], []
        for layer, k_cache, v_cache in zip(self.layers, cache.k, cache.v):
            k, v = layer.context_kv(ctx, cos, sin)
            ks.append(write_new_tokens(k_cache, k, start))
            vs.append(write_new_tokens(v_cache, v, start))
        return KVCache(tuple(ks), tuple(vs))

    def __call__(self, embeds: jax.Array, positions: jax.Array, cache: KVCache,
                 cache_len: jax.Array) -> tuple[jax.Array, KVCache]:
        """embeds: [B, T, H] the block's tokens embedded by the target; positions: i32[B, T]; the context in
        slots < cache_len[b] -> (the final norm's output [B, T, H], the cache with the block in its window)."""
        x = embeds.astype(self.dtype)
        cos, sin = self._rope(positions)
        ks, vs = [], []
        for layer, k_cache, v_cache in zip(self.layers, cache.k, cache.v):
            x, k_cache, v_cache = layer(x, cos, sin, k_cache, v_cache, cache_len)
            ks.append(k_cache)
            vs.append(v_cache)
        return self.norm(x), KVCache(tuple(ks), tuple(vs))


@cached_shapes
def dflash_param_shapes(config: DFlashConfig, dtype=jnp.float32) -> dict:
    """The draft's param tree as ``jax.ShapeDtypeStruct`` leaves: traced, nothing allocated."""
    cfg = config.layer
    model = DFlashDraft(config, dtype)

    def both(module, embeds, positions):
        cache = KVCache.zeros(cfg.num_layers, 1, 4, cfg.num_kv_heads, cfg.head_dim, dtype, per_layer=True)
        features = jnp.zeros((1, 1, len(config.target_layer_ids) * config.target_hidden_size), dtype)
        zeros = jnp.zeros((1,), jnp.int32)
        normed, cache_out = module(embeds, positions, module.context(features, positions, cache, zeros), zeros)
        if config.markov_rank:
            module.markov_bias(positions)
        if config.confidence_head:
            module.confidence(normed, positions)
        return normed, cache_out

    return jax.eval_shape(lambda: nn.init(both, model)(jax.random.key(0), jnp.zeros((1, 1, cfg.hidden_size), dtype),
                                                       jnp.zeros((1, 1), jnp.int32))["params"])


def init_dflash_params(config: DFlashConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random parameters of the right shapes (see ``models/random_params.py``)."""
    return random_params(dflash_param_shapes(config, dtype), key)
