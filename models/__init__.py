"""Flax models and their checkpoints. Knows nothing of speculation."""

from models.attention import KVCache, dense_attention
from models.config import ModelConfig, from_hf_config, load_hf_config
from models.llama import DecoderOutput, LlamaModel, init_params

__all__ = ["DecoderOutput", "KVCache", "LlamaModel", "ModelConfig", "dense_attention", "from_hf_config",
           "init_params", "load_hf_config"]
