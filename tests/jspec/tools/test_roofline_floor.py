"""The roofline's floor model (jspec/tools/roofline/floor.py): bytes one decode step reads, against counts made
by hand from the config numbers, on abstract params (no memory, nothing compiled but the bandwidth probe)."""

import statistics

import jax
import pytest

from jspec.tools.roofline import floor
from jspec.tools.roofline.shapes import CHAIN, DFLASH, DYNAMIC, PLAIN, SHAPES, SyntheticModels, abstract_params
from models.config import from_hf_config
from models.dflash import dflash_config_from_hf
from models.eagle3 import eagle3_config_from_hf

BF16 = 2  # bytes per element of every shape's dtype


def abstract_models(name: str) -> SyntheticModels:
    """SHAPES[name] with jax.ShapeDtypeStruct params (no memory)."""
    shape = SHAPES[name]
    target, head = from_hf_config(shape.target_hf), eagle3_config_from_hf(shape.head_hf)
    dflash = dflash_config_from_hf(shape.dflash_hf)
    params = abstract_params(target, head, dflash, shape.dtype)
    return SyntheticModels(name, shape, target, head, dflash, params["target"], {"head": params["head"], "d2t": None},
                           params["dflash"])


def llama_layer_elements(hidden, intermediate, q_width, kv_width, attn_in=None):
    """One decoder layer: q, k, v (from attn_in features), o, gate, up, down, and two RMS norms."""
    attn_in = attn_in or hidden
    return attn_in * (q_width + 2 * kv_width) + q_width * hidden + 3 * hidden * intermediate + 2 * hidden


# The tiny shape by hand: hidden 64, intermediate 128, 3 layers, 4 heads and 2 kv heads of 16, vocab 256 (untied);
# its head: the same layer reading [embedding, feature] (2 * 64) plus a hidden norm, fc 3 * 64 -> 64, draft vocab 128.
TINY_EMBED = 256 * 64
TINY_TARGET = TINY_EMBED + 3 * llama_layer_elements(64, 128, 64, 32) + 64 * 256 + 64  # + lm_head + final norm
TINY_FC = 3 * 64 * 64
TINY_HEAD = TINY_FC + llama_layer_elements(64, 128, 64, 32, attn_in=2 * 64) + 64 + 64 * 128 + 64  # + hidden norm,
# lm_head, final norm
# Its DFlash drafter: 2 Qwen3 layers of the target's shapes (q and k norms of 16 each), fc over 2 target layers'
# outputs (2 * 64 -> 64), the hidden norm and the final norm; no embedding or lm_head (the target's).
TINY_DFLASH = 2 * 64 * 64 + 64 + 2 * (llama_layer_elements(64, 128, 64, 32) + 2 * 16) + 64


def test_tiny_weight_bytes_by_hand():
    models = abstract_models("tiny")
    assert floor.tree_bytes(models.params_t) == BF16 * TINY_TARGET
    assert floor.tree_bytes(models.params_d["head"]) == BF16 * TINY_HEAD
    assert floor.tree_bytes(models.params_d["head"]["fc"]) == BF16 * TINY_FC
    assert floor.tree_bytes(models.params_f) == BF16 * TINY_DFLASH
    # untied: the embedding is gathered one row per token, not read whole
    assert not models.target.tie_word_embeddings
    assert floor.target_weight_bytes(models.target, models.params_t) == BF16 * (TINY_TARGET - TINY_EMBED)


@pytest.mark.parametrize("name,params", [("llama3-8b", 8_030_261_248), ("llama3-1b", 1_235_814_400)])
def test_real_shapes_have_the_published_parameter_counts(name, params):
    models = abstract_models(name)
    assert floor.tree_bytes(models.params_t) == BF16 * params
    embedding = BF16 * models.target.vocab_size * models.target.hidden_size
    # llama3-1b ties its embedding to the LM head: read whole; llama3-8b's is gathered
    expected = BF16 * params if name == "llama3-1b" else BF16 * params - embedding
    assert models.target.tie_word_embeddings == (name == "llama3-1b")
    assert floor.target_weight_bytes(models.target, models.params_t) == expected


def test_kv_bytes_by_hand():
    target = abstract_models("tiny").target  # 3 layers, 2 kv heads of 16
    assert floor.kv_bytes(target, batch=5, context=127.5, itemsize=BF16) == 2 * 3 * 5 * 127.5 * 2 * 16 * BF16
    assert floor.kv_bytes(target, batch=1, context=513, itemsize=4) == 2 * 3 * 1 * 513 * 2 * 16 * 4


@pytest.mark.parametrize("method,forwards", [(PLAIN, 0), (CHAIN, 3), (DYNAMIC, 3)])
def test_tiny_floor_bytes_by_hand(method, forwards):
    """batch 3, mean context 127.5: target weights + target KV + per drafter forward (max_depth of them: 2 while
    drafting, 1 extend) the head less fc, fc once, and the head's one-layer KV."""
    models = abstract_models("tiny")
    if method != PLAIN:
        assert floor.drafter_forwards(method, models.shape.spec(method)) == forwards
    parts = floor.floor_bytes(models, method, batch=3, context=127.5)
    target_kv = 2 * 3 * 3 * 127.5 * 2 * 16 * BF16
    head_kv = 2 * 1 * 3 * 127.5 * 2 * 16 * BF16
    expected = {"target_weights": BF16 * (TINY_TARGET - TINY_EMBED), "target_kv": target_kv,
                "drafter_weights": BF16 * (forwards * (TINY_HEAD - TINY_FC) + TINY_FC) if forwards else 0.0,
                "drafter_kv": forwards * head_kv}
    expected["total"] = sum(expected.values())
    assert parts == pytest.approx(expected, rel=1e-12)


def test_tiny_dflash_floor_bytes_by_hand():
    """One block forward a step: the drafter's weights once and its two layers' context K/V once."""
    models = abstract_models("tiny")
    assert floor.drafter_forwards(DFLASH, models.shape.spec(DFLASH)) == 1
    assert models.shape.spec(DFLASH).num_steps == 7  # block of 8: 7 drafts
    parts = floor.floor_bytes(models, DFLASH, batch=3, context=127.5)
    assert parts["drafter_weights"] == BF16 * TINY_DFLASH
    assert parts["drafter_kv"] == 2 * 2 * 3 * 127.5 * 2 * 16 * BF16
    assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"), rel=1e-12)


def test_llama3_8b_chain_floor_bytes_by_hand():
    """Chain of 4 (3 drafting forwards + 1 extend), batch 8, context 600; the head as EAGLE3-LLaMA3.1-8B."""
    parts = floor.floor_bytes(abstract_models("llama3-8b"), CHAIN, batch=8, context=600.0)
    h, inter, kv = 4096, 14336, 8 * 128
    fc = 3 * h * h
    head = fc + llama_layer_elements(h, inter, h, kv, attn_in=2 * h) + h + h * 32000 + h
    assert parts["target_weights"] == BF16 * (8_030_261_248 - 128256 * h)
    assert parts["target_kv"] == 2 * 32 * 8 * 600 * kv * BF16
    assert parts["drafter_kv"] == 4 * 2 * 1 * 8 * 600 * kv * BF16
    assert parts["drafter_weights"] == BF16 * (4 * (head - fc) + fc)
    assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"), rel=1e-12)


def test_copy_bandwidth_is_read_plus_write_over_the_median_pass():
    num_bytes = 1 << 20
    bandwidth, per_pass = floor.measure_copy_bandwidth(num_bytes, iterations=2, repeats=3)
    assert len(per_pass) == 3 and all(t > 0 for t in per_pass)
    assert bandwidth == pytest.approx(2 * num_bytes / statistics.median(per_pass), rel=1e-12)


def test_default_copy_bytes_follows_the_backend():
    expected = (16 << 20) if jax.default_backend() == "cpu" else (1 << 30)
    assert floor.default_copy_bytes() == expected

