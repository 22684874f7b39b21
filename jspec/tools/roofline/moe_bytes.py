"""What a verify pass costs a mixture-of-experts target in HBM bytes: a step over N tokens reads every expert one of
them routes to, so a verify of T tokens a row reads the union of B * T tokens' experts, where a plain step reads
B tokens' (Qwen3-30B-A3B: 8 of 128 experts a token).

Under uniform, independent routing (each token picks its ``top_k`` experts uniformly without replacement) the
expected number of distinct experts N tokens touch is ``E * (1 - (1 - k / E) ** N)`` (:func:`expected_experts`).
Real routers are skewed and a sequence's tokens route alike, so they touch fewer: these figures are the upper
envelope a trained router stays under, not a measurement. (XLA's cost analysis counts a ``ragged_dot``'s whole
right-hand side, every expert, whatever the routing: it cannot answer this.)

    rows = step_table(from_hf_config(QWEN3_30B_A3B), rows=1, verify_tokens=(1, 4, 8, 16), context=2048)
"""

from __future__ import annotations

import dataclasses

from models.config import ModelConfig


def expected_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts ``tokens`` tokens route to, each to ``top_k`` of ``num_experts`` uniformly."""
    if not 0 < top_k <= num_experts or tokens < 0:
        raise ValueError(f"num_experts={num_experts}, top_k={top_k}, tokens={tokens}: expected 0 < top_k <= "
                         f"num_experts and tokens >= 0")
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


@dataclasses.dataclass(frozen=True)
class StepBytes:
    """HBM bytes one forward pass over ``rows`` rows of ``tokens`` tokens each reads at a ``context``-token KV cache."""

    rows: int
    tokens: int
    experts_read: float  # a layer's, expected
    expert_bytes: float
    other_weight_bytes: int
    kv_bytes: int

    @property
    def total(self) -> float:
        return self.expert_bytes + self.other_weight_bytes + self.kv_bytes


def attention_params(config: ModelConfig) -> int:
    """Parameters of one layer's attention: q/k/v/o, or DeepSeek-V3's latent projections (q_a, q_b, kv_a, kv_b,
    o and their norms)."""
    h, heads = config.hidden_size, config.num_heads
    if not config.mla:
        return h * config.head_dim * (2 * heads + 2 * config.num_kv_heads)
    query = heads * (config.qk_nope_head_dim + config.head_dim)
    q = h * config.q_lora_rank + config.q_lora_rank + config.q_lora_rank * query if config.q_lora_rank else h * query
    kv = h * (config.kv_lora_rank + config.head_dim) + config.kv_lora_rank
    return q + kv + config.kv_lora_rank * heads * (config.qk_nope_head_dim + config.v_head_dim) + \
        heads * config.v_head_dim * h


def kv_values_per_position(config: ModelConfig) -> int:
    """Values one layer's cache holds per position: K and V of every KV head, or MLA's latent and rope key."""
    if config.mla:
        return sum(config.kv_cache_dims)
    return 2 * config.num_kv_heads * config.head_dim


def total_params(config: ModelConfig) -> int:
    """Every weight of the target (every expert of every layer): 671B for DeepSeek-V3, 30.5B for Qwen3-30B-A3B."""
    step = step_bytes(config, 1, 1, 0, bytes_per_param=1.0)
    moe_layers = config.num_layers - config.first_dense_layers
    return int(step.other_weight_bytes + moe_layers * config.num_experts * 3 * config.hidden_size
               * config.moe_intermediate_size)


def step_bytes(config: ModelConfig, rows: int, tokens: int, context: int, bytes_per_param: float = 2.0,
               kv_bytes_per_value: float = 2.0) -> StepBytes:
    """The bytes one step reads: the experts its ``rows * tokens`` tokens route to (:func:`expected_experts`, every
    layer with experts), every other weight once (attention, routers, shared experts, DeepSeek's dense first
    layers' MLPs, norms, embeddings row and lm_head), and each row's KV cache of ``context`` positions (a
    sliding-window layer's last ``sliding_window`` of them; MLA's latents)."""
    if not config.num_experts:
        raise ValueError(f"model_type={config.model_type!r} has no experts (num_experts=0)")
    h, e = config.hidden_size, config.num_experts
    per_expert = 3 * h * config.moe_intermediate_size
    moe_layers = config.num_layers - config.first_dense_layers
    dense_mlps = config.first_dense_layers * 3 * h * config.intermediate_size
    per_moe_layer = h * e + 3 * h * config.shared_expert_size + (e if config.router_scoring == "sigmoid" else 0)
    other = (config.num_layers * (attention_params(config) + 2 * h) + moe_layers * per_moe_layer + dense_mlps
             + config.vocab_size * h + h)
    experts = expected_experts(e, config.num_experts_per_tok, rows * tokens)
    read = sum(min(context, config.layer_window(i) or context) for i in range(config.num_layers))  # positions
    kv = read * kv_values_per_position(config) * rows  # a sliding layer reads its window's positions
    return StepBytes(rows, tokens, experts, moe_layers * experts * per_expert * bytes_per_param,
                     int(other * bytes_per_param), int(kv * kv_bytes_per_value))


def step_table(config: ModelConfig, rows: int, verify_tokens: tuple[int, ...], context: int,
               hbm_bytes_per_second: float | None = None, bytes_per_param: float = 2.0) -> list[dict]:
    """A row per verify width T (T = 1: the plain step): experts a layer reads, bytes, their ratio to the plain
    step's (the acceptance length at which a verify of T breaks even, a free drafter assumed), and the HBM floor;
    weights of ``bytes_per_param`` (1: int8), the KV cache in bf16."""
    plain = step_bytes(config, rows, 1, context, bytes_per_param).total
    table = []
    for tokens in verify_tokens:
        step = step_bytes(config, rows, tokens, context, bytes_per_param)
        row = {"rows": rows, "tokens": tokens, "experts_read": round(step.experts_read, 1),
               "expert_gb": step.expert_bytes / 1e9, "other_weight_gb": step.other_weight_bytes / 1e9,
               "kv_gb": step.kv_bytes / 1e9, "bytes_over_plain": step.total / plain}
        if hbm_bytes_per_second:
            row["hbm_floor_ms"] = 1e3 * step.total / hbm_bytes_per_second
        table.append(row)
    return table
