"""Llama-family decoder in Flax (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, Qwen3-MoE, gpt-oss, Gemma-3's text model):
numerics as in HF transformers; a sliding window per layer and attention sinks where the config has them.

The module only describes the network. The KV cache is explicit arrays passed in and returned; which new tokens
see each other is an argument (causal continuation or an arbitrary tree mask, see ``models/attention.py``);
the attention function is injected, so a tree-attention kernel can replace the default without this file
knowing. For training and conversion the layers run under ``nn.scan`` (parameters stacked on a leading
``num_layers`` axis: compile time does not grow with depth); inference unrolls them over per-layer parameters
(``scan_layers=False``, :func:`unstack_layers`), which spares a copy of every layer's weights and K/V per step.

Parameter tree (HF names; Dense kernels are HF weights transposed, [in, out])::

    embed_tokens/embedding              [V, H]
    layers/input_layernorm/weight       [L, H]
    layers/self_attn/{q,k,v,o}_proj/kernel (+bias)   [L, in, out]
    layers/self_attn/{q,k}_norm/weight  [L, D]          (Qwen3, Gemma-3)
    layers/self_attn/sinks              [L, Hq]         (gpt-oss: a logit per head in every softmax)
    layers/post_attention_layernorm/weight  [L, H]
    layers/{pre,post}_feedforward_layernorm/weight  [L, H]  (Gemma-3, whose norms scale by 1 + weight)
    layers/mlp/{gate,up,down}_proj/kernel   [L, in, out]
    layers/mlp/gate/kernel, layers/mlp/experts/{gate,up,down}_proj/kernel  [L, ...]  (a mixture of experts instead:
                                                                              Qwen3-MoE, models/moe.py)
    norm/weight                         [H]
    lm_head/kernel                      [H, V]          (absent when embeddings are tied)
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.attention import AttentionFn, KVCache, dense_attention, write_new_tokens
from models.config import ModelConfig
from models.dense import Dense, Embed
from models.layers import MLP, RMSNorm, apply_rope, rope_cos_sin
from models.mla import LatentAttention
from models.moe import MoE
from models.random_params import cached_shapes, random_params


class DecoderOutput(NamedTuple):
    """logits: f32[B, T', V] (T' = T, or K when logits_index is given); cache: the updated KVCache;
    taps: [len(tap_layers), B, T, H] residual-stream inputs of the requested layers (None if none)."""

    logits: jax.Array
    cache: KVCache
    taps: jax.Array | None


class Attention(nn.Module):
    """window: this layer's sliding window (None: full attention; an i32 scalar inside a scanned stack, where the
    full layers' is past any sequence)."""

    config: ModelConfig
    attention_fn: AttentionFn
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, cos, sin, k_cache, v_cache, cache_len, local_mask, write_offset=0, window=None):
        cfg = self.config
        norm = functools.partial(RMSNorm, cfg.rms_norm_eps, self.dtype, cfg.norm_weight_offset)
        batch, num_new, _ = x.shape

        def proj(features, bias, name):
            return Dense(features, use_bias=bias, dtype=self.dtype, param_dtype=self.dtype, name=name)

        q = proj(cfg.num_heads * cfg.head_dim, cfg.qkv_bias, "q_proj")(x)
        k = proj(cfg.num_kv_heads * cfg.head_dim, cfg.qkv_bias, "k_proj")(x)
        v = proj(cfg.num_kv_heads * cfg.head_dim, cfg.qkv_bias, "v_proj")(x)
        q = q.reshape(batch, num_new, cfg.num_heads, cfg.head_dim)
        k = k.reshape(batch, num_new, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(batch, num_new, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = norm(name="q_norm")(q)
            k = norm(name="k_norm")(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache = write_new_tokens(k_cache, k, cache_len + write_offset)
        v_cache = write_new_tokens(v_cache, v, cache_len + write_offset)
        extra = {}  # only what the layer has: an attention without windows or sinks need not take them
        if window is not None:
            extra["window"] = window
        if cfg.attention_sinks:
            extra["sinks"] = self.param("sinks", nn.initializers.zeros, (cfg.num_heads,), self.dtype)
        out = self.attention_fn(q, k_cache, v_cache, k, v, cache_len, local_mask, write_offset,
                                scale=cfg.attention_scale, **extra)
        out = out.reshape(batch, num_new, cfg.num_heads * cfg.head_dim).astype(self.dtype)
        return proj(cfg.hidden_size, cfg.o_bias, "o_proj")(out), k_cache, v_cache


class DecoderLayer(nn.Module):
    """One pre-norm block (Gemma-3: norms after attention and around the MLP too). Scanned: carry = (hidden
    [B,T,H], taps), xs = (k_cache, v_cache, tap_slot, window, local_rope); unrolled, window and local_rope are the
    layer's own (int or None, bool). ropes: (cos, sin) of the full layers, then of the sliding ones where their
    rope differs (Gemma-3's local base)."""

    config: ModelConfig
    attention_fn: AttentionFn
    dtype: jnp.dtype
    experts: bool | None = None  # whether its MLP is a mixture of experts (None: the config's every layer)

    @nn.compact
    def __call__(self, carry, layer_xs, ropes, cache_len, local_mask, write_offset):
        cfg = self.config
        norm = functools.partial(RMSNorm, cfg.rms_norm_eps, self.dtype, cfg.norm_weight_offset)
        x, taps = carry
        k_cache, v_cache, tap_slot, window, local_rope = layer_xs
        cos, sin = ropes[0]
        if len(ropes) > 1:
            cos, sin = (jnp.where(local_rope, local, full) for local, full in zip(ropes[1], ropes[0]))
        if taps is not None:
            taps = jax.lax.dynamic_update_index_in_dim(taps, x.astype(taps.dtype), tap_slot, 0)
        h = norm(name="input_layernorm")(x)
        attention = LatentAttention if cfg.mla else Attention
        attn, k_cache, v_cache = attention(cfg, self.attention_fn, self.dtype, name="self_attn")(
            h, cos, sin, k_cache, v_cache, cache_len, local_mask, write_offset, window)
        if cfg.sandwich_norms:
            attn = norm(name="post_attention_layernorm")(attn)
        x = x + attn
        h = norm(name="pre_feedforward_layernorm" if cfg.sandwich_norms else "post_attention_layernorm")(x)
        experts = bool(cfg.num_experts) if self.experts is None else self.experts
        mlp = (MoE if experts else MLP)(cfg, self.dtype, name="mlp")(h)
        if cfg.sandwich_norms:
            mlp = norm(name="post_feedforward_layernorm")(mlp)
        return (x + mlp, taps), (k_cache, v_cache)


class LlamaModel(nn.Module):
    """Llama-family causal LM.

    Call: ``tokens`` i32[B, T], ``positions`` i32[B, T] (rope positions), ``cache`` KVCache with S slots,
    ``cache_len`` i32[B] (where the T new tokens are written; cache_len + T <= S), ``local_mask``
    bool[B, T, W] or None (causal; see models/attention.py), ``write_offset`` (new tokens go to slots
    cache_len + write_offset ..; a drafter growing a tree; handed to the attention function as given, so a Python
    int stays static), ``logits_index`` i32[B, K] or None (which of the T rows get logits; None: all),
    ``tap_layers``: static tuple of layer indices whose residual-stream input is returned (HF
    ``hidden_states[i]``; index ``num_layers`` is the last layer's output before the final norm, which HF's
    ``hidden_states[-1]`` gives after it).

    ``scan_layers``: True runs the layers under ``nn.scan`` (stacked params and cache; training, conversion);
    False unrolls them over per-layer params and cache (inference; :func:`unstack_layers` converts params).
    """

    config: ModelConfig
    dtype: jnp.dtype = jnp.float32
    attention_fn: AttentionFn = dense_attention
    scan_layers: bool = True

    @nn.compact
    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: KVCache, cache_len: jax.Array,
                 local_mask: jax.Array | None = None, logits_index: jax.Array | None = None,
                 tap_layers: Sequence[int] = (), write_offset: jax.Array | int = 0) -> DecoderOutput:
        cfg = self.config
        embed = Embed(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, param_dtype=self.dtype,
                      name="embed_tokens")
        x = embed(tokens)
        if cfg.embedding_multiplier != 1.0:
            x = x * jnp.asarray(cfg.embedding_multiplier, self.dtype)
        ropes = (rope_cos_sin(positions, cfg.rope_inv_freq(), self.dtype, cfg.rope_attention_scaling()),)
        local = [i for i in range(cfg.num_layers) if not cfg.layer_rope(i)[1]]
        if local:
            ropes += (rope_cos_sin(positions, cfg.rope_inv_freq(local[0]), self.dtype,
                                   cfg.rope_attention_scaling(local[0])),)

        tapped = sorted(set(tap_layers))
        _tap_slots(tapped, cfg.num_layers)  # validates the layer indices
        if self.scan_layers and cfg.uniform_layers:  # (DeepSeek's dense first layers: unrolled, stored so too)
            x, taps, cache = self._scanned_layers(x, cache, ropes, cache_len, local_mask, write_offset, tapped)
        else:
            x, taps, cache = self._unrolled_layers(x, cache, ropes, cache_len, local_mask, write_offset, tapped)
        if taps is not None:
            if cfg.num_layers in tapped:  # the residual after the last layer, before the final norm
                taps = taps.at[tapped.index(cfg.num_layers)].set(x.astype(taps.dtype))
            taps = taps[np.asarray([tapped.index(layer) for layer in tap_layers])]

        x = RMSNorm(cfg.rms_norm_eps, self.dtype, cfg.norm_weight_offset, name="norm")(x)
        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index[:, :, None], axis=1)
        if cfg.tie_word_embeddings and self.scan_layers and cfg.uniform_layers:
            logits = embed.attend(x)
        else:
            logits = Dense(cfg.vocab_size, use_bias=False, dtype=self.dtype, param_dtype=self.dtype,
                              name="lm_head")(x)
        return DecoderOutput(logits.astype(jnp.float32), cache, taps)

    def _scanned_layers(self, x, cache, ropes, cache_len, local_mask, write_offset, tapped):
        """Layers under nn.scan: params stacked under ``layers``, cache stacked [L, B, S, Hkv, D]."""
        cfg = self.config
        if cache.per_layer:
            raise ValueError("LlamaModel(scan_layers=True) takes a stacked KVCache; got a per-layer one")
        tap_slot = _tap_slots(tapped, cfg.num_layers)
        taps = None
        if tapped:
            taps = jnp.zeros((len(tapped) + 1,) + x.shape, self.dtype)  # last slot: untapped layers
        layers = nn.scan(
            DecoderLayer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
            length=cfg.num_layers,
        )(cfg, self.attention_fn, self.dtype, name="layers")
        windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]
        window = None  # a full layer's in a stack with sliding ones: past any sequence
        if any(windows):
            window = jnp.asarray([w or np.iinfo(np.int32).max // 2 for w in windows], jnp.int32)
        local_rope = jnp.asarray([not cfg.layer_rope(i)[1] for i in range(cfg.num_layers)])
        (x, taps), (k, v) = layers((x, taps), (cache.k, cache.v, jnp.asarray(tap_slot), window, local_rope), ropes,
                                   cache_len, local_mask, write_offset)  # a broadcast Python int stays one
        return x, taps, KVCache(k, v)

    def _unrolled_layers(self, x, cache, ropes, cache_len, local_mask, write_offset, tapped):
        """One module per layer (params ``layers_0`` .. ``layers_{L-1}``, see :func:`unstack_layers`) over a
        per-layer cache: every layer reads its weights and updates its K/V in place, with no slicing copies."""
        cfg = self.config
        if not cache.per_layer or len(cache.k) != cfg.num_layers:
            raise ValueError(f"LlamaModel(scan_layers=False) takes a per-layer KVCache of {cfg.num_layers} layers")
        taps, ks, vs = [], [], []
        for i in range(cfg.num_layers):
            if i in tapped:
                taps.append(x)
            layer = DecoderLayer(cfg, self.attention_fn, self.dtype, cfg.layer_has_experts(i), name=f"layers_{i}")
            (x, _), (k, v) = layer((x, None), (cache.k[i], cache.v[i], None, cfg.layer_window(i),
                                               not cfg.layer_rope(i)[1]), ropes, cache_len, local_mask, write_offset)
            ks.append(k)
            vs.append(v)
        if cfg.num_layers in tapped:
            taps.append(x)
        return x, (jnp.stack(taps) if taps else None), KVCache(tuple(ks), tuple(vs))


def _tap_slots(tap_layers: Sequence[int], num_layers: int) -> np.ndarray:
    """i32[num_layers]: for each layer, its slot in the taps buffer, or len(tap_layers) when not tapped. Tap
    ``num_layers`` (the residual after the last layer, before the final norm) is valid and filled after the layers."""
    slots = np.full((num_layers,), len(tap_layers), np.int32)
    for slot, layer in enumerate(tap_layers):
        if not 0 <= layer <= num_layers:
            raise ValueError(f"tap layer {layer} is outside 0..{num_layers} (num_layers: the last layer's output, "
                             f"before the final norm)")
        if layer < num_layers:
            slots[layer] = slot
    return slots


@cached_shapes
def param_shapes(config: ModelConfig, dtype=jnp.float32) -> dict:
    """The stored param tree (``layers`` stacked) as ``jax.ShapeDtypeStruct`` leaves: traced, nothing allocated."""
    model = LlamaModel(config, dtype)

    def init():
        tokens = jnp.zeros((1, 1), jnp.int32)
        cache = KVCache.for_model(config, 1, 1, dtype, per_layer=not config.uniform_layers)
        return model.init(jax.random.key(0), tokens, tokens, cache, jnp.zeros((1,), jnp.int32))["params"]

    return jax.eval_shape(init)


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random parameters of the right shapes (tests, synthetic benchmarks; see ``models/random_params.py``)."""
    return random_params(param_shapes(config, dtype), key)


def unstack_layers(params: dict, config: ModelConfig) -> dict:
    """Stored params (``layers`` stacked on a leading L axis) -> the inference layout of
    ``LlamaModel(scan_layers=False)``: ``layers_0`` .. ``layers_{L-1}``, and for tied embeddings an explicit
    ``lm_head/kernel`` = embedding.T [H, V] (so no step transposes the embedding). Params already in the inference
    layout are returned as they are."""
    if "layers" not in params:  # stored per layer already (DeepSeek's dense first layers)
        if config.tie_word_embeddings and "lm_head" not in params:
            return {**params, "lm_head": {"kernel": params["embed_tokens"]["embedding"].T}}
        return params
    out = {name: value for name, value in params.items() if name != "layers"}
    for i in range(config.num_layers):
        out[f"layers_{i}"] = jax.tree.map(lambda stacked: stacked[i], params["layers"])
    if config.tie_word_embeddings:
        out["lm_head"] = {"kernel": params["embed_tokens"]["embedding"].T}
    return out


# unstack_layers as one program: loading a model then runs one compiled program (cached by the CLI's persistent
# compilation cache) instead of a slice, a squeeze and a transpose per tensor.
unstack_layers_jit = jax.jit(unstack_layers, static_argnames=("config",))
