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
    package = "gemma3" if family == "gemma3_text" else family
    module = getattr(getattr(transformers.models, package), f"modeling_{package}")
    name = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "qwen3_moe": "Qwen3Moe",
            "gpt_oss": "GptOss", "gemma3_text": "Gemma3", "deepseek_v3": "DeepseekV3"}
    rotary = getattr(module, f"{name[family]}RotaryEmbedding")(hf_config)
    if family == "gemma3_text":  # a rope per layer type: layer 0 slides, layer 1 is full
        for layer, kind in ((0, "sliding_attention"), (1, "full_attention")):
            np.testing.assert_allclose(config.rope_inv_freq(layer), getattr(rotary, f"{kind}_inv_freq").numpy(),
                                       rtol=1e-6)
            assert config.rope_attention_scaling(layer) == getattr(rotary, f"{kind}_attention_scaling")
        return
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


def test_which_layers_slide_follows_transformers():
    """Mistral: every layer; Qwen2 with use_sliding_window: from max_window_layers on (none without it); gpt-oss:
    every other from the first; Gemma-3: all but every sliding_window_pattern-th; layer_types where given."""
    mistral = from_hf_config({**BASE, "model_type": "mistral", "sliding_window": 256, "num_hidden_layers": 2})
    mistral.check_max_seq_len(4096)  # a window that binds is served, not refused
    assert [mistral.layer_window(i) for i in range(2)] == [256, 256]
    qwen = from_hf_config({**BASE, "model_type": "qwen2", "sliding_window": 16, "use_sliding_window": False})
    assert qwen.sliding_window is None and qwen.layer_window(0) is None
    qwen = from_hf_config({**BASE, "model_type": "qwen2", "sliding_window": 16, "use_sliding_window": True,
                           "max_window_layers": 1, "num_hidden_layers": 2})
    assert [qwen.layer_window(i) for i in range(2)] == [None, 16]
    oss = from_hf_config({**BASE, "model_type": "gpt_oss", "sliding_window": 128, "num_local_experts": 4,
                          "num_experts_per_tok": 2, "num_hidden_layers": 4})
    assert oss.layer_types == ("sliding_attention", "full_attention") * 2 and oss.attention_sinks
    gemma = from_hf_config({**BASE, "model_type": "gemma3_text", "sliding_window": 512, "num_hidden_layers": 7,
                            "num_key_value_heads": 1,
                            "rope_local_base_freq": 10000.0, "rope_theta": 1e6})
    assert [gemma.layer_window(i) for i in range(7)] == [512] * 5 + [None, 512]
    assert [gemma.layer_rope(i) for i in (0, 5)] == [(10000.0, False), (1e6, True)]
    given = from_hf_config({**BASE, "model_type": "gemma3_text", "sliding_window": 8, "num_key_value_heads": 1,
                            "num_hidden_layers": 2, "layer_types": ["full_attention", "sliding_attention"]})
    assert [given.layer_window(i) for i in range(2)] == [None, 8]
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        from_hf_config({**BASE, "model_type": "gemma3_text", "num_key_value_heads": 1, "final_logit_softcapping": 30.0})
    with pytest.raises(ValueError, match="layer_types=.*expected 2 entries"):
        from_hf_config({**BASE, "model_type": "gpt_oss", "sliding_window": 8, "num_local_experts": 4,
                        "num_experts_per_tok": 2, "num_hidden_layers": 2, "layer_types": ["sliding_attention"]})


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


def test_a_gemma3_image_text_config_reads_its_text_config_with_transformers_defaults():
    """gemma-3-4b-it's config.json: a text_config that leaves vocab_size, heads and head_dim to transformers'
    defaults, the EOS ids at the top level."""
    config = from_hf_config({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
                             "eos_token_id": [1, 106], "text_config": {
                                 "model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
                                 "num_hidden_layers": 34, "sliding_window": 1024,
                                 "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}})
    assert (config.model_type, config.vocab_size, config.num_heads, config.num_kv_heads, config.head_dim) == (
        "gemma3_text", 262208, 8, 4, 256)
    assert config.eos_token_ids == (1, 106) and config.tie_word_embeddings
    assert [config.layer_window(i) for i in (4, 5)] == [1024, None]
    assert config.rope_scaling.rope_type == "linear" and config.layer_rope(0) == (10000.0, False)
    with pytest.raises(ValueError, match="without a text_config"):
        from_hf_config({"model_type": "gemma3"})
