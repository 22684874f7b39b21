"""Checkpoint conversion: sharded input, dtype, tokenizer files, clear errors, nothing left behind on failure."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jspec.tools.demo_model import write_random_hf_checkpoint
from models.checkpoint import convert_hf_llama, load_llama
from models.config import from_hf_config

SMALL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 40, "hidden_size": 16,
    "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    "rms_norm_eps": 1e-5, "eos_token_id": 2, "bos_token_id": 1,
}


@pytest.fixture
def hf_dir(tmp_path):
    return write_random_hf_checkpoint(str(tmp_path / "hf"), config=SMALL)


def test_sharded_checkpoint_from_transformers(hf_checkpoint, tmp_path):
    """save_pretrained with a small max_shard_size writes an index + shards; the result equals unsharded."""
    model, _, unsharded_dir = hf_checkpoint("qwen3")
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()
    convert_hf_llama(str(sharded), str(tmp_path / "out"), progress=False)
    _, a, _ = load_llama(str(tmp_path / "out"))
    _, b, _ = load_llama(unsharded_dir)
    flat_a, flat_b = jax_leaves(a), jax_leaves(b)
    assert len(flat_a) == len(flat_b)
    for x, y in zip(flat_a, flat_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def jax_leaves(tree):
    import jax
    return jax.tree.leaves(tree)


def test_bfloat16_conversion_and_tokenizer_copy(hf_dir, tmp_path):
    out = convert_hf_llama(hf_dir, str(tmp_path / "out"), dtype="bfloat16", progress=False)
    assert sorted(os.listdir(out)) == ["config.json", "jspec.json", "params", "tokenizer.json"]
    config, params, dtype = load_llama(out)
    assert dtype == "bfloat16"
    assert params["layers"]["self_attn"]["q_proj"]["kernel"].dtype == jnp.bfloat16
    hf = load_file(os.path.join(hf_dir, "model.safetensors"))
    np.testing.assert_allclose(np.asarray(params["layers"]["mlp"]["up_proj"]["kernel"][1], np.float32),
                               hf["model.layers.1.mlp.up_proj.weight"].T, rtol=1e-2)
    _, params32, _ = load_llama(out, dtype="float32")
    assert params32["norm"]["weight"].dtype == jnp.float32
    assert config == from_hf_config(SMALL)


def _break(hf_dir, edit):
    path = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.1.mlp.gate_proj.weight"), r"missing: \['layers/mlp/gate_proj/kernel \(layers \[1\]\)'\]"),
    (lambda t: t.update({"model.layers.0.self_attn.extra.weight": np.zeros(3, np.float32)}),
     r"unexpected: \['model.layers.0.self_attn.extra.weight'\]"),
    (lambda t: t.update({"model.norm.weight": np.zeros(7, np.float32)}), r"misshapen: \['model.norm.weight: got \(7,\)"),
])
def test_bad_tensors_are_listed_and_nothing_is_written(hf_dir, tmp_path, edit, message):
    _break(hf_dir, edit)
    dst = tmp_path / "out"
    with pytest.raises(ValueError, match=message):
        convert_hf_llama(hf_dir, str(dst), progress=False)
    assert not dst.exists()
    assert [p for p in os.listdir(tmp_path) if p.startswith(".out")] == []  # no temp dir left either


def test_missing_and_existing_paths(hf_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        convert_hf_llama(str(tmp_path / "nowhere"), str(tmp_path / "x"), progress=False)
    os.remove(os.path.join(hf_dir, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        convert_hf_llama(hf_dir, str(tmp_path / "x"), progress=False)
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="already exists"):
        convert_hf_llama(hf_dir, str(tmp_path / "taken"), progress=False)


def test_missing_shard_named(hf_checkpoint, tmp_path):
    model, _, _ = hf_checkpoint("llama")
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    os.remove(sharded / victim)
    with pytest.raises(FileNotFoundError, match=victim):
        convert_hf_llama(str(sharded), str(tmp_path / "out"), progress=False)
