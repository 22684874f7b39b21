"""The bundled code model: three converted parts that load together, small enough to ship, picked by default."""

import argparse
import os

import jax
import pytest

from jspec.tools import bundled
from jspec.tools.generate_cmd import resolve_models
from models.checkpoint import load_eagle3, load_llama
from models.eagle3 import Eagle3Config
def test_the_three_parts_load_and_fit_together():
    target, _, target_dtype = load_llama(bundled.bundled_dir("target"))
    head_config, _, d2t, _ = load_eagle3(bundled.bundled_dir("eagle3"))
    draft, _, _ = load_llama(bundled.bundled_dir("draft"))
    head_config.check_target(target)
    assert len(set(Eagle3Config.tap_layers(target))) == 3  # layers 2, L//2, L-3 are distinct
    assert draft.vocab_size == target.vocab_size and draft.num_layers <= 2
    assert target_dtype == "bfloat16"
    for part in bundled.PARTS:
        assert os.path.isfile(os.path.join(bundled.bundled_dir(part), "tokenizer.json")) or part == "eagle3"
def test_bundle_is_small_enough_to_ship():
    size = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(bundled.BUNDLE_DIR)
               for f in files)
    assert size < 40 * 2 ** 20, f"{size / 2 ** 20:.1f} MiB"
def test_generate_defaults_to_the_bundled_model_with_the_backends_fastest_drafter():
    args = argparse.Namespace(model=None, drafter=None)
    model_dir, drafter, _ = resolve_models(args)
    expected = "ngram" if jax.default_backend() == "cpu" else "eagle3"  # the registry's name, as in Python
    assert (model_dir, drafter) == (bundled.bundled_dir("target"), expected)
    args = argparse.Namespace(model=None, drafter="draft")
    assert resolve_models(args)[1] == "draft"
    args = argparse.Namespace(model=None, drafter="none")
    assert resolve_models(args)[1] is None
    args = argparse.Namespace(model=bundled.bundled_dir("draft"), drafter="eagle3")
    with pytest.raises(ValueError, match="drafter='eagle3' names the bundled code model's eagle3"):
        resolve_models(args)


@pytest.mark.parametrize("size", [2, 8, 16, 32])
def test_trees_of_the_same_size(size):
    for tree in ("chain", "static", "dynamic"):
        assert bundled.spec_for(tree, size, num_steps=6, topk=4).tree_size == size


def test_ranked_paths_are_prefix_closed_in_order():
    for i, path in enumerate(bundled.RANKED_PATHS):
        assert len(path) == 1 or path[:-1] in bundled.RANKED_PATHS[:i]


def test_default_trees_per_drafter():
    assert bundled.default_method("cpu") == ("ngram", bundled.CPU_SPEC)
    assert bundled.default_method("gpu") == ("eagle3", bundled.DEFAULT_SPEC)
    assert bundled.default_spec("ngram").tree == "chain" and bundled.default_spec("ngram").tree_size == 10
    assert bundled.default_spec("eagle3") == bundled.default_spec("draft") == bundled.DEFAULT_SPEC
