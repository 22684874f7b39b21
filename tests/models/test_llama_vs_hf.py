"""The Flax decoder's logits equal transformers' on tiny random models of every family (float32, CPU).

Checkpoints come from transformers' save_pretrained and go through jspec convert and the loader.
Prefill and cached decode steps (one token, then a block of three) are compared, max abs diff < 1e-4; the
mixture of experts also through the engine: n-gram speculation returns transformers' greedy tokens.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jspec
from jspec.drafters.ngram import NgramDrafter
from models.attention import KVCache
from models.checkpoint import load_llama
from models.llama import LlamaModel
from tests import spec_fixtures as fx
from tests.hf_models import FAMILIES, WINDOWED_FAMILIES
from tests.jspec.test_engine_vs_hf import hf_greedy, prompts_for

ATOL = 1e-4
# gpt-oss and Gemma-3 bind their windows at 16: tests/models/test_windowed_families.py runs them past it
UNWINDOWED = sorted(set(FAMILIES) - set(WINDOWED_FAMILIES) - {"deepseek_v3"})  # test_deepseek_v3: its own


# slow: Mistral and Qwen2 (their config, logits with cached decode, hidden-state taps and tree mask against
# transformers'); default tier: [llama], [qwen3], and test_shipped_targets' Qwen2.5
SLOW_FAMILIES = ("mistral", "qwen2")


@pytest.fixture(scope="module", params=[pytest.param(family, marks=pytest.mark.slow) if family in SLOW_FAMILIES
                                        else family for family in UNWINDOWED])
def converted(request, hf_checkpoint):
    model, _, out_dir = hf_checkpoint(request.param)
    config, params, _ = load_llama(out_dir)
    return request.param, model, config, params


def test_config_matches_family(converted):
    family, model, config, _ = converted
    assert config.model_type == family
    assert config.num_kv_heads == model.config.num_key_value_heads
    assert config.qk_norm == (family in ("qwen3", "qwen3_moe"))
    assert config.num_experts == (8 if family == "qwen3_moe" else 0)
    assert config.qkv_bias == (family == "qwen2")
    if family == "llama":
        assert config.rope_scaling.rope_type == "llama3"


def test_prefill_and_cached_decode_match_transformers(converted):
    _, model, config, params = converted
    rng = np.random.default_rng(1)
    batch, prompt_len, decode_steps = 2, 13, (1, 3)
    total = prompt_len + sum(decode_steps)
    ids = rng.integers(0, config.vocab_size, (batch, total))
    with torch.no_grad():
        expected = model(torch.tensor(ids)).logits.numpy()

    flax_model = LlamaModel(config)
    cache = KVCache.zeros(config.num_layers, batch, 32, config.num_kv_heads, config.head_dim, jnp.float32)
    cache = cache._replace(k=cache.k + jnp.nan, v=cache.v + jnp.nan)  # unused slots must never be read
    start = 0
    for width in (prompt_len,) + decode_steps:
        positions = np.broadcast_to(np.arange(start, start + width), (batch, width))
        out = flax_model.apply({"params": params}, jnp.asarray(ids[:, start:start + width]),
                               jnp.asarray(positions), cache, jnp.full((batch,), start, jnp.int32))
        got = np.asarray(out.logits)
        np.testing.assert_allclose(got, expected[:, start:start + width], atol=ATOL, rtol=0)
        cache, start = out.cache, start + width


def test_hidden_state_taps_match_transformers(converted):
    _, model, config, params = converted
    ids = np.random.default_rng(2).integers(0, config.vocab_size, (1, 9))
    last_output = []  # tap num_layers: the last decoder layer's output, before the final norm
    hook = model.model.layers[-1].register_forward_hook(
        lambda module, args, out: last_output.append((out[0] if isinstance(out, tuple) else out).detach()))
    with torch.no_grad():
        hidden = list(model(torch.tensor(ids), output_hidden_states=True).hidden_states)
    hook.remove()
    hidden[config.num_layers] = last_output[0]
    layers = (2, config.num_layers // 2, config.num_layers - 3, config.num_layers, 0)
    cache = KVCache.zeros(config.num_layers, 1, 16, config.num_kv_heads, config.head_dim, jnp.float32)
    out = LlamaModel(config).apply({"params": params}, jnp.asarray(ids), jnp.arange(9)[None], cache,
                                   jnp.zeros((1,), jnp.int32), tap_layers=layers)
    for slot, layer in enumerate(layers):
        np.testing.assert_allclose(np.asarray(out.taps[slot]), hidden[layer].numpy(), atol=ATOL, rtol=0)


# slow: [qwen3] as well as Mistral and Qwen2 (a tree mask = separate causal branches); default tier: [llama]
@pytest.mark.parametrize("converted", [pytest.param(family, marks=pytest.mark.slow) if family != "llama" else family
                                       for family in UNWINDOWED], indirect=True)
def test_tree_mask_equals_separate_causal_branches(converted):
    """Two branches in one tree pass give the logits each branch gets on its own (the tree case)."""
    _, model, config, params = converted
    rng = np.random.default_rng(3)
    prefix = rng.integers(0, config.vocab_size, (1, 6))
    a, b = rng.integers(0, config.vocab_size, 2), rng.integers(0, config.vocab_size, 2)
    # tree: root r = prefix[-1] is in the tree as node 0; node1 = a0, node2 = a1 (child of 1), node3 = b0 (child of 0)
    tree_tokens = np.array([[prefix[0, -1], a[0], a[1], b[0]]])
    parents = [-1, 0, 1, 0]
    mask = np.zeros((1, 4, 4), bool)
    for i in range(4):
        j = i
        while j >= 0:
            mask[0, i, j] = True
            j = parents[j]
    depth = np.array([[0, 1, 2, 1]])
    with torch.no_grad():
        seq_a = model(torch.tensor(np.concatenate([prefix, a[None]], 1))).logits.numpy()[0]
        seq_b = model(torch.tensor(np.concatenate([prefix, b[None, :1]], 1))).logits.numpy()[0]
    flax_model = LlamaModel(config)
    cache = KVCache.zeros(config.num_layers, 1, 16, config.num_kv_heads, config.head_dim, jnp.float32)
    out = flax_model.apply({"params": params}, jnp.asarray(prefix[:, :-1]), jnp.arange(5)[None], cache,
                           jnp.zeros((1,), jnp.int32))
    out = flax_model.apply({"params": params}, jnp.asarray(tree_tokens), jnp.asarray(5 + depth), out.cache,
                           jnp.full((1,), 5, jnp.int32), local_mask=jnp.asarray(mask))
    got = np.asarray(out.logits)[0]
    np.testing.assert_allclose(got[[0, 1, 2]], seq_a[5:8], atol=ATOL, rtol=0)
    np.testing.assert_allclose(got[3], seq_b[6], atol=ATOL, rtol=0)


def test_a_converted_qwen3_moe_speculates_transformers_greedy_tokens(hf_checkpoint):
    """transformers' Qwen3-MoE (yarn rope) converted: n-gram chain speculation (verifies of 5 tokens through the
    experts, decode steps through the gathered ones) returns transformers' greedy generate token for token."""
    model, _, out_dir = hf_checkpoint("qwen3_moe")
    loaded = jspec.SpecEngine.from_pretrained(out_dir, max_batch_size=4, max_seq_len=64)
    prompts = prompts_for(loaded.config.vocab_size)
    out = jspec.SpecEngine(loaded.config, loaded.params, drafter=NgramDrafter(fx.SPECS["chain"], 64),
                           drafter_params={}, max_batch_size=4, max_seq_len=64).generate(prompts, max_new_tokens=12)
    model.generation_config.eos_token_id = None  # random weights: run to max_new_tokens on both sides
    assert out.token_ids == [hf_greedy(model, prompt, 12) for prompt in prompts]
