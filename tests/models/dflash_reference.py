"""A torch reference of z-lab's ``DFlashDraftModel`` forward (z-lab/dflash ``dflash/model.py``), built from
transformers' own Qwen3 pieces (RMSNorm, MLP, rotary embedding, eager attention) with the published model's
attention around them: queries from the block only (q_norm), keys and values from ``[context, block]`` (each
through the layer's k_proj / v_proj, k_norm on both), RoPE of the absolute positions (queries: the last T),
no mask (the block sees all of the context and all of itself). Its state_dict has the publisher's tensor names.

``DSparkReference`` adds DeepSpec's vanilla Markov head (``markov_w1`` an Embedding [V, r], ``markov_w2`` a Linear
r -> V) and confidence head (``proj`` over [h; markov_w1[previous]]), and the frozen embedding / lm_head copies
DeepSpec saves; ``draft_chain`` is its greedy ``sample_block_tokens``: a loop over the block slots, each slot's
token fed to the next slot's Markov bias.
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


class DSparkReference(DFlashReference):
    def __init__(self, config: qwen3.Qwen3Config, num_context_layers: int, markov_rank: int):
        super().__init__(config, num_context_layers)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.markov_head = nn.Module()
        self.markov_head.markov_w1 = nn.Embedding(config.vocab_size, markov_rank)
        self.markov_head.markov_w2 = nn.Linear(markov_rank, config.vocab_size, bias=False)
        self.confidence_head = nn.Module()
        self.confidence_head.proj = nn.Linear(config.hidden_size + markov_rank, 1)

    def draft_chain(self, normed: torch.Tensor, root: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """normed [B, T, H] (every slot drafts), root i64[B] -> (greedy drafts i64[B, T], confidence logits
        [B, T])."""
        previous, tokens, confidence = root, [], []
        for k in range(normed.shape[1]):
            embedded = self.markov_head.markov_w1(previous)
            logits = self.lm_head(normed[:, k]) + self.markov_head.markov_w2(embedded)
            confidence.append(self.confidence_head.proj(torch.cat([normed[:, k], embedded], dim=-1))[:, 0])
            previous = logits.argmax(dim=-1)
            tokens.append(previous)
        return torch.stack(tokens, 1), torch.stack(confidence, 1)
