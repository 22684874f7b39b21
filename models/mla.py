"""Multi-head latent attention (DeepSeek-V2/V3; transformers' ``DeepseekV3Attention``), run in its absorbed form
over a cache of latents.

A token's keys and values for all H heads come from one latent ``c`` (``kv_lora_rank`` wide, normed) and one rope
key ``k_r`` (``qk_rope_head_dim`` = ``config.head_dim`` wide, shared by the heads): head h's key is
``[W_UK[h] c ; k_r]`` and its value ``W_UV[h] c`` (``kv_b_proj`` holds W_UK and W_UV). So the cache keeps
``[c ; k_r]`` per token, ``kv_lora_rank + head_dim`` numbers instead of ``H * (qk_head_dim + v_head_dim)``
(576 against 40,960 at DeepSeek-V3's shapes). Attention reads it as one KV head shared by every query head (MQA):
the query's no-rope part is absorbed into latent space, ``q_c[h] = W_UK[h]^T q_nope[h]``, so that
``q_c[h] . c + q_r[h] . k_r`` is head h's logit, and each head's output ``o_c[h] = sum_j p_j c_j`` leaves latent space
through ``W_UV[h]``. The latent stands as both key and value: the attention function is handed the cache as K and
as V (its rope columns come out too and are dropped), and the layer's V cache is zero-wide.

The naive form (expanding every cached latent into H keys and values) gives the same numbers; the absorbed one is
what decoding and tree verification pay for (``tests/models/test_mla.py`` checks one against the other).

Parameters (HF names; kernels [in, out])::

    q_a_proj/kernel [H, q_lora_rank], q_a_layernorm/weight, q_b_proj/kernel [q_lora_rank, heads * qk_head_dim]
        (or q_proj/kernel [H, heads * qk_head_dim] where q_lora_rank is 0)
    kv_a_proj_with_mqa/kernel [H, kv_lora_rank + rope], kv_a_layernorm/weight [kv_lora_rank]
    kv_b_proj/kernel [kv_lora_rank, heads * (qk_nope_head_dim + v_head_dim)]
    o_proj/kernel [heads * v_head_dim, H]
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import qwix

from models.attention import AttentionFn, write_new_tokens
from models.config import ModelConfig
from models.dense import Dense
from models.layers import RMSNorm, apply_rope


class Kernel(nn.Module):
    """A bare weight (``kernel``), for a projection the layer takes apart rather than applies (``kv_b_proj``); a
    weight-only quantized one (``qwix.QArray``) is dequantized where it is used."""

    shape: tuple[int, ...]
    dtype: jnp.dtype

    @nn.compact
    def __call__(self) -> jax.Array:
        kernel = self.param("kernel", nn.initializers.lecun_normal(), self.shape, self.dtype)
        if isinstance(kernel, qwix.QArray):
            return qwix.dequantize(kernel).astype(self.dtype)
        return kernel


def deinterleave(x: jax.Array) -> jax.Array:
    """DeepSeek's rope pairs (x0, x1), (x2, x3), ... regrouped as the halves (x0, x2, ..), (x1, x3, ..) that
    ``apply_rope`` turns: transformers' ``apply_rotary_pos_emb_interleave`` gives the same numbers."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


class LatentAttention(nn.Module):
    """The attention of a DeepSeek-V3 layer (``Attention``'s call: x [B, T, H], cos/sin [B, T, 1, rope], the layer's
    cache k: [B, S, 1, kv_lora_rank + rope] latents and v: [B, S, 1, 0]) -> (out [B, T, H], k, v)."""

    config: ModelConfig
    attention_fn: AttentionFn
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, cos, sin, k_cache, v_cache, cache_len, local_mask, write_offset=0, window=None):
        cfg = self.config
        if window is not None or cfg.attention_sinks:
            raise ValueError("LatentAttention: sliding windows and sinks are not part of DeepSeek-V3's attention")
        batch, num_new, _ = x.shape
        heads, nope, rope, rank = cfg.num_heads, cfg.qk_nope_head_dim, cfg.head_dim, cfg.kv_lora_rank
        norm = functools.partial(RMSNorm, cfg.rms_norm_eps, self.dtype)

        def proj(features, name):
            return Dense(features, use_bias=False, dtype=self.dtype, param_dtype=self.dtype, name=name)

        if cfg.q_lora_rank:
            q = proj(heads * (nope + rope), "q_b_proj")(norm(name="q_a_layernorm")(proj(cfg.q_lora_rank,
                                                                                       "q_a_proj")(x)))
        else:
            q = proj(heads * (nope + rope), "q_proj")(x)
        q = q.reshape(batch, num_new, heads, nope + rope)
        q_nope, q_rope = q[..., :nope], q[..., nope:]
        compressed = proj(rank + rope, "kv_a_proj_with_mqa")(x)
        latent = norm(name="kv_a_layernorm")(compressed[..., :rank])[:, :, None, :]
        k_rope = compressed[..., rank:][:, :, None, :]
        if cfg.rope_interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_rope, k_rope = apply_rope(q_rope, cos, sin), apply_rope(k_rope, cos, sin)
        new = jnp.concatenate([latent, k_rope], axis=-1)  # [B, T, 1, rank + rope]: what the cache keeps
        kv_b = Kernel((rank, heads * (nope + cfg.v_head_dim)), self.dtype, name="kv_b_proj")()
        kv_b = kv_b.reshape(rank, heads, nope + cfg.v_head_dim)
        q_latent = jnp.einsum("bthn,rhn->bthr", q_nope, kv_b[..., :nope])  # the no-rope query in latent space
        query = jnp.concatenate([q_latent.astype(self.dtype), q_rope], axis=-1)
        k_cache = write_new_tokens(k_cache, new, cache_len + write_offset)
        out = self.attention_fn(query, k_cache, k_cache, new, new, cache_len, local_mask, write_offset,
                                scale=cfg.attention_scale)
        out = jnp.einsum("bthr,rhv->bthv", out[..., :rank], kv_b[..., nope:])  # each head's latent output, out
        out = out.reshape(batch, num_new, heads * cfg.v_head_dim).astype(self.dtype)
        return proj(cfg.hidden_size, "o_proj")(out), k_cache, v_cache
