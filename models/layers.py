"""The building blocks the decoders share (``models.llama``'s layers, DeepSeek-V3's latent attention, the experts'
shared MLP): RMSNorm, rotary embeddings and the gated MLP, numerics as transformers'."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.dense import Dense


class RMSNorm(nn.Module):
    """RMSNorm over the last axis; statistics in f32, the weight applied in the input dtype (as HF does). With an
    ``offset`` (Gemma's 1), scaled by (offset + weight) in f32, then cast (as Gemma3RMSNorm does)."""

    eps: float
    dtype: jnp.dtype = jnp.float32
    offset: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.zeros if self.offset else nn.initializers.ones
        weight = self.param("weight", init, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.offset:
            return (normed * (self.offset + weight.astype(jnp.float32))).astype(x.dtype)
        return weight * normed.astype(x.dtype)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray, dtype,
                 scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """positions: i32[B, T] -> cos, sin: [B, T, 1, D] (HF's concatenated-halves layout), times ``scale`` (yarn's
    attention factor, ``ModelConfig.rope_attention_scaling``)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    if scale == 1.0:
        return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)
    return (jnp.cos(emb) * scale).astype(dtype), (jnp.sin(emb) * scale).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [B, T, heads, D] rotated by position (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


class MLP(nn.Module):
    """size: the intermediate width (0: the config's intermediate_size)."""

    config: ModelConfig
    dtype: jnp.dtype
    size: int = 0

    @nn.compact
    def __call__(self, x):
        cfg = self.config

        def proj(features, name):
            return Dense(features, use_bias=cfg.mlp_bias, dtype=self.dtype, param_dtype=self.dtype, name=name)

        gate = proj(self.size or cfg.intermediate_size, "gate_proj")(x)
        up = proj(self.size or cfg.intermediate_size, "up_proj")(x)
        act = nn.silu(gate) if cfg.hidden_act == "silu" else jax.nn.gelu(gate, approximate=True)
        return proj(cfg.hidden_size, "down_proj")(act * up)
