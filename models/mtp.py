"""Multi-token-prediction (MTP) modules shipped inside a target checkpoint (DeepSeek-V3's MTP structure, as used by
Llama/Qwen2-family models such as XiaomiMiMo/MiMo-7B with ``num_nextn_predict_layers``).

Module k (0-based) at slot p reads the hidden state h of position p (the target's for k = 0 in vanilla MTP, else the
previous module's output) and the token at position p + k + 1, and predicts the token at p + k + 2::

    e      = embed(token)            (the target's embedding; zeroed at position 0, as vLLM and SGLang do)
    fused  = input_proj(concat(hidden_norm(h), token_norm(e)))      layout "mimo" (hidden first)
           = input_proj(concat(token_norm(e), hidden_norm(h)))      layout "deepseek" (embedding first)
    x      = block(fused)            one decoder layer of the target's shapes (its own K/V, rope as the target's)
    logits = lm_head(final_norm(x))  the target's lm_head unless the module stores its own (DeepSeek shared_head)

h for module 0 is the target's last hidden state *before* its final norm (tap ``num_layers`` of
``models.llama.LlamaModel``), as Xiaomi's vLLM fork and upstream vLLM pass it (SGLang passes it after the norm).

Parameter tree of one module (HF names: MiMo ``model.mtp_layers.{k}.*``, DeepSeek ``model.layers.{L + k}.*``)::

    token_norm/weight   [H]        MiMo token_layernorm   DeepSeek enorm
    hidden_norm/weight  [H]        MiMo hidden_layernorm  DeepSeek hnorm
    input_proj/kernel   [2H, H]    MiMo input_proj        DeepSeek eh_proj   (rows in the checkpoint's concat order)
    block/...                      a models.llama.DecoderLayer: input_layernorm, self_attn, post_attention_layernorm, mlp
    final_norm/weight   [H]        MiMo final_layernorm   DeepSeek shared_head.norm
    lm_head/kernel      [H, V]     optional: DeepSeek shared_head.head when stored and not the target's
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.attention import AttentionFn, KVCache, dense_attention
from models.config import ModelConfig
from models.dense import Dense
from models.llama import DecoderLayer, RMSNorm, rope_cos_sin
from models.random_params import cached_shapes, random_params

MTP_LAYOUTS = ("mimo", "deepseek")


@dataclasses.dataclass(frozen=True)
class MtpConfig:
    """layer: the module block's shapes (the target's, num_layers 1); num_modules: ``num_nextn_predict_layers``;
    layout: "mimo" (concat hidden first) or "deepseek" (concat embedding first)."""

    layer: ModelConfig
    num_modules: int
    layout: str = "mimo"

    def __post_init__(self):
        if not isinstance(self.num_modules, int) or self.num_modules < 1:
            raise ValueError(f"MtpConfig.num_modules={self.num_modules!r}: expected an integer >= 1")
        if self.layout not in MTP_LAYOUTS:
            raise ValueError(f"MtpConfig.layout={self.layout!r}: expected one of {MTP_LAYOUTS}")
        if self.layer.num_layers != 1:
            raise ValueError(f"MtpConfig.layer.num_layers={self.layer.num_layers}: an MTP module's block is one "
                             f"decoder layer")

    @classmethod
    def for_target(cls, target: ModelConfig, num_modules: int, layout: str = "mimo") -> "MtpConfig":
        """The modules of ``target``: blocks of the target's shapes (a mixture of experts where the target's later
        layers have one: DeepSeek-V3's module is a sparse layer whatever its dense first layers)."""
        return cls(dataclasses.replace(target, num_layers=1, first_dense_layers=0), num_modules, layout)

    def check_target(self, target: ModelConfig) -> None:
        """ValueError naming the sizes when these modules cannot draft for ``target``."""
        if self.layer.hidden_size != target.hidden_size or self.layer.vocab_size != target.vocab_size:
            raise ValueError(f"MTP modules of hidden size {self.layer.hidden_size} and vocabulary "
                             f"{self.layer.vocab_size} cannot draft for a target of hidden size {target.hidden_size} "
                             f"and vocabulary {target.vocab_size}")


class MtpOutput(NamedTuple):
    x: jax.Array       # [B, T, H] the block's output before final_norm: the hidden state fed to the next module/depth
    normed: jax.Array  # [B, T, H] final_norm(x); logits = normed @ lm_head kernel (the caller's)
    cache: KVCache     # one layer: [1, B, S, Hkv, D]


class MtpModule(nn.Module):
    """One MTP module. Call: embeds [B, T, H] (the target's embedding of the tokens read), hidden [B, T, H] (the
    hidden state paired with them), positions i32[B, T] (rope positions; the embedding is zeroed where 0), cache
    (one layer), cache_len i32[B], local_mask bool[B, T, W] | None, write_offset (models/attention.py) -> MtpOutput.
    The lm_head is not applied here (it is usually the target's)."""

    config: MtpConfig
    dtype: jnp.dtype = jnp.float32
    attention_fn: AttentionFn = dense_attention

    @nn.compact
    def __call__(self, embeds: jax.Array, hidden: jax.Array, positions: jax.Array, cache: KVCache,
                 cache_len: jax.Array, local_mask: jax.Array | None = None,
                 write_offset: jax.Array | int = 0) -> MtpOutput:
        cfg = self.config.layer
        embeds = jnp.where((positions == 0)[..., None], jnp.zeros((), self.dtype), embeds.astype(self.dtype))
        token = RMSNorm(cfg.rms_norm_eps, self.dtype, name="token_norm")(embeds)
        state = RMSNorm(cfg.rms_norm_eps, self.dtype, name="hidden_norm")(hidden.astype(self.dtype))
        parts = [state, token] if self.config.layout == "mimo" else [token, state]
        fused = Dense(cfg.hidden_size, use_bias=False, dtype=self.dtype, param_dtype=self.dtype,
                         name="input_proj")(jnp.concatenate(parts, axis=-1))
        rope = rope_cos_sin(positions, cfg.rope_inv_freq(), self.dtype, cfg.rope_attention_scaling())
        (x, _), (k, v) = DecoderLayer(cfg, self.attention_fn, self.dtype, name="block")(
            (fused, None), (cache.k[0], cache.v[0], None, None, False), (rope,), cache_len, local_mask, write_offset)
        normed = RMSNorm(cfg.rms_norm_eps, self.dtype, name="final_norm")(x)
        return MtpOutput(x, normed, KVCache(k[None], v[None]))


@cached_shapes
def mtp_param_shapes(config: MtpConfig, dtype=jnp.float32) -> dict:
    """{"modules": (module tree, ...)} of ``config.num_modules`` modules as ``jax.ShapeDtypeStruct`` leaves."""
    cfg = config.layer
    module = MtpModule(config, dtype)

    def init():
        x = jnp.zeros((1, 1, cfg.hidden_size), dtype)
        cache = KVCache.for_model(cfg, 1, 1, dtype)
        zeros = jnp.zeros((1, 1), jnp.int32)
        return module.init(jax.random.key(0), x, x, zeros, cache, jnp.zeros((1,), jnp.int32))["params"]

    one = jax.eval_shape(init)
    return {"modules": (one,) * config.num_modules}


def init_mtp_params(config: MtpConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random parameters of ``config.num_modules`` modules -> {"modules": (module tree, ...)} (tests; see
    ``models/random_params.py``): every module its own draws."""
    return random_params(mtp_param_shapes(config, dtype), key)
