"""A tiny random Llama checkpoint in Hugging Face format, for the demo until a trained model is bundled.

Writes config.json, model.safetensors (random weights, numpy only) and a byte-level BPE tokenizer.json trained
with ``tokenizers`` on a slice of the Python standard library's source. The completions are gibberish, by
construction: the weights are random. What it demonstrates is the path: HF directory -> converter -> engine.
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig

import numpy as np

DEMO_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]


def train_tokenizer(vocab_size: int, max_files: int = 40):
    """Byte-level BPE on the first ``max_files`` stdlib modules (sorted, so it is reproducible)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))[:max_files]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train(files, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tokenizer


def random_llama_tensors(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named float32 tensors with N(0, 0.02) projections and unit norms."""
    rng = np.random.default_rng(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads

    def normal(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    tensors = {"model.embed_tokens.weight": normal(config["vocab_size"], hidden),
               "model.norm.weight": np.ones(hidden, np.float32)}
    if not config.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = normal(config["vocab_size"], hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": normal(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": normal(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": normal(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": normal(inter, hidden),
            p + "mlp.up_proj.weight": normal(inter, hidden),
            p + "mlp.down_proj.weight": normal(hidden, inter),
            p + "input_layernorm.weight": np.ones(hidden, np.float32),
            p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
        })
    return tensors


def write_random_hf_checkpoint(directory: str, seed: int = 0, config: dict | None = None) -> str:
    """Writes a random HF-format Llama (config.json, model.safetensors, tokenizer.json) into ``directory``."""
    from safetensors.numpy import save_file

    config = dict(DEMO_CONFIG if config is None else config)
    os.makedirs(directory, exist_ok=True)
    train_tokenizer(config["vocab_size"]).save(os.path.join(directory, "tokenizer.json"))
    save_file(random_llama_tensors(config, seed), os.path.join(directory, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return directory


def default_demo_dir() -> str:
    """Where the converted demo model lives: $JSPEC_HOME/demo-random-llama (default ~/.cache/jspec)."""
    from jspec.tools.compile_cache import jspec_home

    home = jspec_home()
    return os.path.join(home, "demo-random-llama")


def ensure_demo_model(progress: bool = True) -> str:
    """Builds and converts the random demo model on first use; returns its converted directory."""
    import tempfile

    from models.checkpoint import convert_hf_llama

    dst = default_demo_dir()
    if os.path.isfile(os.path.join(dst, "jspec.json")):
        return dst
    with tempfile.TemporaryDirectory() as tmp:
        write_random_hf_checkpoint(os.path.join(tmp, "hf"))
        convert_hf_llama(os.path.join(tmp, "hf"), dst, dtype="float32", progress=progress)
    return dst
