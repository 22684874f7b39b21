"""scripts/train_drafter.py's machinery on a tiny trained target: for the EAGLE-3 head and the draft model, the
loss falls, and the written HF directory converts through our converter and fits the target; the converted head
drives the engine, whose greedy output is plain decoding's."""

import dataclasses
import os

import jax
import numpy as np
import pytest

from jspec.train.draft_model import train_draft_model
from jspec.train.eagle3_head import draft_vocab_maps, train_eagle3
from jspec.train.target import load_hf_llama
from models.checkpoint import checkpoint_kind, convert_hf_checkpoint, load_eagle3, load_llama
from tests import train_fixtures as tf

DRAFT_VOCAB = 200  # < the target's 300: exercises d2t / t2d


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_trained_target):
    tmp = str(tmp_path_factory.mktemp("drafters"))
    target_hf, _, corpus = tiny_trained_target
    return tmp, target_hf, corpus


def test_draft_vocab_maps_keep_the_most_frequent_tokens():
    tokens = np.array([5, 5, 5, 1, 1, 9, 9, 9, 9, 0])
    d2t, t2d = draft_vocab_maps(tokens, 10, 3)
    np.testing.assert_array_equal(np.arange(3) + d2t, [1, 5, 9])
    assert t2d.sum() == 3 and t2d[[1, 5, 9]].all()


@pytest.fixture(scope="module")
def eagle3_hf(setup):
    """(HF directory of an EAGLE-3 head trained a few steps, its report)."""
    tmp, target_hf, corpus = setup
    out = os.path.join(tmp, "eagle3_hf")
    report = train_eagle3(out, target_hf, os.path.join(tmp, "eagle3_work"), tf.FEW_STEPS,
                          draft_vocab_size=DRAFT_VOCAB, unroll=3, corpus_root=corpus, progress=False,
                          log=lambda line: None)
    return out, report


def test_eagle3_head_trains_and_converts(setup, eagle3_hf):
    tmp, target_hf, _ = setup
    out, report = eagle3_hf
    assert tf.loss_fell(report["first_losses"] + report["last_losses"], by=0.3), report
    assert checkpoint_kind(out) == "eagle3"
    dst = convert_hf_checkpoint(out, os.path.join(tmp, "eagle3"), dtype="bfloat16", progress=False)
    config, head, d2t, dtype = load_eagle3(dst)
    assert (config.draft_vocab_size, config.target_vocab_size, dtype) == (DRAFT_VOCAB, 300, "bfloat16")
    t2d = np.load(os.path.join(out, "t2d.npy"))
    np.testing.assert_array_equal(np.flatnonzero(t2d), np.arange(DRAFT_VOCAB) + np.asarray(d2t))
    from safetensors.numpy import load_file
    stored = load_file(os.path.join(out, "model.safetensors"))  # SpecForge's layout: d2t and t2d inside
    assert stored["t2d"].dtype == np.bool_ and stored["d2t"].dtype == np.int64
    np.testing.assert_array_equal(stored["t2d"], t2d)
    assert len(report["heldout_step_accuracy"]) == 3 and all(0 <= a <= 1 for a in report["heldout_step_accuracy"])
    target, _, _ = load_hf_llama(target_hf)
    config.check_target(target)


# slow: a trained, exported, converted EAGLE-3 head drives the engine = plain; default tier:
# test_dflash_trains_converts_and_drives_the_engine_losslessly (the same round trip for DFlash),
# test_eagle3_head_trains_and_converts
@pytest.mark.slow
def test_exported_head_drives_the_engine_losslessly(setup, eagle3_hf):
    """train -> HF export (d2t, t2d) -> convert -> engine: the head drafts through d2t, greedy output is the
    target's own."""
    import jspec
    from jspec.drafters.eagle3 import Eagle3Drafter
    from tokenizers import Tokenizer

    tmp, target_hf, _ = setup
    dst = convert_hf_checkpoint(eagle3_hf[0], os.path.join(tmp, "eagle3_f32"), dtype="float32", progress=False)
    config, head, d2t, _ = load_eagle3(dst)
    target, params_t, _ = load_hf_llama(target_hf)
    tokenizer = Tokenizer.from_file(os.path.join(target_hf, "tokenizer.json"))
    prompts = [tokenizer.encode(text).ids for text in ("def insort(a, x):\n    ", "import ", "class Scheduler:\n")]
    spec = jspec.SpecConfig(tree="chain", num_steps=3)
    engine = jspec.SpecEngine(target, params_t, drafter=Eagle3Drafter(config, target, spec, 96),
                              drafter_params={"head": head, "d2t": d2t}, max_batch_size=4, max_seq_len=96)
    plain = jspec.SpecEngine(target, params_t, max_batch_size=4, max_seq_len=96)
    out = engine.generate(prompts, max_new_tokens=24)
    assert out.token_ids == plain.generate(prompts, max_new_tokens=24).token_ids
    # The few-step target repeats a token whose draft id is not its target id (d2t offset 100 here): drafts that
    # get accepted went through d2t correctly (measured 3.8 tokens per step of at most 4).
    assert out.stats.acceptance_length > 2.0


# slow: --init-head starts a stage from an earlier head; default tier: test_eagle3_head_trains_and_converts
@pytest.mark.slow
def test_a_second_stage_starts_from_the_first_stages_head(setup, eagle3_hf):
    """init_head: the weights and draft vocabulary of a trained head, a fresh optimizer: the second stage's first
    loss is the first stage's trained level, far below a fresh head's."""
    from safetensors.numpy import load_file

    tmp, target_hf, corpus = setup
    first, report = eagle3_hf
    second = train_eagle3(os.path.join(tmp, "eagle3_stage2"), target_hf, os.path.join(tmp, "eagle3_stage2_work"),
                          dataclasses.replace(tf.FEW_STEPS, steps=2, warmup_steps=1),
                          unroll=3, corpus_root=corpus, progress=False, log=lambda line: None, init_head=first)
    assert second["init_head"] == first
    assert second["first_losses"][0] < report["first_losses"][0] - 0.3, (second["first_losses"], report)
    np.testing.assert_array_equal(load_file(os.path.join(tmp, "eagle3_stage2", "model.safetensors"))["d2t"],
                                  load_file(os.path.join(first, "model.safetensors"))["d2t"])
    with pytest.raises(ValueError, match=f"draft_vocab_size=100, but init_head=.* has {DRAFT_VOCAB}"):
        train_eagle3(os.path.join(tmp, "never"), target_hf, os.path.join(tmp, "never_work"), tf.FEW_STEPS,
                     draft_vocab_size=100, unroll=3, corpus_root=corpus, progress=False, log=lambda line: None,
                     init_head=first)
    assert not os.path.exists(os.path.join(tmp, "never")) and not os.path.exists(os.path.join(tmp, "never_work"))


# slow: a draft model trains and converts; default tier: test_eagle3_head_trains_and_converts
@pytest.mark.slow
def test_draft_model_trains_and_converts(setup):
    tmp, target_hf, corpus = setup
    out = os.path.join(tmp, "draft_hf")
    report = train_draft_model(out, target_hf, os.path.join(tmp, "draft_work"), tf.FEW_STEPS, num_layers=1,
                               corpus_root=corpus, progress=False, log=lambda s: None)
    assert tf.loss_fell(report["first_losses"] + report["last_losses"], by=0.3), report
    assert checkpoint_kind(out) == "llama"
    dst = convert_hf_checkpoint(out, os.path.join(tmp, "draft"), dtype="bfloat16", progress=False)
    config, params, _ = load_llama(dst)
    assert config.num_layers == 1 and config.vocab_size == 300
    assert jax.tree.leaves(params)[0].dtype == np.dtype("bfloat16")


def test_dflash_trains_converts_and_drives_the_engine_losslessly(setup):
    """train (SpecForge's recipe) -> z-lab's layout -> convert -> from_pretrained (the drafter's default tree: its
    whole block as a chain): greedy output is the target's own, and the trained blocks get drafts accepted (the
    few-step target repeats itself)."""
    import jspec
    from tokenizers import Tokenizer

    from jspec.train.dflash import train_dflash
    from models.checkpoint import load_dflash

    tmp, target_hf, corpus = setup
    out = os.path.join(tmp, "dflash_hf")
    report = train_dflash(out, target_hf, os.path.join(tmp, "dflash_work"), tf.FEW_STEPS, num_layers=1,
                          block_size=4, num_anchors=8, corpus_root=corpus, progress=False, log=lambda line: None)
    assert tf.loss_fell(report["first_losses"] + report["last_losses"], by=0.3), report
    assert checkpoint_kind(out) == "dflash" and len(report["heldout_accuracy"]) == 3
    drafter_dir = convert_hf_checkpoint(out, os.path.join(tmp, "dflash"), progress=False)
    config, _, _ = load_dflash(drafter_dir)
    target, _, _ = load_hf_llama(target_hf)
    assert config.tap_layers(target) == tuple(i + 1 for i in report["target_layer_ids"])
    target_dir = convert_hf_checkpoint(target_hf, os.path.join(tmp, "dflash_target"), progress=False)
    engine = jspec.SpecEngine.from_pretrained(target_dir, drafter=drafter_dir, max_batch_size=4, max_seq_len=96)
    assert engine.setup.spec == jspec.SpecConfig(tree="chain", num_steps=3)
    tokenizer = Tokenizer.from_file(os.path.join(target_hf, "tokenizer.json"))
    prompts = [tokenizer.encode(text).ids for text in ("def insort(a, x):\n    ", "import ", "class Scheduler:\n")]
    plain = jspec.SpecEngine.from_pretrained(target_dir, max_batch_size=4, max_seq_len=96)
    out = engine.generate(prompts, max_new_tokens=24)
    assert out.token_ids == plain.generate(prompts, max_new_tokens=24).token_ids
    assert out.stats.acceptance_length > 1.5, out.stats


# slow: DSpark trained with DeepSpec's loss, exported in its layout, converted, lossless in the engine; default tier:
# test_dflash_trains_converts_and_drives_the_engine_losslessly (the same loop and round trip), test_dflash's DSpark
# reference and engine tests
@pytest.mark.slow
def test_dspark_trains_in_deepspecs_layout_and_drives_the_engine_losslessly(setup):
    """DeepSpec's recipe (Markov head teacher-forced, CE + L1 + confidence BCE) -> DeepSpec's layout (with the
    frozen embedding / lm_head copies) -> convert -> the engine with the confidence cut: output = plain decoding."""
    import jspec
    from jspec.train.dflash import train_dflash
    from models.checkpoint import load_dflash

    tmp, target_hf, corpus = setup
    out = os.path.join(tmp, "dspark_hf")
    report = train_dflash(out, target_hf, os.path.join(tmp, "dspark_work"), tf.FEW_STEPS, num_layers=1,
                          block_size=3, num_anchors=8, gamma=4.0, corpus_root=corpus, progress=False,
                          log=lambda line: None, markov_rank=16)
    assert tf.loss_fell(report["first_losses"] + report["last_losses"], by=0.1), report
    from safetensors.numpy import load_file
    assert {"embed_tokens.weight", "lm_head.weight", "markov_head.markov_w1.weight",
            "confidence_head.proj.weight"} <= set(load_file(os.path.join(out, "model.safetensors")))
    drafter_dir = convert_hf_checkpoint(out, os.path.join(tmp, "dspark"), progress=False)
    config, _, _ = load_dflash(drafter_dir)
    assert (config.layout, config.markov_rank, config.num_drafts) == ("dspark", 16, 3)
    target_dir = convert_hf_checkpoint(target_hf, os.path.join(tmp, "dspark_target"), progress=False)
    engine = jspec.SpecEngine.from_pretrained(target_dir, drafter=drafter_dir, max_batch_size=4, max_seq_len=96)
    assert engine.setup.spec == jspec.SpecConfig(tree="chain", num_steps=3)
    plain = jspec.SpecEngine.from_pretrained(target_dir, max_batch_size=4, max_seq_len=96)
    prompts = [[1, 40, 41, 42], [1, 7, 9]]
    out = engine.generate(prompts, max_new_tokens=20)
    assert out.token_ids == plain.generate(prompts, max_new_tokens=20).token_ids
