"""The expected experts a verify pass reads (jspec/tools/roofline/moe_bytes.py) against routing drawn at random, and
the step bytes against the model's own parameter count."""

import jax
import numpy as np
import pytest

from jspec.tools.aot_programs import DEEPSEEK_V3, GPT_OSS_20B, QWEN3_30B_A3B
from jspec.tools.roofline.moe_bytes import (expected_experts, kv_values_per_position, step_bytes, step_table,
                                           total_params)
from models.config import from_hf_config
from models.llama import param_shapes

QWEN3_MOE = from_hf_config(QWEN3_30B_A3B)


@pytest.mark.parametrize("tokens", [1, 4, 16, 64])
def test_expected_experts_match_uniform_routing_drawn_at_random(tokens):
    rng = np.random.default_rng(tokens)
    routed = np.argsort(rng.random((2000, tokens, 128)), axis=-1)[..., :8]  # 8 distinct experts a token, uniformly
    touched = np.zeros((2000, 128), bool)
    np.put_along_axis(touched, routed.reshape(2000, -1), True, axis=1)
    assert expected_experts(128, 8, tokens) == pytest.approx(touched.sum(axis=1).mean(), rel=0.01)


def test_a_plain_step_reads_the_active_parameters_and_a_verify_reads_more():
    params = sum(np.prod(leaf.shape) for leaf in jax.tree.leaves(param_shapes(QWEN3_MOE)))
    assert params == pytest.approx(30.5e9, rel=0.01)  # Qwen3-30B-A3B's published count
    plain = step_bytes(QWEN3_MOE, rows=1, tokens=1, context=0)
    # "A3B": 3.3B active a token, the published count taking the whole embedding table (a step reads one row of it)
    active = (plain.expert_bytes + plain.other_weight_bytes) / 2 + QWEN3_MOE.vocab_size * QWEN3_MOE.hidden_size
    assert active == pytest.approx(3.3e9, rel=0.03)
    table = step_table(QWEN3_MOE, rows=1, verify_tokens=(1, 4, 16), context=2048)
    assert [row["experts_read"] for row in table] == [8.0, pytest.approx(29.1, abs=0.1), pytest.approx(82.4, abs=0.1)]
    assert 1.0 == table[0]["bytes_over_plain"] < table[1]["bytes_over_plain"] < table[2]["bytes_over_plain"]


def test_a_dense_model_is_refused():
    with pytest.raises(ValueError, match="no experts"):
        step_bytes(from_hf_config(dict(QWEN3_30B_A3B, model_type="qwen3", num_experts=0)), 1, 1, 0)


def test_gpt_oss_20b_counts_its_published_parameters_and_its_windows():
    """gpt-oss-20b: 20.9B parameters (experts with biases, sinks); its sliding layers read 128 positions of KV,
    the full ones all 2048."""
    config = from_hf_config(GPT_OSS_20B)
    params = sum(np.prod(leaf.shape) for leaf in jax.tree.leaves(param_shapes(config)))
    assert params == pytest.approx(20.9e9, rel=0.01)
    step = step_bytes(config, rows=1, tokens=1, context=2048)
    per_position = 2 * config.num_kv_heads * config.head_dim * 2  # K and V, bf16
    assert step.kv_bytes == per_position * (12 * 2048 + 12 * 128)
    assert step.experts_read == 4.0


def test_deepseek_v3_counts_its_published_671b_and_reads_latents():
    """Latent attention, shared experts and the dense first layers counted: DeepSeek-V3's config holds 671B
    parameters (its MTP module aside), and a row's KV cache is 576 values a layer and position."""
    config = from_hf_config(DEEPSEEK_V3)
    assert abs(total_params(config) / 671e9 - 1) < 0.005
    assert kv_values_per_position(config) == 576
    plain = step_bytes(config, rows=1, tokens=1, context=2048, bytes_per_param=1.0)
    assert plain.experts_read == 8.0 and plain.kv_bytes == 61 * 576 * 2048 * 2
