"""ModelConfig from HF config.json: each family's quirks, and clear errors for what we do not support."""

import numpy as np
import pytest
import torch
import transformers

from models.config import ModelConfig, from_hf_config
from tests.hf_models import FAMILIES

BASE = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rope_inv_freq_matches_transformers(family):
    hf_config = FAMILIES[family]()
    config = from_hf_config(hf_config.to_dict())
    rotary_cls = getattr(transformers.models, family)
    module = getattr(rotary_cls, f"modeling_{family}")
    rotary = getattr(module, f"{ {'llama': 'Llama', 'qwen2': 'Qwen2', 'qwen3': 'Qwen3', 'mistral': 'Mistral'}[family]}RotaryEmbedding")(hf_config)
    np.testing.assert_allclose(config.rope_inv_freq(), rotary.inv_freq.numpy(), rtol=1e-6)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gpt2"}, "model_type='gpt2'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
    ({"vocab_size": None}, "vocab_size=None"),
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


def test_json_round_trip():
    config = from_hf_config({**BASE, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}, "eos_token_id": [1, 2]})
    assert ModelConfig.from_json_dict(config.to_json_dict()) == config
    assert config.eos_token_ids == (1, 2)
