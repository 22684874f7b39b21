"""Drafters as published for a mixture-of-experts target load and stay lossless on it: an EAGLE-3 head in
SpecForge's layout (as the heads trained for Qwen3-30B-A3B and gpt-oss ship) and a DFlash drafter in z-lab's, each
converted with ``jspec convert``'s converter, loaded by name through ``jspec.drafters.load`` and run on a Qwen3-MoE
target and on a gpt-oss one (sinks, expert biases, windows of 8 the sequences pass): greedy tokens equal plain
decoding's."""

from __future__ import annotations

import jax
import pytest

import jspec
from jspec.drafters import load as load_drafter
from models.checkpoint import convert_hf_checkpoint, write_hf_eagle3
from models.eagle3 import init_eagle3_params
from tests import spec_fixtures as fx
from tests.models.test_dflash import HF as DFLASH_HF, make_reference, write_zlab
from tests.models.test_eagle3_layouts import SPECFORGE
from tests.models.test_moe import MOE
from tests.models.test_windowed_speculation import WINDOWED, near_bigram

# slow (two drafters converted and compiled on the MoE target); default tier: test_moe's EAGLE-3 and n-gram
# speculation on a MoE target, test_eagle3_layouts' and test_dflash's conversions
pytestmark = pytest.mark.slow
PROMPTS = [[5, 9, 5, 9, 5, 9, 12], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [7]]


TARGETS = {"qwen3_moe": MOE, "gpt_oss": WINDOWED["gpt_oss"]}


def run(drafter_dir, config, params, spec=None):
    drafter, drafter_params = load_drafter(drafter_dir, target=config, target_dir=None, spec=spec,
                                           max_seq_len=fx.MAX_SEQ_LEN, dtype="float32")
    engine = jspec.SpecEngine(config, params, drafter=drafter, drafter_params=drafter_params, max_batch_size=4,
                              max_seq_len=fx.MAX_SEQ_LEN)
    return engine.generate(PROMPTS, max_new_tokens=24).token_ids


@pytest.fixture(scope="module", params=sorted(TARGETS))
def target(request):
    config = TARGETS[request.param]
    params = near_bigram(config)
    plain = jspec.SpecEngine(config, params, max_batch_size=4, max_seq_len=fx.MAX_SEQ_LEN)
    return request.param, config, params, plain.generate(PROMPTS, max_new_tokens=24).token_ids


def test_a_specforge_eagle3_head_for_a_moe_target(target, tmp_path):
    model_type, config, params, plain = target
    head = init_eagle3_params(fx.HEAD, jax.random.key(3))
    hf = dict(SPECFORGE, target_model_type=model_type, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]})
    write_hf_eagle3(tmp_path / "hf", hf, head, jax.numpy.zeros((64,), jax.numpy.int32))
    converted = convert_hf_checkpoint(str(tmp_path / "hf"), str(tmp_path / "jspec"), progress=False)
    assert run(converted, config, params, fx.SPECS["dynamic"]) == plain


def test_a_zlab_dflash_drafter_for_a_moe_target(target, tmp_path):
    _, config, params, plain = target
    src = write_zlab(tmp_path / "hf", DFLASH_HF, make_reference().tensors())
    converted = convert_hf_checkpoint(src, str(tmp_path / "jspec"), progress=False)
    assert run(converted, config, params) == plain
