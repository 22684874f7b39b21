"""Tiny random Hugging Face checkpoints of each supported family, made by transformers itself.

Each is saved with ``save_pretrained`` (the format users download) and converted with our script, so tests
exercise the whole path: HF directory -> scripts/convert_checkpoint.py -> SpecEngine.from_pretrained.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import transformers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = dict(vocab_size=101, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
              max_position_embeddings=512, rms_norm_eps=1e-5)

FAMILIES = {
    # Llama 3.1 style: GQA 4:2 and llama3 rope scaling with a short original context so scaling is exercised.
    "llama": lambda: transformers.LlamaConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2,
                                              tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, num_attention_heads=4, num_key_value_heads=1,
                                              head_dim=24),
    "mistral": lambda: transformers.MistralConfig(**COMMON, num_attention_heads=8, num_key_value_heads=2,
                                                  sliding_window=4096),
}
MODEL_CLASSES = {
    "llama": transformers.LlamaForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
    "qwen3": transformers.Qwen3ForCausalLM,
    "mistral": transformers.MistralForCausalLM,
}


def make_hf_model(family: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A float32 eval-mode model with random weights (norm weights perturbed so they matter)."""
    torch.manual_seed(seed)
    model = MODEL_CLASSES[family](FAMILIES[family]()).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
            if name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    return model


def save_and_convert(model: transformers.PreTrainedModel, root: str, dtype: str = "float32",
                     **save_kwargs) -> tuple[str, str]:
    """save_pretrained into root/hf, convert with the script into root/jspec; returns both directories."""
    hf_dir, out_dir = os.path.join(root, "hf"), os.path.join(root, "jspec")
    model.save_pretrained(hf_dir, **save_kwargs)
    done = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "convert_checkpoint.py"), "--src", hf_dir,
                           "--dst", out_dir, "--dtype", dtype], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return hf_dir, out_dir
