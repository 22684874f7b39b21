"""PARD training (jspec/train/pard.py): the packed forward of K shifted mask copies gives, at every (copy k,
position p), exactly the logits PARD's inference reads there (one causal pass over the text up to p - k followed
by k pard tokens); `train_pard` learns, exports AMD's layout, converts and drives the engine losslessly."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.train.pard import copies_mask, pard_logits
from jspec.train.target import causal_lm_logits
from models.config import ModelConfig
from models.llama import init_params
from tests import train_fixtures as tf

DRAFT = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                    head_dim=8)
PARD = 31


def test_every_copy_position_equals_the_inference_forward():
    params = init_params(DRAFT, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 30)
    copies = 4
    packed = pard_logits(params, tokens, draft=DRAFT, num_copies=copies, pard_token=PARD)   # [B, K, W, V]
    reference = jax.jit(causal_lm_logits, static_argnames="config")
    for k in range(copies):
        for p in (3, 7, 11):  # the reference's width is p + 1 whatever k: three programs
            ids = jnp.concatenate([tokens[:, :p - k + 1], jnp.full((2, k), PARD, jnp.int32)], axis=1)
            want = reference(params, ids, config=DRAFT)[:, -1]
            np.testing.assert_allclose(packed[:, k, p], want, atol=2e-5, err_msg=f"copy {k}, position {p}")


def test_the_mask_lets_a_copy_see_only_its_own_context():
    mask = copies_mask(3, 5)
    row = 2 * 5 + 4   # copy 2 at position 4: real tokens 0..2, pard 1 at 3 (copy 1), pard 2 at 4 (copy 2)
    assert np.flatnonzero(mask[row]).tolist() == [0, 1, 2, 5 + 3, 2 * 5 + 4]
    assert np.flatnonzero(mask[1 * 5 + 0]).tolist() == [5]   # no real token before it: itself only


# slow: PARD training -> AMD's layout -> convert -> the engine, greedy = plain; default tier:
# test_every_copy_position_equals_the_inference_forward (the packed copies are PARD's inference) and
# test_train_drafter's DFlash round trip (train, export, convert, drive the engine)
@pytest.mark.slow
def test_pard_trains_converts_and_drives_the_engine_losslessly(tmp_path_factory, tiny_trained_target):
    import jspec
    from jspec.drafters.pard import PardDrafter
    from jspec.train.pard import train_pard
    from models.checkpoint import convert_hf_checkpoint, read_hf_config

    target_hf, _, corpus = tiny_trained_target
    tmp = str(tmp_path_factory.mktemp("pard"))
    out = os.path.join(tmp, "pard_hf")
    report = train_pard(out, target_hf, os.path.join(tmp, "work"), tf.FEW_STEPS, num_layers=1, num_copies=4,
                        corpus_root=corpus, progress=False, log=lambda line: None)
    assert tf.loss_fell(report["first_losses"] + report["last_losses"], by=0.3), report
    config = read_hf_config(out)
    assert config["spd_type"] == "pard" and config["pard_token"] == report["pard_token"]
    assert len(report["heldout_accuracy"]) == 4
    drafter_dir = convert_hf_checkpoint(out, os.path.join(tmp, "pard"), progress=False)
    target_dir = convert_hf_checkpoint(target_hf, os.path.join(tmp, "target"), progress=False)
    spec = jspec.SpecConfig(tree="chain", num_steps=4)
    engine = jspec.SpecEngine.from_pretrained(target_dir, drafter=drafter_dir, spec=spec, max_batch_size=4,
                                              max_seq_len=96)
    assert isinstance(engine.setup.drafter, PardDrafter)
    prompts = [[5, 9, 13, 2], [40, 41, 42], [7] * 6]
    plain = jspec.SpecEngine.from_pretrained(target_dir, max_batch_size=4, max_seq_len=96)
    generated = engine.generate(prompts, max_new_tokens=24)
    assert generated.token_ids == plain.generate(prompts, max_new_tokens=24).token_ids
    assert generated.stats.acceptance_length > 1.2, generated.stats


def test_a_bad_number_of_copies_is_refused_before_any_work(tmp_path):
    from jspec.train.pard import train_pard

    with pytest.raises(ValueError, match=r"num_copies=1: expected an integer >= 2"):
        train_pard(str(tmp_path / "out"), str(tmp_path / "no-target"), str(tmp_path / "work"), tf.FEW_STEPS,
                   num_copies=1)
    assert not os.listdir(tmp_path)
