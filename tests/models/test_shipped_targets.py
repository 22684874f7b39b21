"""Targets convert and run as Hugging Face ships them (issue 13): tiny random replicas of Llama-3.1-8B-Instruct,
Qwen3 and Qwen2.5, made by transformers and saved the way the Hub carries them.

What the other HF tests already cover and this file does not repeat: every family's logits (prefill, cached
decode, taps, tree mask) in tests/models/test_llama_vs_hf.py; greedy generation of prompt ids and EOS stopping
in tests/jspec/test_engine_vs_hf.py; a sharded save equal to an unsharded one in tests/models/test_checkpoint.py.
Those use transformers 5's config.json (``rope_parameters``), float32 shards, no tokenizer, no
generation_config.json, and a llama3 rope with original_max_position_embeddings=64.

Here each replica is what a user downloads: config.json in the Hub's form (top-level ``rope_theta``,
``rope_scaling``, ``torch_dtype: bfloat16``; Llama 3.1's real rope_scaling and 131072 positions), bfloat16
weights in shards with model.safetensors.index.json, generation_config.json (Llama 3.1 Instruct's three EOS ids),
and a byte-level BPE tokenizer.json + tokenizer_config.json with added special tokens and a chat_template. Each is
converted (the CLI for one, ``convert_hf_checkpoint`` for the others, float32) and checked: (a) logits equal
transformers' (max abs diff < 1e-4, as test_llama_vs_hf.py), also with keys thousands of positions behind the
queries (past Llama 3.1's original 8192 context); (b) ``SpecEngine.from_pretrained`` greedy generation equals
transformers' ``generate(do_sample=False)`` from the HF directory, on ids and on text; (c) the tokenizer files are
in the converted directory and ``engine.tokenizer`` encodes (chat-rendered text included) and decodes like
transformers'; (d) every EOS id of generation_config.json is a stop id of the engine (and of transformers).
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jspec
from jspec.tokenizer import generation_eos
from jspec.tools.cli import main as cli_main
from models.attention import KVCache
from models.checkpoint import convert_hf_checkpoint, load_llama
from models.llama import LlamaModel
from tests.hf_models import build_tokenizer, random_hf_model, write_as_shipped

ATOL = 1e-4  # as tests/models/test_llama_vs_hf.py
BASE_VOCAB = 288  # learned byte-level BPE tokens; the special tokens follow

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>"]
LLAMA3_IDS = {name: BASE_VOCAB + i for i, name in enumerate(LLAMA3_SPECIALS)}  # 128000 + i on the Hub
LLAMA3_EOS = [LLAMA3_IDS["<|end_of_text|>"], LLAMA3_IDS["<|eom_id|>"], LLAMA3_IDS["<|eot_id|>"]]  # 128001/8/9
LLAMA3_CHAT = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
               "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
               "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_IDS = {name: BASE_VOCAB + i for i, name in enumerate(QWEN_SPECIALS)}  # 151643 + i on the Hub
QWEN_EOS = [QWEN_IDS["<|im_end|>"], QWEN_IDS["<|endoftext|>"]]  # generation_config.json: [151645, 151643]
QWEN_CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def llama31():
    """Llama-3.1-8B-Instruct scaled down: GQA 4:2, untied, llama3 rope (the shipped parameters), 131072 positions;
    head_dim 16 puts rotary frequencies in all three llama3 bands (kept, smoothed, divided by 8)."""
    config = transformers.LlamaConfig(
        vocab_size=BASE_VOCAB + len(LLAMA3_SPECIALS), hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=LLAMA3_IDS["<|begin_of_text|>"],
        eos_token_id=LLAMA3_EOS,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})
    generation = transformers.GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=LLAMA3_EOS,
                                               do_sample=True, temperature=0.6, top_p=0.9)
    tokenizer = build_tokenizer(BASE_VOCAB, LLAMA3_SPECIALS, bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None,
                                chat_template=LLAMA3_CHAT)
    return config, generation, tokenizer, {}


def qwen3():
    """Qwen3 scaled down: q/k norm, untied, head_dim 24 != hidden 64 / 4 heads (Qwen3-8B: 128 != 4096 / 32), no
    sliding window; the embedding has more rows than the tokenizer has tokens, as Qwen's do."""
    config = transformers.Qwen3Config(
        vocab_size=BASE_VOCAB + len(QWEN_SPECIALS) + 13, hidden_size=64, intermediate_size=112,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
        bos_token_id=QWEN_IDS["<|endoftext|>"], eos_token_id=QWEN_IDS["<|im_end|>"], use_sliding_window=False)
    generation = transformers.GenerationConfig(bos_token_id=QWEN_IDS["<|endoftext|>"], eos_token_id=QWEN_EOS,
                                               pad_token_id=QWEN_IDS["<|endoftext|>"], do_sample=True,
                                               temperature=0.6, top_k=20, top_p=0.95)
    tokenizer = build_tokenizer(BASE_VOCAB, QWEN_SPECIALS, bos=None, eos="<|im_end|>", pad="<|endoftext|>",
                                chat_template=QWEN_CHAT)
    return config, generation, tokenizer, {"sliding_window": None, "max_window_layers": 2}


def qwen25():
    """Qwen2.5-Instruct scaled down: q/k/v bias, tied embeddings, GQA 4:1, sliding window configured but off."""
    config = transformers.Qwen2Config(
        vocab_size=BASE_VOCAB + len(QWEN_SPECIALS) + 13, hidden_size=64, intermediate_size=112,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=32768,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
        bos_token_id=QWEN_IDS["<|endoftext|>"], eos_token_id=QWEN_IDS["<|im_end|>"], use_sliding_window=False,
        sliding_window=32768, max_window_layers=2)
    generation = transformers.GenerationConfig(bos_token_id=QWEN_IDS["<|endoftext|>"], eos_token_id=QWEN_EOS,
                                               pad_token_id=QWEN_IDS["<|endoftext|>"], do_sample=True,
                                               temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05)
    tokenizer = build_tokenizer(BASE_VOCAB, QWEN_SPECIALS, bos=None, eos="<|im_end|>", pad="<|endoftext|>",
                                chat_template=QWEN_CHAT)
    return config, generation, tokenizer, {}


SHAPES = {"llama3.1-instruct": llama31, "qwen3": qwen3, "qwen2.5-instruct": qwen25}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@pytest.fixture(scope="module", params=sorted(SHAPES))
def shipped(request, tmp_path_factory):
    """(name, transformers model loaded back from the HF dir, HF tokenizer, HF dir, converted dir)."""
    name = request.param
    config, generation, tokenizer, shipped_fields = SHAPES[name]()
    root = tmp_path_factory.mktemp(name.replace(".", "_"))
    hf_dir, out_dir = str(root / "hf"), str(root / "jspec")
    model = random_hf_model(config)
    model.generation_config = generation
    model.to(torch.bfloat16).save_pretrained(hf_dir, max_shard_size="100KB")
    tokenizer.save_pretrained(hf_dir)
    write_as_shipped(hf_dir, **shipped_fields)
    if name.startswith("llama"):  # through the CLI, as a user would
        assert cli_main(["convert", "--src", hf_dir, "--dst", out_dir, "--dtype", "float32"]) == 0
    else:
        convert_hf_checkpoint(hf_dir, out_dir, dtype="float32", progress=False)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    return name, hf_model, hf_tokenizer, hf_dir, out_dir


def test_hf_directory_is_as_shipped(shipped):
    """The replica has the Hub's files: an index over several bfloat16 shards, the 4.x config.json fields."""
    name, _, _, hf_dir, _ = shipped
    with open(os.path.join(hf_dir, "model.safetensors.index.json")) as f:
        shards = set(json.load(f)["weight_map"].values())
    assert len(shards) > 1 and not os.path.exists(os.path.join(hf_dir, "model.safetensors"))
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    assert "rope_parameters" not in config and config["torch_dtype"] == "bfloat16"
    if name.startswith("llama"):
        assert config["rope_scaling"]["original_max_position_embeddings"] == 8192
        assert config["max_position_embeddings"] == 131072
    for file in TOKENIZER_FILES:
        assert os.path.isfile(os.path.join(hf_dir, file))


def test_config_read_as_shipped(shipped):
    name, hf_model, _, _, out_dir = shipped
    config, _, dtype = load_llama(out_dir)
    hf = hf_model.config
    assert dtype == "float32"
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads  # Qwen2Config has none
    assert (config.num_kv_heads, config.head_dim) == (hf.num_key_value_heads, head_dim)
    assert config.head_dim == (24 if name == "qwen3" else 16)
    assert config.tie_word_embeddings == hf.tie_word_embeddings == (name == "qwen2.5-instruct")
    assert config.qk_norm == (name == "qwen3") and config.qkv_bias == (name == "qwen2.5-instruct")
    assert config.sliding_window is None
    assert config.rope_theta == hf.rope_parameters["rope_theta"]
    if name.startswith("llama"):
        scaling = config.rope_scaling
        assert (scaling.rope_type, scaling.factor, scaling.original_max_position_embeddings) == ("llama3", 8.0, 8192)
        assert config.max_position_embeddings == 131072


# slow: [9000] (logits at 9000 positions = transformers, Llama-3.1's rope scaling included); default tier: [None],
# and [120000] (Llama-3.1's rope scaling far out)
@pytest.mark.parametrize("far", [None, pytest.param(9000, marks=pytest.mark.slow), 120000])
def test_logits_match_transformers(shipped, far):
    """Prefill logits on random tokens at positions 0..10, or 0..4 then far..far+5: 9000 is past Llama 3.1's
    original 8192 context and 120000 near its 131072, so query-key distances are where the llama3 rope scaling
    decides the result (with the scaling dropped, these logits differ from transformers' by ~4e-3 > ATOL)."""
    _, hf_model, _, _, out_dir = shipped
    config, params, _ = load_llama(out_dir)
    batch, length = 2, 11
    ids = np.random.default_rng(far or 0).integers(0, config.vocab_size, (batch, length))
    steps = np.arange(length) if far is None else np.concatenate([np.arange(5), far + np.arange(length - 5)])
    positions = np.broadcast_to(steps, (batch, length))
    with torch.no_grad():
        expected = hf_model(torch.tensor(ids), position_ids=torch.tensor(positions.copy())).logits.numpy()
    cache = KVCache.zeros(config.num_layers, batch, 16, config.num_kv_heads, config.head_dim, jnp.float32)
    out = LlamaModel(config).apply({"params": params}, jnp.asarray(ids), jnp.asarray(positions), cache,
                                   jnp.zeros((batch,), jnp.int32))
    np.testing.assert_allclose(np.asarray(out.logits), expected, atol=ATOL, rtol=0)


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate with the checkpoint's own generation_config (its EOS ids stop it)."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None,
                                top_k=None, repetition_penalty=None)
    return out[0, len(prompt):].tolist()


# slow: the engine on a converted Llama-3.1 and Qwen2.5 as shipped; default tier: [qwen3]
@pytest.mark.parametrize("shipped", [pytest.param(name, marks=pytest.mark.slow) if name != "qwen3" else name
                                     for name in sorted(SHAPES)], indirect=True)
def test_engine_from_converted_dir(shipped):
    """(b) greedy generation on ids and on text equals transformers'; (c) engine.tokenizer is transformers';
    (d) the generation_config.json EOS ids are the engine's stop ids."""
    name, hf_model, hf_tokenizer, hf_dir, out_dir = shipped
    for file in TOKENIZER_FILES:
        with open(os.path.join(hf_dir, file), "rb") as a, open(os.path.join(out_dir, file), "rb") as b:
            assert a.read() == b.read(), file
    engine = jspec.SpecEngine.from_pretrained(out_dir, max_batch_size=2, max_seq_len=128)

    expected_eos = LLAMA3_EOS if name.startswith("llama") else QWEN_EOS
    assert generation_eos(out_dir) == tuple(expected_eos)
    assert set(expected_eos) <= set(engine.eos_token_ids)
    assert hf_model.generation_config.eos_token_id == expected_eos  # transformers' generate stops on them too

    texts = ["Hello world! How are you?", hf_tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b): 2 + 3"}],
        tokenize=False, add_generation_prompt=True)]
    assert any(special in texts[1] for special in ("<|eot_id|>", "<|im_end|>"))
    for text in texts:
        assert engine.tokenizer.encode(text).ids == hf_tokenizer(text)["input_ids"]
    ids = hf_tokenizer(texts[1])["input_ids"]
    assert engine.tokenizer.decode(ids, skip_special_tokens=True) == hf_tokenizer.decode(ids, skip_special_tokens=True)

    # random ids (the qwen replicas' untokenizable embedding rows included), batched with a chat prompt's ids so
    # that both calls below fall in one compiled bucket
    prompts = [np.random.default_rng(5).integers(0, hf_model.config.vocab_size, 7).tolist(), ids]
    out = engine.generate(prompts, max_new_tokens=8)
    assert out.token_ids == [hf_greedy(hf_model, prompt, 8) for prompt in prompts]

    out = engine.generate(texts, max_new_tokens=8)
    for text, got, got_text in zip(texts, out.token_ids, out.texts):
        want = hf_greedy(hf_model, hf_tokenizer(text)["input_ids"], 8)
        assert got == want
        assert got_text == hf_tokenizer.decode(want, skip_special_tokens=True)
