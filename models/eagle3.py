"""EAGLE-3 draft head (Li et al., 2025, "EAGLE-3: Scaling up Inference Acceleration of LLMs via Training-Time
Test"), numerics as the reference implementation and SGLang's ``LlamaForCausalLMEagle3``.

The head is one Llama decoder layer whose attention reads 2H features per token::

    fused  = fc(concat(h[a], h[b], h[c]))              3H_target -> H, no bias; (a, b, c) = Eagle3Config.taps,
                                                       by default (2, L//2, L-3) (first draft position only;
                                                       later positions feed the head's own pre-norm output)
    x      = concat(input_layernorm(embed(token)), hidden_norm(fused))       [B, T, 2H]
    h      = self_attn(x) + fused                      q/k/v: 2H -> heads; rope as the target's
    pre    = mlp(post_attention_layernorm(h)) + h      the "pre-norm output", fed to the next draft step
    logits = lm_head(norm(pre))                        over the draft vocabulary; target id = d + d2t[d]

``embed`` is the target's embedding (shared, not copied): the caller passes the embedded tokens. The head's KV
cache is a one-layer ``KVCache`` with the same slot layout as the target's (models/attention.py).

Parameter tree::

    fc/kernel                                   [3H_target, H]
    midlayer/input_layernorm/weight, hidden_norm/weight, post_attention_layernorm/weight   [H]
    midlayer/self_attn/{q,k,v}_proj/kernel      [2H, heads * D]; o_proj/kernel [heads * D, H]
    midlayer/mlp/{gate,up,down}_proj/kernel
    norm/weight [H];  lm_head/kernel [H, V_draft]
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.attention import AttentionFn, KVCache, dense_attention
from models.config import ModelConfig, rope_scaling_from_hf, rope_theta_from_hf
from models.dense import Dense
from models.llama import MLP, Attention, RMSNorm, rope_cos_sin
from models.random_params import cached_shapes, random_params

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle",
                        "Eagle3Speculator")


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """layer: the decoder layer's shapes (num_layers 1, vocab_size = draft vocabulary);
    target_hidden_size: H of the target (fc reads 3 of its hidden states); target_vocab_size: V of the target."""

    layer: ModelConfig
    target_hidden_size: int
    target_vocab_size: int
    # The target layers whose residual-stream inputs the head fuses, in fc's order, as Hugging Face
    # ``hidden_states`` indices (= the target's ``tap_layers``); None: the EAGLE default (2, L//2, L-3). The
    # converter records them in config.json (``jspec_eagle3.tap_layers``), resolved from the writer's convention.
    taps: tuple[int, int, int] | None = None

    @property
    def draft_vocab_size(self) -> int:
        return self.layer.vocab_size

    def check_target(self, target: ModelConfig) -> None:
        """Raises ValueError when this head was not made for ``target``."""
        if self.target_hidden_size != target.hidden_size:
            raise ValueError(f"EAGLE-3 head expects target hidden_size={self.target_hidden_size}, but the target "
                             f"has hidden_size={target.hidden_size}")
        if self.target_vocab_size != target.vocab_size:
            raise ValueError(f"EAGLE-3 head expects target vocab_size={self.target_vocab_size}, but the target "
                             f"has vocab_size={target.vocab_size}")
        if self.layer.hidden_size != target.hidden_size:
            raise ValueError(f"EAGLE-3 head hidden_size={self.layer.hidden_size} differs from the target's "
                             f"hidden_size={target.hidden_size}, whose embedding it shares")
        self.target_taps(target)

    def target_taps(self, target: ModelConfig) -> tuple[int, int, int]:
        """The target layers this head reads (HF ``hidden_states`` indices: inputs of those layers): the recorded
        ``taps``, or the default rule; ValueError when one is not the input of a layer of ``target``."""
        if self.taps is None:
            return self.tap_layers(target)
        bad = [t for t in self.taps if not 0 <= t < target.num_layers]
        if bad:
            raise ValueError(
                f"EAGLE-3 head reads target hidden_states{list(self.taps)}, but {bad} is not the input of a layer "
                f"of the target (num_layers={target.num_layers}: valid 0..{target.num_layers - 1}; "
                f"hidden_states[{target.num_layers}] is after the final norm, which jspec does not tap)")
        return self.taps

    @staticmethod
    def tap_layers(target: ModelConfig) -> tuple[int, int, int]:
        """The default taps, EAGLE's rule: inputs of layers (2, L//2, L-3) (HF hidden_states indices)."""
        num_layers = target.num_layers
        layers = (2, num_layers // 2, num_layers - 3)
        if min(layers) < 0 or max(layers) >= num_layers:
            raise ValueError(f"EAGLE-3 needs a target with at least 3 layers, got num_layers={num_layers}")
        return layers


def eagle3_config_from_hf(hf: dict[str, Any]) -> Eagle3Config:
    """Eagle3Config from an EAGLE-3 head's config.json (rope_theta defaults to 10000 when absent)."""
    for field in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        value = hf.get(field)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"EAGLE-3 config.json {field}={value!r}: expected a positive integer")
    heads = hf["num_attention_heads"]
    layer = ModelConfig(
        vocab_size=int(hf.get("draft_vocab_size") or hf["vocab_size"]),
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=1,
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta_from_hf(hf),
        rope_scaling=rope_scaling_from_hf(hf),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        model_type="llama",
    )
    return Eagle3Config(layer=layer, target_hidden_size=int(hf.get("target_hidden_size") or hf["hidden_size"]),
                        target_vocab_size=int(hf["vocab_size"]), taps=_recorded_taps(hf))


def _recorded_taps(hf: dict[str, Any]) -> tuple[int, int, int] | None:
    """``jspec_eagle3.tap_layers`` of a converted config.json (written by models/checkpoint/eagle3_layouts.py),
    or None (the default rule)."""
    taps = (hf.get("jspec_eagle3") or {}).get("tap_layers")
    if taps is None:
        return None
    if (not isinstance(taps, (list, tuple)) or len(taps) != 3
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in taps)):
        raise ValueError(f"jspec_eagle3.tap_layers={taps!r}: expected 3 non-negative integers (HF hidden_states "
                         f"indices)")
    return tuple(taps)


class Eagle3Output(NamedTuple):
    logits: jax.Array  # f32[B, T, V_draft]
    hidden: jax.Array  # [B, T, H] pre-norm output, the next draft step's input features
    cache: KVCache     # one layer: [1, B, S, Hkv, D]


class Eagle3Layer(nn.Module):
    config: ModelConfig
    attention_fn: AttentionFn
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, embeds, hidden, cos, sin, k_cache, v_cache, cache_len, local_mask, write_offset):
        cfg = self.config
        x = jnp.concatenate([RMSNorm(cfg.rms_norm_eps, self.dtype, name="input_layernorm")(embeds),
                             RMSNorm(cfg.rms_norm_eps, self.dtype, name="hidden_norm")(hidden)], axis=-1)
        attn, k_cache, v_cache = Attention(cfg, self.attention_fn, self.dtype, name="self_attn")(
            x, cos, sin, k_cache, v_cache, cache_len, local_mask, write_offset)
        h = attn + hidden
        h = h + MLP(cfg, self.dtype, name="mlp")(
            RMSNorm(cfg.rms_norm_eps, self.dtype, name="post_attention_layernorm")(h))
        return h, k_cache, v_cache


class Eagle3Head(nn.Module):
    """Call: embeds [B, T, H] (the target's embedding of the tokens), hidden [B, T, 3 H_target] (target
    features: fc is applied) or [B, T, H] (the head's own pre-norm output), positions i32[B, T], cache (one
    layer), cache_len i32[B], local_mask bool[B, T, W] | None, write_offset (see models/attention.py).
    ``output_at`` i32[B] | None: only row output_at[b] of each sequence gets logits and hidden (both [B, 1, ...]),
    so a caller that keeps one row (the commit's last accepted token) skips T - 1 rows of norm and lm_head."""

    config: Eagle3Config
    dtype: jnp.dtype = jnp.float32
    attention_fn: AttentionFn = dense_attention

    @nn.compact
    def __call__(self, embeds: jax.Array, hidden: jax.Array, positions: jax.Array, cache: KVCache,
                 cache_len: jax.Array, local_mask: jax.Array | None = None,
                 write_offset: jax.Array | int = 0, output_at: jax.Array | None = None) -> Eagle3Output:
        cfg = self.config.layer
        embeds, hidden = embeds.astype(self.dtype), hidden.astype(self.dtype)
        if hidden.shape[-1] != cfg.hidden_size:
            hidden = Dense(cfg.hidden_size, use_bias=False, dtype=self.dtype, param_dtype=self.dtype,
                              name="fc")(hidden)
        cos, sin = rope_cos_sin(positions, cfg.rope_inv_freq(), self.dtype)
        pre, k, v = Eagle3Layer(cfg, self.attention_fn, self.dtype, name="midlayer")(
            embeds, hidden, cos, sin, cache.k[0], cache.v[0], cache_len, local_mask, write_offset)
        if output_at is not None:
            pre = jnp.take_along_axis(pre, output_at[:, None, None], axis=1)
        normed = RMSNorm(cfg.rms_norm_eps, self.dtype, name="norm")(pre)
        logits = Dense(cfg.vocab_size, use_bias=False, dtype=self.dtype, param_dtype=self.dtype,
                          name="lm_head")(normed)
        return Eagle3Output(logits.astype(jnp.float32), pre, KVCache(k[None], v[None]))


@cached_shapes
def eagle3_param_shapes(config: Eagle3Config, dtype=jnp.float32) -> dict:
    """The head's param tree (fc included) as ``jax.ShapeDtypeStruct`` leaves: traced, nothing allocated."""
    cfg = config.layer
    head = Eagle3Head(config, dtype)

    def init():
        embeds = jnp.zeros((1, 1, cfg.hidden_size), dtype)
        features = jnp.zeros((1, 1, 3 * config.target_hidden_size), dtype)
        cache = KVCache.zeros(1, 1, 1, cfg.num_kv_heads, cfg.head_dim, dtype)
        zeros = jnp.zeros((1, 1), jnp.int32)
        return head.init(jax.random.key(0), embeds, features, zeros, cache, jnp.zeros((1,), jnp.int32))["params"]

    return jax.eval_shape(init)


def init_eagle3_params(config: Eagle3Config, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random head parameters of the right shapes (fc included; see ``models/random_params.py``)."""
    return random_params(eagle3_param_shapes(config, dtype), key)
