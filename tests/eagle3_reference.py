"""An independent torch implementation of the EAGLE-3 head forward: the oracle for models/eagle3.py.

Written from the EAGLE reference (``eagle/model/cnets.py``) and SGLang's ``models/llama_eagle3.py``, whose fused
add-RMSNorm calls unroll to::

    residual = fc(features)                       (the first draft position; later ones feed `pre` back)
    h        = attn(cat(input_layernorm(embeds), hidden_norm(residual)))
    residual = h + residual
    h        = mlp(post_attention_layernorm(residual))
    pre      = h + residual                       the hidden state the next draft step reads
    logits   = lm_head(norm(pre))

It runs eager causal attention over a whole sequence (no cache) with transformers' rotary embedding, on a
state_dict that uses the HF names (``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``).
"""

from __future__ import annotations

import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def fuse_features(state_dict: dict[str, torch.Tensor], features: torch.Tensor) -> torch.Tensor:
    """features [B, T, 3 H_target] (the target's three tapped hidden states) -> fc output [B, T, H]."""
    return features @ state_dict["fc.weight"].T


def _attention(state_dict, hf_config: dict, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """x [B, T, 2H] -> causal self-attention output [B, T, H]."""
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    batch, length, _ = x.shape

    def project(name: str, num: int) -> torch.Tensor:  # -> [B, num, T, D]
        weight = state_dict[f"midlayer.self_attn.{name}_proj.weight"]
        return (x @ weight.T).view(batch, length, num, head_dim).transpose(1, 2)

    q, k, v = project("q", heads), project("k", kv_heads), project("v", kv_heads)
    rope = LlamaRotaryEmbedding(config=transformers.LlamaConfig(**hf_config))
    cos, sin = rope(v, position_ids)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = (q @ k.transpose(-1, -2)) * head_dim ** -0.5  # [B, heads, T, T]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    out = torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v  # [B, heads, T, D]
    out = out.transpose(1, 2).reshape(batch, length, heads * head_dim)
    return out @ state_dict["midlayer.self_attn.o_proj.weight"].T


def _mlp(state_dict, x: torch.Tensor) -> torch.Tensor:
    gate = x @ state_dict["midlayer.mlp.gate_proj.weight"].T
    up = x @ state_dict["midlayer.mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ state_dict["midlayer.mlp.down_proj.weight"].T


@torch.no_grad()
def eagle3_forward(state_dict: dict[str, torch.Tensor], hf_config: dict, embeds: torch.Tensor,
                   hidden: torch.Tensor, position_ids: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The head over a whole sequence, every position attending causally to the ones before it.

    embeds [B, T, H]: the target's embedding of the tokens; hidden [B, T, H]: per position, either fc of the
    target features (``fuse_features``) or a previous step's ``pre``; position_ids [B, T] (default 0..T-1).
    Returns (logits [B, T, V_draft], pre [B, T, H]).
    """
    eps = hf_config.get("rms_norm_eps", 1e-6)
    if position_ids is None:
        position_ids = torch.arange(embeds.shape[1])[None].expand(embeds.shape[0], -1)
    residual = hidden
    x = torch.cat([rms_norm(embeds, state_dict["midlayer.input_layernorm.weight"], eps),
                   rms_norm(hidden, state_dict["midlayer.hidden_norm.weight"], eps)], dim=-1)
    residual = _attention(state_dict, hf_config, x, position_ids) + residual
    pre = _mlp(state_dict, rms_norm(residual, state_dict["midlayer.post_attention_layernorm.weight"], eps)) + residual
    logits = rms_norm(pre, state_dict["norm.weight"], eps) @ state_dict["lm_head.weight"].T
    return logits, pre
