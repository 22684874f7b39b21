"""Tiny random Hugging Face checkpoints of each supported family, made by transformers itself.

Each is saved with ``save_pretrained`` (the format users download) and converted with ``jspec convert``, so tests
exercise the whole path: HF directory -> jspec convert -> SpecEngine.from_pretrained.
"""

from __future__ import annotations

import os

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
    # 8 experts, 2 a token: a 16-token prompt routes to most of them; yarn rope (Qwen3's long-context setting, with an
    # original context of 64: the ramp between kept and interpolated frequencies falls inside head_dim 16)
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2,
                                                     head_dim=16, num_experts=8, num_experts_per_tok=2,
                                                     moe_intermediate_size=24, norm_topk_prob=True,
                                                     rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                   "original_max_position_embeddings": 64}),
    # 8 experts with biases, 2 a token; attention sinks; layers sliding (window 16), full, sliding; yarn rope as
    # gpt-oss ships it (truncate false), its original context short enough for the ramp to fall inside head_dim 16
    "gpt_oss": lambda: transformers.GptOssConfig(**dict(COMMON, intermediate_size=32), num_attention_heads=4,
                                                 num_key_value_heads=2, head_dim=16, num_local_experts=8,
                                                 num_experts_per_tok=2, sliding_window=16,
                                                 rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                                  "beta_slow": 1.0, "truncate": False,
                                                                  "original_max_position_embeddings": 64,
                                                                  "rope_theta": 150000.0}),
    # sliding (window 16, local rope base 10k), full (its own base, linear scaling), sliding; a query scale
    # (query_pre_attn_scalar 24) other than head_dim 16's
    "gemma3_text": lambda: transformers.Gemma3TextConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
        query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
    # multi-head latent attention (q and kv low-rank, rope on interleaved pairs, yarn with mscale) and experts
    # routed by sigmoid scores with a correction bias within the 2 best of 4 groups, a shared expert, the first
    # layer dense
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **dict(COMMON, max_position_embeddings=256), moe_intermediate_size=24, num_attention_heads=4,
        num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
        qk_nope_head_dim=24, v_head_dim=20, first_k_dense_replace=1,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}),
}
# the families whose windows bind at 16 positions (tests/models/test_windowed_families.py)
WINDOWED_FAMILIES = ("gpt_oss", "gemma3_text")
MODEL_CLASSES = {
    "llama": transformers.LlamaForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
    "qwen3": transformers.Qwen3ForCausalLM,
    "mistral": transformers.MistralForCausalLM,
    "qwen3_moe": transformers.Qwen3MoeForCausalLM,
    "gpt_oss": transformers.GptOssForCausalLM,
    "gemma3_text": transformers.Gemma3ForCausalLM,
    "deepseek_v3": transformers.DeepseekV3ForCausalLM,
}


def make_hf_model(family: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A float32 eval-mode model with random weights (norm weights perturbed so they matter)."""
    torch.manual_seed(seed)
    return perturbed(MODEL_CLASSES[family](FAMILIES[family]()).eval())


def perturbed(model: transformers.PreTrainedModel, bf16_values: bool = False) -> transformers.PreTrainedModel:
    """Norm weights and biases moved off their initial values so that they matter; with ``bf16_values`` every
    parameter is rounded to a bfloat16 value (held in float32). In place; returns the model."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
            if name.endswith(".bias") or name.endswith("_bias"):
                param.normal_(0.0, 0.1)
            if name.endswith(".sinks"):  # gpt-oss: a sink logit near the scores' scale, so it moves the softmax
                param.normal_(0.0, 1.0)
            if bf16_values:
                param.copy_(param.to(torch.bfloat16).to(torch.float32))
    return model


def save_and_convert(model: transformers.PreTrainedModel, root: str, dtype: str = "float32",
                     **save_kwargs) -> tuple[str, str]:
    """save_pretrained into root/hf, convert with ``jspec convert`` (in this process: what
    scripts/convert_checkpoint.py calls, without a Python and JAX start-up per family and worker; the script itself
    runs in tests/models/test_eagle3.py) into root/jspec; returns both directories."""
    from jspec.tools.cli import main as cli_main

    hf_dir, out_dir = os.path.join(root, "hf"), os.path.join(root, "jspec")
    model.save_pretrained(hf_dir, **save_kwargs)
    assert cli_main(["convert", "--src", hf_dir, "--dst", out_dir, "--dtype", dtype]) == 0
    return hf_dir, out_dir


# --- checkpoints as the Hub ships them (tests/models/test_shipped_targets.py) ---------------------------------

TOKENIZER_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts several tokens and the target checks them in one pass.",
    "Hello world! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
    "Numbers 0123456789 and symbols #$%&*+-/<=>@[]^_{|}~ appear too.",
]


def build_tokenizer(base_vocab: int, specials: list[str], *, bos: str | None, eos: str, pad: str | None,
                    chat_template: str):
    """A byte-level BPE (Llama 3 / Qwen style) of exactly ``base_vocab`` learned tokens, then ``specials`` as added
    special tokens at ids base_vocab, base_vocab + 1, ...; a BOS post-processor when ``bos`` is given. Returns
    transformers' fast tokenizer (what ``save_pretrained`` writes as tokenizer.json + tokenizer_config.json)."""
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=base_vocab, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TOKENIZER_CORPUS * 4, trainer)
    assert tok.get_vocab_size() == base_vocab, tok.get_vocab_size()
    tok.add_special_tokens(specials)
    if bos is not None:
        bos_id = tok.token_to_id(bos)
        tok.post_processor = tokenizers.processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad,
                                                chat_template=chat_template)


def random_hf_model(config: transformers.PretrainedConfig, seed: int = 0) -> transformers.PreTrainedModel:
    """AutoModelForCausalLM of ``config`` with random weights (norms and biases perturbed so they matter), rounded
    to bfloat16 values (the Hub ships bfloat16) and held in float32."""
    torch.manual_seed(seed)
    return perturbed(transformers.AutoModelForCausalLM.from_config(config).eval(), bf16_values=True)


def write_as_shipped(hf_dir: str, **extra) -> dict:
    """Rewrites ``hf_dir/config.json`` the way Hub checkpoints carry it (written by transformers 4.x): rope_theta
    at the top level and ``rope_scaling`` (null for default rope) instead of transformers 5's ``rope_parameters``,
    ``torch_dtype``; ``extra`` fields set last. Returns the new dict."""
    import json

    path = os.path.join(hf_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    rope = dict(config.pop("rope_parameters", None) or {})
    if "rope_theta" in rope:
        config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    config.pop("dtype", None)
    config["torch_dtype"] = "bfloat16"
    config["transformers_version"] = "4.43.0.dev0"
    config.update(extra)
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    return config
