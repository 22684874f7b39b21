"""models.quantization and models.dense: qwix weight-only quantization of the linear layers, and the Dense that
multiplies by a quantized kernel."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix

from models.config import ModelConfig
from models.dense import Dense
from models.llama import init_params
from models.quantization import QuantizationConfig, quantize_params, weight_bytes

TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8)
SCHEMES = {"int8": QuantizationConfig("int8"), "fp8": QuantizationConfig("fp8"),
           "int4": QuantizationConfig("int4", group_size=16)}


@pytest.mark.parametrize("bias", [False, True])
def test_a_float_kernel_computes_what_flax_dense_does(bias):
    x = jax.random.normal(jax.random.key(0), (3, 5, 32))
    params = nn.Dense(24, use_bias=bias).init(jax.random.key(1), x)
    np.testing.assert_array_equal(Dense(24, use_bias=bias).apply(params, x), nn.Dense(24, use_bias=bias).apply(params, x))


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_a_quantized_kernel_multiplies_as_its_dequantized_weight(scheme):
    x = jax.random.normal(jax.random.key(0), (3, 32))
    params = nn.Dense(24, use_bias=True).init(jax.random.key(1), x)["params"]
    quantized = quantize_params(params, SCHEMES[scheme])
    assert isinstance(quantized["kernel"], qwix.QArray) and quantized["bias"] is params["bias"]
    dequantized = qwix.dequantize(quantized["kernel"])
    want = x @ dequantized + params["bias"]
    np.testing.assert_allclose(Dense(24, use_bias=True).apply({"params": quantized}, x), want, rtol=1e-6, atol=1e-6)
    # absmax: each weight within half a step of its channel's (or group's) scale
    step = np.asarray(jnp.broadcast_to(jnp.repeat(quantized["kernel"].scale, 32 // quantized["kernel"].scale.shape[0],
                                                  axis=0), (32, 24)))
    error = np.abs(np.asarray(dequantized) - np.asarray(params["kernel"]))
    assert (error <= (0.5 if scheme != "fp8" else 2 ** -3 * 448) * step + 1e-7).all()


def test_which_kernels_are_quantized_and_how():
    params = init_params(TINY, jax.random.key(0))
    quantized = quantize_params(params, SCHEMES["int4"])
    layers = quantized["layers"]
    for module, name in [("self_attn", "q_proj"), ("self_attn", "o_proj"), ("mlp", "down_proj")]:
        kernel = layers[module][name]["kernel"]
        stored = params["layers"][module][name]["kernel"]
        assert kernel.qvalue.dtype == jnp.int4 and kernel.qvalue.shape == stored.shape
        assert kernel.scale.shape == (2, stored.shape[1] // 16, stored.shape[2])  # per layer, group, output channel
    assert not isinstance(quantized["lm_head"]["kernel"], qwix.QArray)  # by default, as vLLM leaves it
    assert quantized["embed_tokens"]["embedding"] is params["embed_tokens"]["embedding"]
    assert quantized["norm"] == params["norm"]
    with_head = quantize_params(params, QuantizationConfig("int8", lm_head=True))
    assert with_head["lm_head"]["kernel"].scale.shape == (1, TINY.vocab_size)
    assert quantize_params(params, None) is params


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="quantization='int3': expected one of"):
        QuantizationConfig.coerce("int3")
    with pytest.raises(ValueError, match=r"int4 quantization of layers/mlp/down_proj/kernel \(2, 64, 32\): its 64 "
                                         r"input features are not a multiple of group_size=128"):
        quantize_params(init_params(TINY, jax.random.key(0)), "int4")


def test_weight_bytes_against_bf16_on_llama_proportions():
    """A Llama-3-8B-shaped model in miniature (its embedding and lm_head about 13% of the weights): int8 <= 0.55
    and int4 <= 0.32 of the bf16 bytes, lm_head quantized with the layers, the embedding kept."""
    config = ModelConfig(vocab_size=2048, hidden_size=256, intermediate_size=896, num_layers=8, num_heads=8,
                         num_kv_heads=2, head_dim=32)
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), init_params(config, jax.random.key(0)))
    embed = weight_bytes(params["embed_tokens"]) + weight_bytes(params["lm_head"])
    assert 0.10 < embed / weight_bytes(params) < 0.16
    held = lambda tree: weight_bytes(tree, per_device=True)  # from each array's addressable_shards
    ratios = {scheme: held(quantize_params(params, QuantizationConfig(scheme, lm_head=True))) / held(params)
              for scheme in ("int8", "int4")}
    assert ratios["int8"] <= 0.55 and ratios["int4"] <= 0.32, ratios


@pytest.mark.parametrize("tied", [False, True])
def test_quantized_embeddings_look_up_and_attend_as_their_dequantized_table(tied):
    """embeddings=True: the table quantized per vocabulary row; lookups and a tied lm_head's logits equal those of
    the dequantized table."""
    from models.attention import KVCache
    from models.llama import LlamaModel, unstack_layers

    config = dataclasses.replace(TINY, tie_word_embeddings=tied)
    params = unstack_layers(init_params(config, jax.random.key(0)), config)
    quantized = quantize_params(params, QuantizationConfig("int8", embeddings=True, lm_head=tied))
    table = quantized["embed_tokens"]["embedding"]
    assert isinstance(table, qwix.QArray) and table.scale.shape == (TINY.vocab_size, 1)
    dequantized = jax.tree.map(lambda x: qwix.dequantize(x) if isinstance(x, qwix.QArray) else x, quantized,
                               is_leaf=lambda x: isinstance(x, qwix.QArray))
    tokens = jnp.asarray([[3, 17, 42, 5]])
    cache = KVCache.zeros(TINY.num_layers, 1, 4, TINY.num_kv_heads, TINY.head_dim, jnp.float32, per_layer=True)
    run = lambda p: LlamaModel(config, scan_layers=False).apply({"params": p}, tokens, jnp.arange(4)[None], cache,
                                                                jnp.zeros((1,), jnp.int32)).logits
    np.testing.assert_allclose(run(quantized), run(dequantized), rtol=1e-5, atol=1e-5)
