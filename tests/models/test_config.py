"""ModelConfig from HF config.json: each family's quirks, and clear errors for what we do not support."""

import numpy as np
import pytest
import transformers

from models.config import ModelConfig, from_hf_config
from tests.hf_models import FAMILIES

BASE = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rope_inv_freq_matches_transformers(family):
    hf_config = FAMILIES[family]()
    config = from_hf_config(hf_config.to_dict())
    module = getattr(getattr(transformers.models, family), f"modeling_{family}")
    name = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "qwen3_moe": "Qwen3Moe"}
    rotary = getattr(module, f"{name[family]}RotaryEmbedding")(hf_config)
    np.testing.assert_allclose(config.rope_inv_freq(), rotary.inv_freq.numpy(), rtol=1e-6)
    assert config.rope_attention_scaling() == pytest.approx(rotary.attention_scaling, rel=1e-12)


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
     "mscale": 1.0, "mscale_all_dim": 1.0},  # DeepSeek-V3's (attention factor 1)
    {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
     "beta_slow": 1.0, "truncate": False},  # gpt-oss's
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "attention_factor": 1.2},
])
def test_yarn_matches_transformers(rope):
    hf_config = transformers.Qwen3Config(vocab_size=10, hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
                                         head_dim=64,
                                         max_position_embeddings=131072, rope_theta=150000.0, rope_scaling=rope)
    config = from_hf_config(hf_config.to_dict())
    rotary = transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding(hf_config)
    np.testing.assert_allclose(config.rope_inv_freq(), rotary.inv_freq.numpy(), rtol=1e-6)
    assert config.rope_attention_scaling() == pytest.approx(rotary.attention_scaling, rel=1e-6)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gpt2"}, "model_type='gpt2'"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_type='longrope'"),
    ({"vocab_size": None}, "vocab_size=None"),
    ({"model_type": "qwen3_moe", "num_experts_per_tok": 2, "moe_intermediate_size": 8}, "num_experts=None"),
    ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
      "mlp_only_layers": [0]}, "mlp_only_layers=\\[0\\]"),
    ({"num_key_value_heads": 3, "num_attention_heads": 4, "hidden_size": 8}, "not a multiple"),
])
def test_unsupported_configs_name_the_field(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        from_hf_config({**BASE, **change})


def test_missing_field_named():
    config = dict(BASE)
    del config["intermediate_size"]
    with pytest.raises(ValueError, match="intermediate_size"):
        from_hf_config(config)


def test_sliding_window_refused_only_when_it_binds():
    mistral = from_hf_config({**BASE, "model_type": "mistral", "sliding_window": 256})
    mistral.check_max_seq_len(256)
    with pytest.raises(ValueError, match="sliding_window=256 is shorter than max_seq_len=512"):
        mistral.check_max_seq_len(512)
    qwen = from_hf_config({**BASE, "model_type": "qwen2", "sliding_window": 16, "use_sliding_window": False})
    assert qwen.sliding_window is None


def test_max_seq_len_beyond_max_position_embeddings_refused_naming_both():
    config = from_hf_config({**BASE, "max_position_embeddings": 2048})
    config.check_max_seq_len(2048)
    with pytest.raises(ValueError, match="max_seq_len=2049 exceeds the model's max_position_embeddings=2048$"):
        config.check_max_seq_len(2049)


def test_linear_rope_scaling_stretches_the_positions():
    """HF linear-scaled configs keep the original max_position_embeddings (e.g. 4096 x factor 4 for 16k)."""
    config = from_hf_config({**BASE, "max_position_embeddings": 4096,
                             "rope_scaling": {"rope_type": "linear", "factor": 4.0}})
    config.check_max_seq_len(16384)
    with pytest.raises(ValueError, match=r"max_seq_len=16385 exceeds .*max_position_embeddings=4096 x linear "
                                         r"rope_scaling factor=4.0 = 16384"):
        config.check_max_seq_len(16385)
    llama3 = from_hf_config({**BASE, "max_position_embeddings": 131072,
                             "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ValueError, match="max_position_embeddings=131072$"):  # already the scaled length
        llama3.check_max_seq_len(131073)


def test_json_round_trip():
    config = from_hf_config({**BASE, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}, "eos_token_id": [1, 2]})
    assert ModelConfig.from_json_dict(config.to_json_dict()) == config
    assert config.eos_token_ids == (1, 2)
