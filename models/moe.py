"""A mixture of experts in place of a decoder layer's MLP (Qwen3-MoE): numerics as transformers'
``Qwen3MoeSparseMoeBlock``, no token dropped.

A router (``gate``, a bias-free linear layer [H, E]) scores every token against the E experts; softmax (float32),
the top ``num_experts_per_tok`` kept, renormalised to sum to one with ``norm_topk_prob``. Each expert is a SwiGLU MLP
of width ``moe_intermediate_size``; a token's output is its experts' outputs weighted by their router scores.

The experts run as grouped matmuls (``jax.lax.ragged_dot``): the N * k (token, expert) assignments sorted by expert,
each expert's rows multiplied by its own weights, the results added back to their tokens (:func:`combine`). On a
mesh each device holds a shard of every expert (tensor parallelism), or with expert parallelism whole experts
(:func:`split_experts`). Every assignment is
computed (no capacity, nothing dropped), so the output is the dense definition's whatever the routing. On a GPU or
TPU ragged_dot is a grouped matmul reading each routed expert's weights once; XLA:CPU computes it densely.

gpt-oss (``moe_bias``, ``expert_activation`` "clamped_swiglu"): the router and every expert projection carry a bias,
and an expert computes ``(clip(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, l)`` (transformers'
``GptOssExperts``; its interleaved ``gate_up_proj`` is split into gate and up by the converter). The router's softmax
over its k largest logits is the softmax over all, top-k, renormalised (``norm_topk_prob``).

Parameters (HF's per-expert tensors stacked on an expert axis; kernels [in, out] as ``models.dense.Dense``'s, so
tensor parallelism splits them as the dense MLP's and weight-only quantization applies)::

    gate/kernel (+bias)                 [H, E] ([E])       router
    experts/gate_proj/kernel (+bias)    [E, H, I] ([E, I])
    experts/up_proj/kernel (+bias)      [E, H, I] ([E, I])
    experts/down_proj/kernel (+bias)    [E, I, H] ([E, H])
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import qwix
from jax.sharding import PartitionSpec as P

from models.config import ModelConfig
from models.dense import Dense
from models.layers import MLP


def route(logits: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Router logits [N, E] -> (weights f32[N, k], experts i32[N, k]): softmax in float32, the k largest, renormalised
    to sum to one when ``normalize`` (transformers' ``norm_topk_prob``)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


def route_sigmoid(logits: jax.Array, correction: jax.Array, top_k: int, groups: int, topk_groups: int,
                  normalize: bool, scale: float) -> tuple[jax.Array, jax.Array]:
    """DeepSeek-V3's router (transformers' ``DeepseekV3TopkRouter``): logits [N, E] -> (weights f32[N, k], experts
    i32[N, k]). Sigmoid scores plus ``correction`` f32[E] choose: the experts fall in ``groups`` groups, each group
    rated by the sum of its two best corrected scores, and the k best experts are taken from the ``topk_groups``
    best groups; the chosen experts' uncorrected scores are the weights, renormalised to sum to one when
    ``normalize``, times ``scale`` (routed_scaling_factor)."""
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores + correction.astype(jnp.float32)
    if groups > 1:
        grouped = choice.reshape(choice.shape[0], groups, -1)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N, groups]
        kept = jax.lax.top_k(group_scores, topk_groups)[1]
        keep = jnp.zeros(group_scores.shape, bool).at[jnp.arange(group_scores.shape[0])[:, None], kept].set(True)
        choice = jnp.where(jnp.repeat(keep, grouped.shape[-1], axis=1), choice, -jnp.inf)
    experts = jax.lax.top_k(choice, top_k)[1]
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * scale, experts


class MoE(nn.Module):
    """x [..., H] -> [..., H]: each token through its ``num_experts_per_tok`` experts, weighted by the router."""

    config: ModelConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        sigmoid = cfg.router_scoring == "sigmoid"  # DeepSeek-V3's router computes in float32
        logits = Dense(cfg.num_experts, use_bias=cfg.moe_bias, dtype=jnp.float32 if sigmoid else self.dtype,
                       param_dtype=self.dtype, name="gate")(tokens)
        if sigmoid:
            correction = self.param("e_score_correction_bias", nn.initializers.zeros, (cfg.num_experts,),
                                    jnp.float32)
            weights, experts = route_sigmoid(logits, correction, cfg.num_experts_per_tok, cfg.router_groups,
                                             cfg.router_topk_groups, cfg.norm_topk_prob, cfg.routed_scaling_factor)
        else:
            weights, experts = route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        kernels, biases = Experts(cfg, self.dtype, name="experts")()
        weights = weights.astype(self.dtype)
        activation = clamped_swiglu(cfg.swiglu_alpha, cfg.swiglu_limit) if cfg.expert_activation != "silu" else swiglu
        if jax.sharding.get_abstract_mesh().empty:
            out = combine(tokens, weights, experts, *kernels, biases=biases[:2], activation=activation)
        else:
            out = split_experts(tokens, weights, experts, kernels, expert_parallel=cfg.expert_parallel,
                                biases=biases[:2], activation=activation)
        if biases[2] is not None:  # each token's experts' down biases, weighted: outside the shards' partial sums
            out = out + jnp.einsum("nk,nkh->nh", weights, biases[2][experts])
        if cfg.shared_expert_size:  # DeepSeek-V3: an MLP every token goes through beside its routed experts
            out = out + MLP(cfg, self.dtype, size=cfg.shared_expert_size, name="shared_experts")(tokens)
        return out.reshape(shape).astype(self.dtype)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return nn.silu(gate) * up


def clamped_swiglu(alpha: float, limit: float):
    """gpt-oss's expert activation (transformers' ``GptOssExperts._apply_gate``)."""
    def activation(gate: jax.Array, up: jax.Array) -> jax.Array:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))

    return activation


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array) -> jax.Array:
    """``jax.lax.ragged_dot``: lhs [M, K]'s consecutive groups of sizes[g] rows times rhs[g] [K, N] -> [M, N] (rows past
    the groups: zero). On a GPU, tokamax's Triton grouped matmul where tokamax is installed (the ``gpu`` extra):
    XLA's GPU lowering multiplies every row by every group (64 rows by 128 experts of 2048 x 768: 25.8 GFLOP
    counted, against 0.2 GFLOP on a TPU, where XLA calls its grouped-matmul kernel)."""
    if _platform() == "gpu":
        try:
            import tokamax
        except ImportError:
            tokamax = None
        if tokamax is not None:
            from absl import flags

            if not flags.FLAGS.is_parsed():  # tokamax would parse sys.argv as absl flags: jspec's or pytest's
                flags.FLAGS.mark_as_parsed()
            return tokamax.ragged_dot(lhs, rhs, sizes, implementation="triton")
    # float32 in full precision; bfloat16 as it comes (TPU's grouped-matmul kernel refuses a float32 contraction of
    # bfloat16 operands, which jax_default_matmul_precision="highest" would ask for)
    precision = jax.lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    return jax.lax.ragged_dot(lhs, rhs, sizes, precision=precision)


def _platform() -> str:
    """The platform being compiled for: the default device's (``jax.default_device``, as ahead-of-time compiles
    set it), else the default backend's."""
    device = jax.config.jax_default_device
    return jax.default_backend() if device is None else device.platform


def combine(tokens: jax.Array, weights: jax.Array, experts: jax.Array, gate: jax.Array, up: jax.Array,
            down: jax.Array, first_expert: jax.Array | int = 0, *, biases: tuple = (None, None),
            activation=swiglu) -> jax.Array:
    """tokens [N, H] through their experts (experts i32[N, k] of weights [N, k]) held here: gate, up [E', H, I'],
    down [E', I', H] are experts first_expert .. first_expert + E' - 1 (a shard's; every expert's by default); the
    others' assignments add nothing -> [N, H] (transformers scales each expert's output in the compute dtype, then
    sums a token's experts). A step of fewer assignments (N * k) than experts gathers the experts they route to and
    multiplies by those alone: the step reads what its tokens use, whatever ragged_dot's lowering reads (XLA's GPU
    lowering multiplies every row by every group). biases: the gate and up projections' [E', I'] (or None);
    activation(gate, up) -> the experts' hidden [rows, I']."""
    num_tokens, top_k = experts.shape
    num_experts, slots = gate.shape[0], num_tokens * top_k
    local = experts - first_expert
    held = (local >= 0) & (local < num_experts)
    flat = jnp.where(held, local, num_experts).reshape(-1)  # assignments elsewhere sort last, past every group
    groups = num_experts
    if slots < num_experts:  # a decode or verify step: only the experts its tokens route to are read
        present = jnp.unique(flat, size=slots, fill_value=num_experts)  # distinct, ascending, then fill
        flat = jnp.where(flat < num_experts, jnp.searchsorted(present, flat), slots)
        pick = jnp.where(present < num_experts, present, present[0])  # a fill reads a routed expert again
        gate, up, down, groups = gate[pick], up[pick], down[pick], slots
        biases = tuple(None if b is None else b[pick] for b in biases)
    order = jnp.argsort(flat, stable=True)
    rows = jnp.repeat(tokens, top_k, axis=0)[order]
    sizes = jnp.bincount(flat, length=groups).astype(jnp.int32)
    group = jnp.minimum(flat[order], groups - 1)  # each sorted row's expert (rows past the groups: discarded)

    def project(kernel, bias):
        out = grouped_matmul(rows, kernel, sizes)
        return out if bias is None else out + bias[group]

    h = activation(project(gate, biases[0]), project(up, biases[1]))
    h = jnp.where((flat[order] < groups)[:, None], h, jnp.zeros((), h.dtype))  # rows elsewhere stay zero
    out = grouped_matmul(h, down, sizes)  # rows past the groups (elsewhere) are zero
    out = jnp.zeros_like(out).at[order].set(out).reshape(num_tokens, top_k, -1)
    return jnp.sum(out * weights[..., None], axis=1)


def split_experts(tokens: jax.Array, weights: jax.Array, experts: jax.Array, kernels: tuple, *,
                  expert_parallel: bool, biases: tuple = (None, None), activation=swiglu) -> jax.Array:
    """:func:`combine` on a ("data", "model") mesh, each device its shard of the experts: every expert's width split
    over "model" (tensor parallelism; the partial sums added over it), and with ``expert_parallel`` the experts
    split over "data" (vLLM's expert parallelism): each device takes every data shard's tokens, runs them through
    its experts, and the sums are added and scattered back to the tokens' own shard."""
    mesh = jax.sharding.get_abstract_mesh()
    rows = P("data", None)
    expert_axis = "data" if expert_parallel else None
    kernel_specs = (P(expert_axis, None, "model"), P(expert_axis, None, "model"), P(expert_axis, "model", None))
    bias_specs = tuple(None if b is None else P(expert_axis, "model") for b in biases)

    def shard(tokens, weights, experts, gate, up, down, biases):
        first = 0
        if expert_parallel:
            tokens, weights, experts = (jax.lax.all_gather(x, "data", axis=0, tiled=True)
                                        for x in (tokens, weights, experts))
            first = jax.lax.axis_index("data") * gate.shape[0]
        out = combine(tokens, weights, experts, gate, up, down, first, biases=biases, activation=activation)
        out = jax.lax.psum(out, "model")
        return jax.lax.psum_scatter(out, "data", scatter_dimension=0, tiled=True) if expert_parallel else out

    return jax.shard_map(shard, mesh=mesh, in_specs=(rows, rows, rows, *kernel_specs, bias_specs), out_specs=rows,
                         check_vma=False)(tokens, weights, experts, *kernels, tuple(biases))


class Experts(nn.Module):
    """The experts' stacked kernels (gate, up, down), dequantized to the compute dtype where quantized, and their
    biases [E, out] (None each without ``moe_bias``)."""

    config: ModelConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self) -> tuple[tuple[jax.Array, ...], tuple[jax.Array | None, ...]]:
        cfg = self.config
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        kernels, biases = [], []
        for name, shape in (("gate_proj", (e, h, i)), ("up_proj", (e, h, i)), ("down_proj", (e, i, h))):
            value, bias = ExpertKernel(shape, cfg.moe_bias, self.dtype, name=name)()
            kernels.append(qwix.dequantize(value).astype(self.dtype) if isinstance(value, qwix.QArray)
                           else value.astype(self.dtype))
            biases.append(bias)
        return tuple(kernels), tuple(biases)


class ExpertKernel(nn.Module):
    """One stacked expert kernel, ``kernel`` [E, in, out], and with ``use_bias`` its ``bias`` [E, out] (a module of
    its own: its path ends in ``<proj>/kernel`` as a Dense kernel's does)."""

    shape: tuple[int, int, int]
    use_bias: bool
    dtype: jnp.dtype

    @nn.compact
    def __call__(self) -> tuple[jax.Array, jax.Array | None]:
        init = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        kernel = self.param("kernel", init, self.shape, self.dtype)
        if not self.use_bias:
            return kernel, None
        bias = self.param("bias", nn.initializers.zeros, (self.shape[0], self.shape[2]), self.dtype)
        return kernel, bias.astype(self.dtype)
