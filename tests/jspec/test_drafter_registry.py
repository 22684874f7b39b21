"""The drafter registry: one vocabulary of drafter names for Python, CLI, bench and eval; the protocol every
drafter satisfies; errors that name the value."""

import dataclasses
import json

import pytest

import jspec
from jspec.bundle import bundled_dir
from jspec.drafters import DRAFTERS, Drafter, load, resolve
from jspec.drafters.draft_model import DraftModelDrafter
from jspec.drafters.eagle3 import Eagle3Drafter
from jspec.drafters.ngram import NgramDrafter
from models.checkpoint import load_llama

SPEC = jspec.SpecConfig(tree="chain", num_steps=3)


def test_every_entry_is_complete():
    assert set(DRAFTERS) == {"eagle3", "draft", "ngram", "ngram+eagle3", "mtp", "mtp_vanilla", "dflash"}
    for name, entry in DRAFTERS.items():
        assert callable(entry.load) and entry.description
        assert entry.bundled_part is None or entry.checkpoint_kind is not None, name
        assert (entry.checkpoint_kind is None) == (entry.bundled_part is None) or name == "dflash", name
        assert entry.weights_from_target == name.startswith("mtp"), name  # weights inside the target directory
@pytest.mark.parametrize("name,cls", [("eagle3", Eagle3Drafter), ("draft", DraftModelDrafter),
                                      ("ngram", NgramDrafter)])
def test_names_load_drafters_that_satisfy_the_protocol(name, cls):
    target_dir = jspec.bundled_model()
    config, _, _ = load_llama(target_dir)
    drafter, params = load(name, target=config, target_dir=target_dir, spec=SPEC, max_seq_len=64, dtype="float32")
    assert type(drafter) is cls and isinstance(drafter, Drafter)
    assert drafter.spec == SPEC and drafter.max_seq_len == 64
    resized = drafter.with_max_seq_len(128)
    assert resized.max_seq_len == 128 and type(resized) is cls
    assert dataclasses.replace(resized, max_seq_len=64) == drafter  # hashable, static: equal when resized back
    assert hash(drafter) == hash(resized.with_max_seq_len(64))
    assert (params == {}) == (name == "ngram")
def test_a_directory_resolves_by_its_kind():
    target_dir = jspec.bundled_model()
    assert resolve(bundled_dir("eagle3"), target_dir) == ("eagle3", bundled_dir("eagle3"))
    assert resolve(bundled_dir("draft"), target_dir) == ("draft", bundled_dir("draft"))
    assert resolve("eagle3", target_dir) == ("eagle3", bundled_dir("eagle3"))
    assert resolve("ngram", None) == ("ngram", None)
def test_a_weighted_name_needs_the_bundled_target():
    with pytest.raises(ValueError, match=r"drafter='eagle3'.*bundled target.*pass the converted drafter's directory"):
        resolve("eagle3", bundled_dir("draft"))


def test_unknown_names_and_kinds_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"drafter='medusa': expected one of \['dflash', 'draft', 'eagle3', 'mtp', "
                       r"'mtp_vanilla', 'ngram', 'ngram\+eagle3'\]"):
        resolve("medusa", None)
    (tmp_path / "jspec.json").write_text(json.dumps({"kind": "mtp"}))
    with pytest.raises(ValueError, match=r"holds a 'mtp' checkpoint"):
        resolve(str(tmp_path), None)


def test_the_engine_refuses_a_non_drafter():
    config, params = object(), object()
    with pytest.raises(ValueError, match="expected a jspec.drafters.Drafter"):
        jspec.SpecEngine(config, params, drafter="eagle3", drafter_params={})
