"""Bad input gets a clear error naming the value, raised before anything is compiled."""

import jax
import pytest

import jspec
from models.config import ModelConfig
from models.llama import init_params

CONFIG = ModelConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                     num_kv_heads=1, head_dim=8)


@pytest.fixture(scope="module")
def engine():
    return jspec.SpecEngine(CONFIG, init_params(CONFIG, jax.random.key(0)), max_batch_size=2, max_seq_len=32)


@pytest.mark.parametrize("prompts, kwargs, message", [
    ([list(range(30))], dict(max_new_tokens=8), "exceeds max_seq_len=32"),
    ([[1, 2], []], {}, "prompt 1 is empty"),
    ([[1, 50]], {}, "token id 50"),
    ([[1, -3]], {}, "token id -3"),
    ([[1], [2], [3]], {}, "batch of 3 prompts exceeds max_batch_size=2"),
    ([], {}, "prompts is empty"),
    ("hello", {}, "single string"),
    (["hello"], {}, "need a tokenizer"),
    ([[1]], dict(max_new_tokens=0), "max_new_tokens=0"),
    ([[1]], dict(temperature=-1.0), "temperature=-1.0"),
    ([[1]], dict(top_p=0.0), "top_p=0.0"),
    ([[1]], dict(top_k=-2), "top_k=-2"),
    ([[1]], dict(stop_token_ids=[-5]), "stop_token_ids"),
])
def test_bad_generate_input(engine, prompts, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        engine.generate(prompts, **{"max_new_tokens": 2, **kwargs})
    assert engine.num_compiled == 0


def test_missing_checkpoint_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="does_not_exist"):
        jspec.SpecEngine.from_pretrained(tmp_path / "does_not_exist")
    with pytest.raises(FileNotFoundError, match="not a converted jspec checkpoint"):
        jspec.SpecEngine.from_pretrained(tmp_path)


def test_bad_engine_settings():
    params = init_params(CONFIG, jax.random.key(0))
    with pytest.raises(ValueError, match="max_batch_size=0"):
        jspec.SpecEngine(CONFIG, params, max_batch_size=0)
    with pytest.raises(ValueError, match="max_seq_len=1"):
        jspec.SpecEngine(CONFIG, params, max_seq_len=1)
    with pytest.raises(ValueError, match="dtype='float8'"):
        jspec.SpecEngine(CONFIG, params, dtype="float8")
