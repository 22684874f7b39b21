"""gpt-oss and Gemma-3 past their sliding windows, against transformers (float32, CPU).

Tiny random checkpoints made by transformers (tests/hf_models.py: windows of 16 positions, layers sliding, full,
sliding; gpt-oss's sinks and router biases moved away from zero) go through ``jspec convert``. Sequences run to 60
positions, so every sliding layer drops keys: logits equal transformers' within 1e-4 for a prefill, cached decode
steps and a tree pass, in the engine's unrolled layout and the scanned one, and the same checkpoint with its windows
switched off differs (the window binds). Through the engine, n-gram speculation returns transformers' greedy tokens.
gpt-oss's MXFP4 experts (the published checkpoints' form) convert to what transformers dequantizes.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jspec
from jspec.drafters.ngram import NgramDrafter
from models.attention import KVCache
from models.checkpoint import load_llama
from models.checkpoint.hf_gpt_oss import FP4_VALUES, dequantize_mxfp4
from models.llama import LlamaModel, unstack_layers
from tests import spec_fixtures as fx
from tests.hf_models import WINDOWED_FAMILIES
from tests.jspec.test_engine_vs_hf import hf_greedy

ATOL = 1e-4
SEQ = 60


@pytest.fixture(scope="module", params=WINDOWED_FAMILIES)
def converted(request, hf_checkpoint):
    model, hf_dir, out_dir = hf_checkpoint(request.param)
    config, params, _ = load_llama(out_dir)
    return request.param, model, config, params, out_dir


def _ancestors(parents):
    """bool[T, T]: node i sees itself and its ancestors."""
    mask = np.eye(len(parents), dtype=bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask


def _run(config, params, scan, ids, steps, tree=None):
    """Logits of ``ids`` [B, N] fed in blocks of ``steps`` through a cached model (unused slots NaN: a read of one
    would show) -> [B, N, V]; then, given ``tree`` (tokens [B, T], mask [T, T]), the logits of a tree pass at the
    end of the cache [B, T, V] too."""
    model = jax.jit(LlamaModel(config, scan_layers=scan).apply)  # one program per width, not an op at a time
    params = params if scan else unstack_layers(params, config)
    batch = ids.shape[0]
    cache = KVCache.zeros(config.num_layers, batch, 64, config.num_kv_heads, config.head_dim, jnp.float32,
                          per_layer=not scan)
    cache = jax.tree.map(lambda buffer: buffer + jnp.nan, cache)
    out, start = [], 0
    for width in steps:
        positions = np.broadcast_to(np.arange(start, start + width), (batch, width))
        step = model({"params": params}, jnp.asarray(ids[:, start:start + width]), jnp.asarray(positions), cache,
                     jnp.full((batch,), start, jnp.int32))
        out.append(np.asarray(step.logits))
        cache, start = step.cache, start + width
    if tree is None:
        return np.concatenate(out, axis=1)
    tokens, mask = tree
    depth = mask.sum(1) - 1
    step = model({"params": params}, jnp.asarray(tokens), jnp.asarray(np.broadcast_to(start + depth, tokens.shape)),
                 cache, jnp.full((batch,), start, jnp.int32), local_mask=jnp.asarray(np.broadcast_to(
                     mask, (batch,) + mask.shape)))
    return np.concatenate(out, axis=1), np.asarray(step.logits)


def test_logits_equal_transformers_past_the_window(converted):
    """Positions 0-49 as a prefill of 40 and a cached block of 9 (the engine's unrolled layout), then a
    tree pass at position 49: root, a0 -> a1 under it, b0 beside a0, each branch equal to transformers on that
    branch alone; the stored (scanned) layout over the whole sequence. The same sequences with transformers'
    window switched off give other logits: the window binds."""
    family, model, config, params, _ = converted
    assert config.model_type == family and config.sliding_window == 16
    assert [config.layer_window(i) for i in range(3)] == [16, None, 16]
    rng = np.random.default_rng(1)
    ids = rng.integers(0, config.vocab_size, (2, SEQ))
    branches = rng.integers(0, config.vocab_size, (2, 3))  # a0, a1, b0 of each row
    with torch.no_grad():
        want = model(torch.tensor(ids)).logits.numpy()
        seq_a = model(torch.tensor(np.concatenate([ids[:, :50], branches[:, :2]], 1))).logits.numpy()
        seq_b = model(torch.tensor(np.concatenate([ids[:, :50], branches[:, 2:]], 1))).logits.numpy()
    tree = np.concatenate([ids[:, 49:50], branches], axis=1), _ancestors([-1, 0, 1, 0])
    got, tree_logits = _run(config, params, False, ids, (40, 9), tree)
    np.testing.assert_allclose(got, want[:, :49], atol=ATOL, rtol=0)
    np.testing.assert_allclose(tree_logits[:, :3], seq_a[:, 49:52], atol=ATOL, rtol=0)
    np.testing.assert_allclose(tree_logits[:, 3], seq_b[:, 50], atol=ATOL, rtol=0)
    np.testing.assert_allclose(_run(config, params, True, ids, (SEQ,)), want, atol=ATOL, rtol=0)
    model.config.sliding_window = SEQ + 1  # transformers reading everything: another model on these sequences
    try:
        with torch.no_grad():
            unwindowed = model(torch.tensor(ids)).logits.numpy()
    finally:
        model.config.sliding_window = 16
    assert np.abs(unwindowed - want).max() > 1e-2


def test_ngram_speculation_returns_transformers_greedy_tokens_past_the_window(converted):
    """Prompts of 3-11 tokens and 40 new ones: verify passes of 5 tokens cross the window of 16 in every sliding
    layer."""
    _, model, config, params, _ = converted
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (3, 11, 6)]
    prompts[1][5:10] = prompts[1][0:5]  # a repeat for the n-gram drafter to find
    engine = jspec.SpecEngine(config, params, drafter=NgramDrafter(fx.SPECS["chain"], 96), drafter_params={},
                              max_batch_size=4, max_seq_len=96)
    out = engine.generate(prompts, max_new_tokens=40)
    model.generation_config.eos_token_id = None  # random weights: run to max_new_tokens on both sides
    assert out.token_ids == [hf_greedy(model, prompt, 40) for prompt in prompts]


def _quantize_mxfp4(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """f32[E, R, C] (C a multiple of 32) -> (blocks u8[E, R, C / 32, 16], scales u8[E, R, C / 32]): each block of 32
    scaled by a power of two that fits its largest magnitude in FP4's 6, each value rounded to the nearest code."""
    blocks = weight.reshape(weight.shape[:2] + (-1, 32))
    exponent = np.ceil(np.log2(np.maximum(np.abs(blocks).max(-1), 1e-30) / 6.0)).astype(np.int32)
    scaled = blocks / np.ldexp(1.0, exponent)[..., None]
    codes = np.abs(scaled[..., None] - FP4_VALUES).argmin(-1).astype(np.uint8)  # [E, R, G, 32]
    packed, scales = codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).astype(np.uint8)
    return np.ascontiguousarray(packed), np.ascontiguousarray(scales)  # safetensors.numpy writes a strided array's
                                                                       # buffer as it lies in memory


def test_mxfp4_experts_convert_to_what_transformers_dequantizes(hf_checkpoint, tmp_path):
    """The gpt-oss checkpoint rewritten as published (experts in MXFP4 blocks and scales, quant_method "mxfp4"):
    jspec's dequantization equals transformers' ``convert_moe_packed_tensors``, and the converted model's logits
    equal transformers' on the same model with its experts dequantized by transformers (dequantize, then run)."""
    import safetensors.numpy
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model, hf_dir, _ = hf_checkpoint("gpt_oss")
    tensors = safetensors.numpy.load_file(os.path.join(hf_dir, "model.safetensors"))
    reference = type(model)(model.config).eval()
    reference.load_state_dict(model.state_dict())
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _quantize_mxfp4(np.swapaxes(tensors.pop(name), 1, 2))  # rows: output features
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        theirs = convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales), dtype=torch.float32)
        np.testing.assert_array_equal(dequantize_mxfp4(blocks, scales), theirs.numpy())
        layer = reference.model.layers[int(name.split(".")[2])]
        getattr(layer.mlp.experts, name.rsplit(".", 1)[1]).data.copy_(theirs)
    src = tmp_path / "mxfp4"
    src.mkdir()
    safetensors.numpy.save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf_config = json.load(f)
    (src / "config.json").write_text(json.dumps({**hf_config, "quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]}}))
    from jspec.tools.cli import main as cli_main

    assert cli_main(["convert", "--src", str(src), "--dst", str(tmp_path / "out"), "--dtype", "float32"]) == 0
    config, params, _ = load_llama(str(tmp_path / "out"))
    ids = np.random.default_rng(3).integers(0, config.vocab_size, (1, 24))
    with torch.no_grad():
        want = reference(torch.tensor(ids)).logits.numpy()
        plain = model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(_run(config, params, False, ids, (24,)), want, atol=ATOL, rtol=0)
    assert np.abs(plain - want).max() > 1e-3  # the 4-bit experts are another model: the check sees which one ran


def test_a_gemma3_image_text_checkpoint_converts_its_language_model(tmp_path):
    """Gemma-3 4B/12B/27B ship as Gemma3ForConditionalGeneration (language_model.model.* beside a vision tower):
    the converted language model's logits on a text prompt past its window equal transformers' image-text model's,
    the vision tower left unread."""
    import transformers

    from jspec.tools.cli import main as cli_main
    from tests.hf_models import FAMILIES, perturbed

    text = FAMILIES["gemma3_text"]().to_dict()
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    torch.manual_seed(4)
    model = perturbed(transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text, vision_config=vision.to_dict(), mm_tokens_per_image=4, image_token_index=100,
        boi_token_index=98, eoi_token_index=99)).eval())
    model.save_pretrained(tmp_path / "hf")
    assert cli_main(["convert", "--src", str(tmp_path / "hf"), "--dst", str(tmp_path / "out"), "--dtype",
                     "float32"]) == 0
    config, params, _ = load_llama(str(tmp_path / "out"))
    assert config.model_type == "gemma3_text" and config.layer_types[1] == "full_attention"
    ids = np.random.default_rng(5).integers(0, 98, (1, 40))  # text tokens only (98-100: the image markers)
    with torch.no_grad():
        want = model(input_ids=torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(_run(config, params, False, ids, (40,)), want, atol=ATOL, rtol=0)
