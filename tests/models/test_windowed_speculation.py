"""Speculation on targets whose sliding windows bind and whose attention has sinks: lossless.

Near-bigram targets of the gpt-oss shape (experts with biases and the clamped SwiGLU, a sink per head, layers
alternating windows of 8 and full attention) and of the Gemma-3 shape (five sliding layers to one full, a local
rope base, sandwich norms), 40 new tokens so every verify pass reads past its window: the n-gram chain, EAGLE-3's
dynamic tree (a head in the HF layout for the target's hidden size) and the draft-model chain return plain
decoding's tokens (float32; int8 speculation on a mixture of experts: tests/models/test_moe.py).
"""

import dataclasses

import jax
import pytest

import jspec
from jspec.drafters.draft_model import DraftModelDrafter
from jspec.drafters.eagle3 import Eagle3Drafter
from jspec.drafters.ngram import NgramDrafter
from models.llama import init_params
from tests import spec_fixtures as fx
from tests.models.moe_mesh_cases import with_random_biases

WINDOWED = {
    "gpt_oss": dataclasses.replace(
        fx.TARGET, model_type="gpt_oss", intermediate_size=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=16, norm_topk_prob=True, moe_bias=True, expert_activation="clamped_swiglu",
        attention_sinks=True, qkv_bias=True, o_bias=True, sliding_window=8,
        layer_types=("sliding_attention", "full_attention") * 2),
    "gemma3_text": dataclasses.replace(
        fx.TARGET, model_type="gemma3_text", num_layers=6, hidden_act="gelu_pytorch_tanh", norm_weight_offset=1.0,
        sandwich_norms=True, qk_norm=True, embedding_multiplier=32 ** 0.5, query_pre_attn_scalar=12.0,
        local_rope_theta=10000.0, rope_theta=1e6, sliding_window=8,
        layer_types=("sliding_attention",) * 5 + ("full_attention",)),
}
PROMPTS = [[5, 9, 5, 9, 5, 9, 12], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [7]]


def near_bigram(config) -> dict:
    params = with_random_biases(init_params(config, jax.random.key(0)))
    params["layers"]["self_attn"]["o_proj"]["kernel"] = params["layers"]["self_attn"]["o_proj"]["kernel"] * 0.05
    params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 6.0  # drafts get accepted
    return params


# slow: every drafter on both windowed shapes; default tier: test_windowed_families (the converted
# checkpoints' logits past the window and n-gram speculation = transformers' greedy tokens)
@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_every_drafter_equals_plain_decoding_past_the_window(family):
    config = WINDOWED[family]
    params = near_bigram(config)
    kwargs = dict(max_batch_size=4, max_seq_len=fx.MAX_SEQ_LEN)
    plain = jspec.SpecEngine(config, params, **kwargs).generate(PROMPTS, max_new_tokens=40).token_ids
    chain = fx.SPECS["chain"]
    drafters = {"ngram-chain": (NgramDrafter(chain, fx.MAX_SEQ_LEN), {}),
                "eagle3-dynamic": (Eagle3Drafter(fx.HEAD, config, fx.SPECS["dynamic"], fx.MAX_SEQ_LEN),
                                   fx.random_head()),
                "draft-model-chain": (DraftModelDrafter(config, config, chain, fx.MAX_SEQ_LEN), params)}
    for name, (drafter, drafter_params) in drafters.items():
        out = jspec.SpecEngine(config, params, drafter=drafter, drafter_params=drafter_params,
                               **kwargs).generate(PROMPTS, max_new_tokens=40)
        assert out.token_ids == plain, name
        if name == "draft-model-chain":  # the target drafting for itself: every draft accepted
            assert out.stats.acceptance_length > 4.0, out.stats
