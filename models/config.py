"""Model configuration: one frozen dataclass for every Llama-family decoder, built from a HF config.json.

Supported Hugging Face architectures and what each adds to plain Llama:

| model_type | architectures                          | difference                                  |
|------------|----------------------------------------|---------------------------------------------|
| llama      | LlamaForCausalLM (Llama 2, Llama 3.x)  | rope_scaling type "llama3" (3.1+), GQA      |
| mistral    | MistralForCausalLM                     | sliding window (must not bind: see below)   |
| qwen2      | Qwen2ForCausalLM (Qwen2, Qwen2.5)      | bias on q/k/v projections                   |
| qwen3      | Qwen3ForCausalLM                       | RMSNorm on q and k per head, before rope    |
| mimo       | MiMoForCausalLM (XiaomiMiMo/MiMo-7B)   | Qwen2 (q/k/v bias) + MTP modules (below)    |
| qwen3_moe  | Qwen3MoeForCausalLM (Qwen3-30B-A3B,    | Qwen3 with a mixture of experts in place of |
|            | Qwen3-235B-A22B, Qwen3-Coder-30B-A3B)  | every MLP (models/moe.py)                   |
| gpt_oss    | GptOssForCausalLM (gpt-oss-20b/120b)   | experts with biases and a clamped SwiGLU,   |
|            |                                        | attention sinks, sliding and full layers    |
|            |                                        | alternating, biases on q/k/v/o, yarn rope   |
| gemma3_text| Gemma3ForCausalLM (Gemma-3 1B; the     | five sliding layers (local rope base) to    |
| (gemma3)   | language model of 4B/12B/27B's image-  | one full, norms before and after attention  |
|            | text checkpoints, text prompts only)   |                                             |
|            |                                        | and MLP, (1 + w) RMSNorm, scaled embeddings,|
|            |                                        | GELU (tanh), query_pre_attn_scalar          |

Any family may ship multi-token-prediction modules (config.json ``num_nextn_predict_layers``, tensors
``model.mtp_layers.*`` or ``model.layers.{L + k}.*``): the target is the decoder above; the converter writes the
modules beside it (models/mtp.py, models/checkpoint/mtp_layouts.py).

A sliding window binds: a layer of type "sliding_attention" (``layer_types``; every layer when a Mistral config
gives ``sliding_window`` alone) reads only the keys less than ``sliding_window`` positions behind each query, in
every attention path (``models.attention.AttentionFn``'s ``window``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import numpy as np

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mimo", "qwen3_moe", "gpt_oss", "gemma3_text",
                         "deepseek_v3")
LAYER_TYPES = ("full_attention", "sliding_attention")
QKV_BIAS_MODEL_TYPES = ("qwen2", "mimo")  # Qwen2 and its descendants: bias on q/k/v always, never on o
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rope frequency scaling. ``rope_type`` "default" (none), "linear", "llama3" (Llama 3.1+) or "yarn" (Qwen3's
    long context, gpt-oss, DeepSeek: ``beta_fast``, ``beta_slow``, ``truncate`` and the cos/sin scale
    ``attention_factor``, or where absent the one ``mscale`` and ``mscale_all_dim`` give)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder; hashable, so it can be a static argument under jit."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # A mixture of experts in place of every layer's MLP (num_experts 0: the dense MLP), models/moe.py.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # How a mesh holds the experts (not the model's, the engine's: SpecEngine(enable_expert_parallel=True)): False,
    # a slice of every expert on each "model" device; True, whole experts split over "data" too (vLLM's EP).
    expert_parallel: bool = False
    # Per layer "full_attention" or "sliding_attention" (gpt-oss, Gemma-3); () with a sliding_window: every layer slides
    layer_types: tuple[str, ...] = ()
    attention_sinks: bool = False        # gpt-oss: a learned logit per head in every softmax's denominator
    moe_bias: bool = False               # gpt-oss: biases on the router and on every expert's projections
    expert_activation: str = "silu"      # "silu" (SwiGLU) or "clamped_swiglu" (gpt-oss, swiglu_alpha/swiglu_limit)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # Gemma-3
    hidden_act: str = "silu"             # the dense MLP's: "silu" or "gelu_pytorch_tanh"
    norm_weight_offset: float = 0.0      # RMSNorm scales by (offset + w): Gemma's 1
    sandwich_norms: bool = False         # norms after attention and around the MLP too (Gemma-3)
    embedding_multiplier: float = 1.0    # embeddings times this (Gemma: sqrt(hidden_size))
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (None: head_dim ** -0.5)
    local_rope_theta: float | None = None       # sliding layers' rope base, default rope (Gemma-3); None: as full
    # DeepSeek-V3: multi-head latent attention (models/mla.py) where kv_lora_rank > 0; head_dim is then the rope
    # part of a query/key head (qk_rope_head_dim), and the cache holds kv_lora_rank + head_dim per token
    kv_lora_rank: int = 0
    q_lora_rank: int = 0                 # 0: queries by one projection (q_proj), else q_a_proj, norm, q_b_proj
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False        # rope on interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's layout)
    # DeepSeek-V3's routing: sigmoid scores plus a correction bias choose (within the best groups), the scores weigh
    router_scoring: str = "softmax"      # "softmax" or "sigmoid"
    router_groups: int = 1               # n_group: experts in groups, the best topk_group groups searched
    router_topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_size: int = 0          # width of the shared experts' MLP beside the routed ones (0: none)
    first_dense_layers: int = 0          # first_k_dense_replace: these layers have the dense MLP, not experts

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name}={value!r}: expected a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim}: rotary embeddings need an even head_dim")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type={self.model_type!r}: expected one of {SUPPORTED_MODEL_TYPES}")
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts
                                     and self.moe_intermediate_size > 0):
            raise ValueError(f"num_experts={self.num_experts}, num_experts_per_tok={self.num_experts_per_tok}, "
                             f"moe_intermediate_size={self.moe_intermediate_size}: expected 0 < experts per token "
                             f"<= experts and a positive expert width")
        if self.layer_types and (len(self.layer_types) != self.num_layers
                                 or not set(self.layer_types) <= set(LAYER_TYPES)):
            raise ValueError(f"layer_types={list(self.layer_types)}: expected {self.num_layers} entries, each one of "
                             f"{LAYER_TYPES}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError(f"layer_types has sliding layers but sliding_window={self.sliding_window!r}: expected a "
                             f"positive window")
        if self.expert_activation not in ("silu", "clamped_swiglu"):
            raise ValueError(f"expert_activation={self.expert_activation!r}: expected 'silu' or 'clamped_swiglu'")
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden_act={self.hidden_act!r}: expected 'silu' or 'gelu_pytorch_tanh'")
        if self.kv_lora_rank and (self.qk_nope_head_dim < 1 or self.v_head_dim < 1):
            raise ValueError(f"kv_lora_rank={self.kv_lora_rank} with qk_nope_head_dim={self.qk_nope_head_dim}, "
                             f"v_head_dim={self.v_head_dim}: latent attention needs both positive")
        if self.router_scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"router_scoring={self.router_scoring!r}: expected 'softmax' or 'sigmoid'")
        if self.num_experts and (self.num_experts % self.router_groups
                                 or not 1 <= self.router_topk_groups <= self.router_groups):
            raise ValueError(f"router_groups={self.router_groups}, router_topk_groups={self.router_topk_groups}: "
                             f"expected groups dividing num_experts={self.num_experts} and 1 <= topk_groups <= groups")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (keys less than this many positions behind a query), None if it
        attends to everything."""
        if not self.sliding_window:
            return None
        if not self.layer_types or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def layer_rope(self, layer: int) -> tuple[float, bool]:
        """(rope base, whether the configured rope_scaling applies) of layer ``layer``: Gemma-3's sliding layers
        turn at ``local_rope_theta`` without scaling, every other layer at ``rope_theta`` with it."""
        if self.local_rope_theta is not None and self.layer_window(layer) is not None:
            return self.local_rope_theta, False
        return self.rope_theta, True

    @property
    def attention_scale(self) -> float:
        if self.mla:  # over the whole query head (no-rope and rope parts), times yarn's mscale squared (DeepSeek)
            scale = (self.qk_nope_head_dim + self.head_dim) ** -0.5
            scaling = self.rope_scaling
            if scaling.rope_type == "yarn" and scaling.mscale_all_dim:
                scale *= _yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2
            return scale
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V3; ``models/mla.py``)."""
        return self.kv_lora_rank > 0

    @property
    def kv_cache_heads(self) -> int:
        """Heads of the K/V cache: the KV heads, or MLA's one latent shared by every head."""
        return 1 if self.mla else self.num_kv_heads

    @property
    def kv_cache_dims(self) -> tuple[int, int]:
        """(K, V) width per cache head: head_dim each; MLA's latent (kv_lora_rank + the rope part) in K and no V
        (the latent serves as both)."""
        return (self.kv_lora_rank + self.head_dim, 0) if self.mla else (self.head_dim, self.head_dim)

    @property
    def uniform_layers(self) -> bool:
        """Whether every layer has the same parameters (stored stacked, runnable under nn.scan); DeepSeek's dense
        first layers are not."""
        return not (self.num_experts and self.first_dense_layers)

    def layer_has_experts(self, layer: int) -> bool:
        return bool(self.num_experts) and layer >= self.first_dense_layers

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def check_max_seq_len(self, max_seq_len: int) -> None:
        """Refuses a ``max_seq_len`` this model cannot serve: past ``max_position_embeddings``, the positions it
        was trained on (times the factor of linear rope scaling, whose configs keep the original length there;
        llama3 configs already give the scaled one)."""
        limit, what = self.max_position_embeddings, f"max_position_embeddings={self.max_position_embeddings}"
        if self.rope_scaling.rope_type == "linear":
            limit = int(limit * self.rope_scaling.factor)
            what += f" x linear rope_scaling factor={self.rope_scaling.factor} = {limit}"
        if max_seq_len > limit:
            raise ValueError(f"max_seq_len={max_seq_len} exceeds the model's {what}")

    def rope_inv_freq(self, layer: int | None = None) -> np.ndarray:
        """f32[head_dim // 2] inverse frequencies, with the configured scaling (numpy: trace-time constant); of layer
        ``layer`` where layers differ (:meth:`layer_rope`)."""
        dim = self.head_dim
        base, scaled = (self.rope_theta, True) if layer is None else self.layer_rope(layer)
        inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        if not scaled:
            return inv_freq.astype(np.float32)
        scaling = self.rope_scaling
        if scaling.rope_type == "linear":
            inv_freq = inv_freq / scaling.factor
        elif scaling.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif scaling.rope_type == "yarn":
            inv_freq = _yarn_inv_freq(inv_freq, scaling, self.rope_theta, dim)
        return inv_freq.astype(np.float32)

    def rope_attention_scaling(self, layer: int | None = None) -> float:
        """The factor cos and sin are scaled by (yarn's attention factor; 1 otherwise)."""
        scaling = self.rope_scaling
        if scaling.rope_type != "yarn" or (layer is not None and not self.layer_rope(layer)[1]):
            return 1.0
        if scaling.attention_factor is not None:
            return float(scaling.attention_factor)
        if scaling.mscale and scaling.mscale_all_dim:
            return _yarn_mscale(scaling.factor, scaling.mscale) / _yarn_mscale(scaling.factor, scaling.mscale_all_dim)
        return _yarn_mscale(scaling.factor)

    def to_json_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        data = dict(data)
        data["rope_scaling"] = RopeScaling(**data.get("rope_scaling", {}))
        data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
        data["layer_types"] = tuple(data.get("layer_types", ()))
        return cls(**data)


def _llama3_inv_freq(inv_freq: np.ndarray, scaling: RopeScaling) -> np.ndarray:
    """Llama 3.1 rope scaling: long wavelengths divided by ``factor``, short kept, smooth in between."""
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(inv_freq: np.ndarray, scaling: RopeScaling, base: float, dim: int) -> np.ndarray:
    """YaRN (arXiv 2309.00071): frequencies that turn fewer than ``beta_slow`` times over the original context are
    interpolated (divided by ``factor``), those turning more than ``beta_fast`` times kept, a linear ramp between."""
    def correction_dim(rotations):
        turns = scaling.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(turns) / (2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return inv_freq / scaling.factor * (1 - extrapolation) + inv_freq * extrapolation


def rope_scaling_from_hf(hf: dict[str, Any]) -> RopeScaling:
    """The RoPE scaling of a Hugging Face ``config.json`` (``rope_scaling``, or transformers >= 5's
    ``rope_parameters``); ValueError naming an unsupported ``rope_type``."""
    raw = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not raw:
        return RopeScaling()
    rope_type = raw.get("rope_type", raw.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type={rope_type!r} is not supported; expected one of "
                         f"{SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return RopeScaling()
    factor = raw.get("factor")
    original = raw.get("original_max_position_embeddings", 8192)
    if factor is None and rope_type == "yarn":  # DeepSeek-V3: the ratio of the context to the pretrained one
        factor = hf["max_position_embeddings"] / original
    optional = {name: float(raw[name]) for name in ("attention_factor", "mscale", "mscale_all_dim")
                if raw.get(name) is not None}
    return RopeScaling(
        rope_type=rope_type,
        factor=float(1.0 if factor is None else factor),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original),
        beta_fast=float(raw.get("beta_fast") or 32.0),
        beta_slow=float(raw.get("beta_slow") or 1.0),
        truncate=bool(raw.get("truncate", True)),
        **optional,
    )


def rope_theta_from_hf(hf: dict[str, Any]) -> float:
    """The RoPE base of a Hugging Face ``config.json`` (transformers >= 5 may nest it inside ``rope_parameters``)."""
    params = hf.get("rope_parameters") or {}
    return float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def from_hf_config(hf: dict[str, Any]) -> ModelConfig:
    """Builds a :class:`ModelConfig` from the dict of a Hugging Face ``config.json``.

    Raises ValueError naming the field for unsupported architectures, rope types or missing sizes.
    """
    if hf.get("model_type") == "gemma3":  # Gemma3ForConditionalGeneration: its language model (vision refused)
        hf = gemma3_text_config(hf)
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"config.json model_type={model_type!r} (architectures={hf.get('architectures')}) is "
                         f"not supported; expected one of {SUPPORTED_MODEL_TYPES}")
    if model_type == "gemma3_text":  # transformers fills what Gemma-3's config.json leaves out with these
        hf = {**GEMMA3_TEXT_DEFAULTS, **{k: v for k, v in hf.items() if v is not None or k not in GEMMA3_TEXT_DEFAULTS}}
    family = {"qwen3_moe": _moe_fields, "gpt_oss": _gpt_oss_fields, "gemma3_text": _gemma3_fields,
              "deepseek_v3": _deepseek_v3_fields}
    extra = family[model_type](hf) if model_type in family else {}
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        value = hf.get(field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"config.json {field}={value!r}: a {model_type} model needs a positive integer")
    num_heads = int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
    if model_type == "deepseek_v3":  # the rope part of a head (transformers' DeepseekV3Config.head_dim)
        head_dim = hf["qk_rope_head_dim"]
    # HF Llama and Qwen3 put attention_bias on q/k/v/o; Qwen2 (and MiMo) always bias q/k/v only; Mistral has none.
    attention_bias = model_type in ("llama", "qwen3", "qwen3_moe", "gpt_oss", "gemma3_text") and bool(
        hf.get("attention_bias", model_type == "gpt_oss"))
    sliding_window = hf.get("sliding_window")
    if model_type in QKV_BIAS_MODEL_TYPES + ("qwen3", "qwen3_moe") and not hf.get("use_sliding_window", False):
        sliding_window = None
    rope = hf
    if model_type == "gemma3_text":  # the full layers' rope (the sliding ones': local_rope_theta)
        rope = _gemma3_global_rope(hf)
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta_from_hf(rope),
        rope_scaling=rope_scaling_from_hf(rope),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", model_type == "gemma3_text")),
        qkv_bias=model_type in QKV_BIAS_MODEL_TYPES or attention_bias,
        o_bias=attention_bias,
        mlp_bias=model_type == "llama" and bool(hf.get("mlp_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
        sliding_window=int(sliding_window) if sliding_window else None,
        layer_types=_layer_types(hf, model_type, sliding_window),
        model_type=model_type,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_ids(hf.get("eos_token_id")),
        **extra,
    )


# Gemma3TextConfig's defaults (transformers), which the Hub's Gemma-3 configs rely on (gemma-3-4b's text_config
# gives neither vocab_size nor head_dim)
GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
                        "max_position_embeddings": 131_072, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                        "bos_token_id": 2, "eos_token_id": 1, "hidden_activation": "gelu_pytorch_tanh"}


def gemma3_text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config.json fields of a Gemma-3 image-text checkpoint (model_type "gemma3": 4B, 12B,
    27B): its ``text_config``, with the top level's token ids and embedding tying where the text config lacks them.
    The vision tower is not run: its tensors are left unread on conversion (text prompts only)."""
    text = dict(hf.get("text_config") or {})
    if not text:
        raise ValueError("config.json model_type='gemma3' without a text_config: expected "
                         "Gemma3ForConditionalGeneration's")
    for key in ("bos_token_id", "eos_token_id", "tie_word_embeddings"):
        if text.get(key) is None and hf.get(key) is not None:
            text[key] = hf[key]
    return {**text, "model_type": "gemma3_text"}


def _layer_types(hf: dict[str, Any], model_type: str, sliding_window: int | None) -> tuple[str, ...]:
    """Which layers slide: config.json ``layer_types``, or what transformers derives where it is absent (Qwen2/3:
    layers from ``max_window_layers`` on; gpt-oss: every other one from the first; Gemma-3: all but every
    ``sliding_window_pattern``-th); () where every layer is alike (Mistral: all slide)."""
    layers = int(hf["num_hidden_layers"])
    if not sliding_window:
        return ()
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    if model_type in QKV_BIAS_MODEL_TYPES + ("qwen3", "qwen3_moe"):
        first = int(hf.get("max_window_layers", 28))
        return tuple("sliding_attention" if i >= first else "full_attention" for i in range(layers))
    if model_type == "gpt_oss":
        return tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers))
    if model_type == "gemma3_text":
        pattern = int(hf.get("sliding_window_pattern", 6))
        return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers))
    return ()


def _gpt_oss_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss: every layer's MLP a mixture of ``num_local_experts`` experts of width ``intermediate_size``, routed
    by a biased top-k (softmax over the k logits: transformers' ``GptOssTopKRouter``, which equals softmax, top-k,
    renormalise), experts with biases and the clamped SwiGLU, a sink per attention head."""
    experts = hf.get("num_local_experts", hf.get("num_experts"))
    fields = {"num_experts": experts, "num_experts_per_tok": hf.get("num_experts_per_tok"),
              "moe_intermediate_size": hf.get("intermediate_size")}
    for name, value in fields.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"config.json {name}={value!r}: a gpt_oss model needs a positive integer")
    return dict(fields, norm_topk_prob=True, moe_bias=True, attention_sinks=True, expert_activation="clamped_swiglu",
                swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)), swiglu_limit=float(hf.get("swiglu_limit", 7.0)))


def _gemma3_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma-3's text decoder; ValueError naming what jspec does not run (logit soft-capping, bidirectional
    attention)."""
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(name) is not None:
            raise ValueError(f"config.json {name}={hf[name]!r}: soft-capping is not supported (Gemma-3 has none); "
                             f"expected null")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("config.json use_bidirectional_attention=true: jspec decodes causally; expected false")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"config.json hidden_activation={act!r}: expected 'gelu_pytorch_tanh'")
    local = (hf.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"config.json rope_parameters.sliding_attention.rope_type={local['rope_type']!r}: expected "
                         f"'default'")
    return {"hidden_act": "gelu_pytorch_tanh", "norm_weight_offset": 1.0, "sandwich_norms": True,
            "embedding_multiplier": float(hf["hidden_size"]) ** 0.5,
            "query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar", 256)),
            "local_rope_theta": float(local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0)))}


def _gemma3_global_rope(hf: dict[str, Any]) -> dict[str, Any]:
    """The full-attention layers' rope fields of a Gemma-3 config, as a flat config dict: transformers >= 5 nests
    them under ``rope_parameters.full_attention``; 4.x gives ``rope_theta`` (default 1e6) and ``rope_scaling``."""
    nested = (hf.get("rope_parameters") or {}).get("full_attention")
    if nested is not None:
        return {"rope_parameters": nested, "max_position_embeddings": hf.get("max_position_embeddings", 4096)}
    return {"rope_theta": hf.get("rope_theta", 1_000_000.0), "rope_scaling": hf.get("rope_scaling"),
            "max_position_embeddings": hf.get("max_position_embeddings", 4096)}


def _deepseek_v3_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's multi-head latent attention and mixture of experts (sigmoid scores with a correction bias,
    group-limited top-k, shared experts, dense first layers); ValueError naming what jspec does not run."""
    sizes = {name: hf.get(name) for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                                             "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")}
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"config.json {name}={value!r}: a deepseek_v3 model needs a positive integer")
    if hf.get("attention_bias"):
        raise ValueError("config.json attention_bias=true: DeepSeek-V3's attention has no biases; expected false")
    for name, expected in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("hidden_act", "silu")):
        if hf.get(name, expected) != expected:
            raise ValueError(f"config.json {name}={hf[name]!r}: expected {expected!r} (DeepSeek-V3's)")
    return {"kv_lora_rank": sizes["kv_lora_rank"], "q_lora_rank": int(hf.get("q_lora_rank") or 0),
            "qk_nope_head_dim": sizes["qk_nope_head_dim"], "v_head_dim": sizes["v_head_dim"],
            "rope_interleave": bool(hf.get("rope_interleave", True)),
            "num_experts": sizes["n_routed_experts"], "num_experts_per_tok": sizes["num_experts_per_tok"],
            "moe_intermediate_size": sizes["moe_intermediate_size"],
            "norm_topk_prob": bool(hf.get("norm_topk_prob", True)), "router_scoring": "sigmoid",
            "router_groups": int(hf.get("n_group") or 1), "router_topk_groups": int(hf.get("topk_group") or 1),
            "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
            "shared_expert_size": int(hf.get("n_shared_experts") or 0) * sizes["moe_intermediate_size"],
            "first_dense_layers": int(hf.get("first_k_dense_replace") or 0)}


def _moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a Qwen3-MoE ``config.json``; ValueError naming a layout jspec does not run
    (some layers dense: ``mlp_only_layers``, ``decoder_sparse_step``; no published Qwen3-MoE has them)."""
    if hf.get("mlp_only_layers"):
        raise ValueError(f"config.json mlp_only_layers={hf['mlp_only_layers']!r}: dense layers among the experts' are "
                         f"not supported; expected []")
    if int(hf.get("decoder_sparse_step", 1)) != 1:
        raise ValueError(f"config.json decoder_sparse_step={hf['decoder_sparse_step']!r}: expected 1 (every layer "
                         f"a mixture of experts)")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json hidden_act={act!r}: expected 'silu'")
    fields = {"num_experts": hf.get("num_experts", hf.get("num_local_experts")),
              "num_experts_per_tok": hf.get("num_experts_per_tok"),
              "moe_intermediate_size": hf.get("moe_intermediate_size")}
    for name, value in fields.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"config.json {name}={value!r}: a qwen3_moe model needs a positive integer")
    return dict(fields, norm_topk_prob=bool(hf.get("norm_topk_prob", False)))


def load_hf_config(model_dir: str | os.PathLike) -> ModelConfig:
    """Reads ``model_dir/config.json`` (Hugging Face format) into a :class:`ModelConfig`."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {os.fspath(model_dir)!r}")
    with open(path) as f:
        return from_hf_config(json.load(f))
