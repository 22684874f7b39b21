"""A mixture of experts in place of a decoder layer's MLP (Qwen3-MoE): numerics as transformers'
``Qwen3MoeSparseMoeBlock``, no token dropped.

A router (``gate``, a bias-free linear layer [H, E]) scores every token against the E experts; softmax (float32),
the top ``num_experts_per_tok`` kept, renormalised to sum to one with ``norm_topk_prob``. Each expert is a SwiGLU MLP
of width ``moe_intermediate_size``; a token's output is its experts' outputs weighted by their router scores.

The experts run as grouped matmuls (``jax.lax.ragged_dot``): the N * k (token, expert) assignments sorted by expert,
each expert's rows multiplied by its own weights, the results added back to their tokens. Every assignment is
computed (no capacity, nothing dropped), so the output is the dense definition's whatever the routing. On a GPU or
TPU ragged_dot is a grouped matmul reading each routed expert's weights once; XLA:CPU computes it densely.

Parameters (HF's per-expert tensors stacked on an expert axis; kernels [in, out] as ``models.dense.Dense``'s, so
tensor parallelism splits them as the dense MLP's and weight-only quantization applies)::

    gate/kernel                 [H, E]       router
    experts/gate_proj/kernel    [E, H, I]
    experts/up_proj/kernel      [E, H, I]
    experts/down_proj/kernel    [E, I, H]
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import qwix

from models.config import ModelConfig
from models.dense import Dense


def route(logits: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Router logits [N, E] -> (weights f32[N, k], experts i32[N, k]): softmax in float32, the k largest, renormalised
    to sum to one when ``normalize`` (transformers' ``norm_topk_prob``)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


def grouped_swiglu(x: jax.Array, experts: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """Each row of x [N, k, H] through its expert's SwiGLU MLP (experts i32[N, k]; gate, up [E, H, I], down [E, I, H])
    -> [N, k, H], as ragged_dot over the rows sorted by expert."""
    num_tokens, top_k, hidden = x.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = x.reshape(-1, hidden)[order]  # [N * k, H], expert 0's rows first
    sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)
    h = nn.silu(jax.lax.ragged_dot(rows, gate, sizes)) * jax.lax.ragged_dot(rows, up, sizes)
    out = jax.lax.ragged_dot(h, down, sizes)  # [N * k, H], sorted
    return jnp.zeros_like(out).at[order].set(out).reshape(num_tokens, top_k, hidden)


class MoE(nn.Module):
    """x [..., H] -> [..., H]: each token through its ``num_experts_per_tok`` experts, weighted by the router."""

    config: ModelConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        logits = Dense(cfg.num_experts, use_bias=False, dtype=self.dtype, param_dtype=self.dtype, name="gate")(tokens)
        weights, experts = route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        kernels = Experts(cfg, self.dtype, name="experts")()
        routed = jnp.broadcast_to(tokens[:, None, :], (tokens.shape[0], cfg.num_experts_per_tok, shape[-1]))
        out = grouped_swiglu(routed, experts, *kernels)
        # transformers scales each expert's output in the compute dtype, then sums them into the token's row
        out = jnp.sum(out * weights.astype(self.dtype)[..., None], axis=1)
        return out.reshape(shape).astype(self.dtype)


class Experts(nn.Module):
    """The experts' stacked kernels (gate, up, down), dequantized to the compute dtype where quantized."""

    config: ModelConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg = self.config
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        out = []
        for name, shape in (("gate_proj", (e, h, i)), ("up_proj", (e, h, i)), ("down_proj", (e, i, h))):
            value = ExpertKernel(shape, self.dtype, name=name)()
            out.append(qwix.dequantize(value).astype(self.dtype) if isinstance(value, qwix.QArray)
                       else value.astype(self.dtype))
        return tuple(out)


class ExpertKernel(nn.Module):
    """One stacked expert kernel, ``kernel`` [E, in, out] (a module of its own: its path ends in ``<proj>/kernel``
    as a Dense kernel's does)."""

    shape: tuple[int, int, int]
    dtype: jnp.dtype

    @nn.compact
    def __call__(self) -> jax.Array:
        init = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        return self.param("kernel", init, self.shape, self.dtype)
