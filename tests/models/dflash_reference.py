"""A torch reference of z-lab's ``DFlashDraftModel`` forward (z-lab/dflash ``dflash/model.py``), built from
transformers' own Qwen3 pieces (RMSNorm, MLP, rotary embedding, eager attention) with the published model's
attention around them: queries from the block only (q_norm), keys and values from ``[context, block]`` (each
through the layer's k_proj / v_proj, k_norm on both), RoPE of the absolute positions (queries: the last T),
no mask (the block sees all of the context and all of itself). Its state_dict has the publisher's tensor names.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.qwen3 import modeling_qwen3 as qwen3


class DFlashAttention(nn.Module):
    def __init__(self, config: qwen3.Qwen3Config):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = qwen3.Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = qwen3.Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden, context, cos, sin):
        batch, num, _ = hidden.shape
        heads = (batch, -1, self.head_dim)
        q = self.q_norm(self.q_proj(hidden).view(batch, num, *heads[1:])).transpose(1, 2)
        k = torch.cat([self.k_proj(context), self.k_proj(hidden)], dim=1)
        v = torch.cat([self.v_proj(context), self.v_proj(hidden)], dim=1)
        k = self.k_norm(k.view(batch, k.shape[1], *heads[1:])).transpose(1, 2)
        v = v.view(batch, v.shape[1], *heads[1:]).transpose(1, 2)
        q, _ = qwen3.apply_rotary_pos_emb(q, q, cos[:, -num:], sin[:, -num:])
        k, _ = qwen3.apply_rotary_pos_emb(k, k, cos, sin)
        self.training = False
        out, _ = qwen3.eager_attention_forward(self, q, k, v, None, scaling=self.scaling)
        return self.o_proj(out.reshape(batch, num, -1))


class DFlashLayer(nn.Module):
    def __init__(self, config: qwen3.Qwen3Config):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = qwen3.Qwen3MLP(config)
        self.input_layernorm = qwen3.Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = qwen3.Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden, context, cos, sin):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), context, cos, sin)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashReference(nn.Module):
    """forward(noise_embedding [B, T, H], target_hidden [B, S, n_ctx * H], position_ids [B, S + T]) -> the final
    norm's output [B, T, H]."""

    def __init__(self, config: qwen3.Qwen3Config, num_context_layers: int):
        super().__init__()
        self.fc = nn.Linear(num_context_layers * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = qwen3.Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = qwen3.Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary = qwen3.Qwen3RotaryEmbedding(config)

    def forward(self, noise_embedding, target_hidden, position_ids):
        context = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary(noise_embedding, position_ids)
        hidden = noise_embedding
        for layer in self.layers:
            hidden = layer(hidden, context, cos, sin)
        return self.norm(hidden)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The state dict under the publisher's names (the rotary buffers are not in a checkpoint)."""
        return {name: t.detach().contiguous() for name, t in self.state_dict().items() if not name.startswith("rotary")}
