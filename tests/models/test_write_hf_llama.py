"""write_hf_llama is the inverse of the converter: our params -> HF directory -> convert -> the same params."""

import jax
import numpy as np
import pytest

from models.checkpoint import convert_hf_llama, load_llama, write_hf_llama
from models.config import from_hf_config
from models.llama import init_params

BASE = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5}


@pytest.mark.parametrize("hf_config", [
    dict(BASE, model_type="llama", tie_word_embeddings=False),
    dict(BASE, model_type="llama", tie_word_embeddings=True),
    dict(BASE, model_type="qwen2", tie_word_embeddings=False),  # q/k/v biases
])
def test_round_trip(tmp_path, hf_config):
    params = init_params(from_hf_config(hf_config), jax.random.key(0))
    write_hf_llama(str(tmp_path / "hf"), hf_config, jax.tree.map(np.asarray, params))
    _, loaded, dtype = load_llama(convert_hf_llama(str(tmp_path / "hf"), str(tmp_path / "out"), progress=False))
    assert dtype == "float32"
    jax.tree.map(np.testing.assert_array_equal, loaded, params)


def test_mismatched_params_are_refused(tmp_path):
    params = init_params(from_hf_config(dict(BASE, model_type="llama")), jax.random.key(0))
    with pytest.raises(ValueError, match="do not match"):
        write_hf_llama(str(tmp_path / "hf"), dict(BASE, model_type="llama", num_hidden_layers=2), params)
