"""MtpModule against an independent torch oracle of the models/mtp.py formula: transformers' Qwen2/Llama decoder
layer with the module's block weights, torch norms and linear, for both concat layouts, the embedding zeroed at
position 0; and a cached continuation equals the full pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, Qwen2Config
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

from models.attention import KVCache
from models.config import ModelConfig
from models.mtp import MtpConfig, MtpModule, init_mtp_params

SIZES = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4, num_kv_heads=2,
             head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0)
HF_SIZES = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, attn_implementation="eager")
# layout -> (block config, HF decoder layer, HF rotary, HF config): MiMo is Qwen2 (q/k/v bias), DeepSeek's here Llama
CASES = {
    "mimo": (ModelConfig(**SIZES, qkv_bias=True, model_type="qwen2"), Qwen2DecoderLayer, Qwen2RotaryEmbedding,
             Qwen2Config(**HF_SIZES)),
    "deepseek": (ModelConfig(**SIZES), LlamaDecoderLayer, LlamaRotaryEmbedding, LlamaConfig(**HF_SIZES)),
}


def varied_params(config: MtpConfig, seed: int) -> dict:
    """Random module params with non-trivial norm weights (ones would hide a swapped norm)."""
    params = init_mtp_params(config, jax.random.key(seed))["modules"][0]
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    return jax.tree.unflatten(treedef, [a + 0.3 * jax.random.normal(k, a.shape) if a.ndim == 1 else a
                                        for a, k in zip(leaves, keys)])


def t(x) -> torch.Tensor:
    return torch.tensor(np.asarray(x, np.float32))


def rms_norm(x: torch.Tensor, weight, eps: float) -> torch.Tensor:
    return t(weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def torch_oracle(layout, params, embeds, hidden, positions):
    """The docstring formula in torch -> (x, final_norm(x)) as numpy, causal over the T tokens."""
    block_config, layer_cls, rotary_cls, hf_config = CASES[layout]
    eps = block_config.rms_norm_eps
    layer = layer_cls(hf_config, layer_idx=0).eval()
    state = {}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        state[f"self_attn.{name}.weight"] = t(params["block"]["self_attn"][name]["kernel"]).T
        if "bias" in params["block"]["self_attn"][name]:
            state[f"self_attn.{name}.bias"] = t(params["block"]["self_attn"][name]["bias"])
    for name in ("gate_proj", "up_proj", "down_proj"):
        state[f"mlp.{name}.weight"] = t(params["block"]["mlp"][name]["kernel"]).T
    for name in ("input_layernorm", "post_attention_layernorm"):
        state[f"{name}.weight"] = t(params["block"][name]["weight"])
    layer.load_state_dict(state, strict=True)
    e = t(embeds) * (t(positions) != 0).unsqueeze(-1).float()  # zeroed at position 0
    e = rms_norm(e, params["token_norm"]["weight"], eps)
    h = rms_norm(t(hidden), params["hidden_norm"]["weight"], eps)
    concat = torch.cat([h, e] if layout == "mimo" else [e, h], dim=-1)
    fused = concat @ t(params["input_proj"]["kernel"])
    position_ids = torch.tensor(np.asarray(positions), dtype=torch.long)
    cos, sin = rotary_cls(hf_config)(fused, position_ids)
    length = fused.shape[1]
    causal = torch.full((length, length), float("-inf")).triu(1)[None, None].expand(fused.shape[0], 1, -1, -1)
    with torch.no_grad():
        x = layer(fused, attention_mask=causal, position_ids=position_ids, position_embeddings=(cos, sin))
        normed = rms_norm(x, params["final_norm"]["weight"], eps)
    return x.numpy(), normed.numpy()


@pytest.mark.parametrize("layout", sorted(CASES))
def test_module_matches_torch_oracle(layout):
    block_config = CASES[layout][0]
    config = MtpConfig(block_config, 1, layout)
    params = varied_params(config, 3)
    batch, length, width = 2, 7, 32
    keys = jax.random.split(jax.random.key(5), 2)
    embeds = jax.random.normal(keys[0], (batch, length, width))
    hidden = 3.0 * jax.random.normal(keys[1], (batch, length, width))
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    positions = positions.at[1].add(4)  # row 1 starts at position 4: nothing zeroed there
    cache = KVCache.zeros(1, batch, 12, block_config.num_kv_heads, block_config.head_dim, jnp.float32)
    out = MtpModule(config).apply({"params": params}, embeds, hidden, positions, cache,
                                  jnp.zeros((batch,), jnp.int32))
    x, normed = torch_oracle(layout, params, embeds, hidden, positions)
    np.testing.assert_allclose(np.asarray(out.x), x, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(out.normed), normed, rtol=2e-5, atol=2e-5)
    # the zeroing is real: row 0's position-0 output differs from one computed with the embedding kept
    kept, _ = torch_oracle(layout, params, embeds, hidden, positions + 1)
    assert not np.allclose(kept[0, 0], x[0, 0], atol=1e-3)


def test_cached_continuation_equals_one_pass():
    """Three tokens after a four-token prefix, through the cache, equal the last three rows of one pass."""
    config = MtpConfig(CASES["mimo"][0], 1, "mimo")
    params = varied_params(config, 4)
    keys = jax.random.split(jax.random.key(6), 2)
    embeds, hidden = jax.random.normal(keys[0], (1, 7, 32)), jax.random.normal(keys[1], (1, 7, 32))
    positions = jnp.arange(7, dtype=jnp.int32)[None]
    cache = KVCache.zeros(1, 1, 9, 2, 8, jnp.float32)
    cache = cache._replace(v=cache.v.at[:, :, 7:].set(jnp.nan))  # garbage past the tokens must not be read
    module = MtpModule(config)
    full = module.apply({"params": params}, embeds, hidden, positions, cache, jnp.zeros((1,), jnp.int32))
    first = module.apply({"params": params}, embeds[:, :4], hidden[:, :4], positions[:, :4], cache,
                         jnp.zeros((1,), jnp.int32))
    rest = module.apply({"params": params}, embeds[:, 4:], hidden[:, 4:], positions[:, 4:], first.cache,
                        jnp.full((1,), 4, jnp.int32))
    np.testing.assert_allclose(np.asarray(rest.x), np.asarray(full.x[:, 4:]), rtol=1e-5, atol=1e-5)
