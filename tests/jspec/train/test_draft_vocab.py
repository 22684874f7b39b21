"""shrink_draft_vocab: a head's draft vocabulary cut to its N most frequent members keeps those members' lm_head
rows unchanged, with d2t/t2d that map them back, and converts through our converter."""

import json
import os

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from jspec.train.draft_vocab import shrink_draft_vocab
from jspec.train.eagle3_head import draft_vocab_maps, eagle3_hf_config
from models.checkpoint import convert_hf_checkpoint, load_eagle3, write_hf_eagle3
from models.eagle3 import eagle3_config_from_hf, init_eagle3_params

TARGET_HF = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": 64}


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """(HF directory of a random head with a 40-token draft vocabulary, the token stream it was counted on)."""
    rng = np.random.default_rng(0)
    tokens = rng.zipf(1.3, 5000) % 64
    d2t, _ = draft_vocab_maps(tokens, 64, 40)
    hf_config = eagle3_hf_config(TARGET_HF, 40)
    params = init_eagle3_params(eagle3_config_from_hf(hf_config), jax.random.key(0))
    out = str(tmp_path_factory.mktemp("head") / "full")
    write_hf_eagle3(out, hf_config, jax.tree.map(np.asarray, params), d2t)
    return out, tokens


def _rows_by_target_id(directory):
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    ids = np.arange(len(tensors["d2t"])) + tensors["d2t"]
    return dict(zip(ids.tolist(), tensors["lm_head.weight"])), tensors


def test_keeps_the_most_frequent_members_rows_unchanged(head, tmp_path):
    src, tokens = head
    full, _ = _rows_by_target_id(src)
    dst = shrink_draft_vocab(src, str(tmp_path / "small"), 16, tokens)
    small, tensors = _rows_by_target_id(dst)
    counts = np.bincount(tokens, minlength=64)
    members = np.array(sorted(full))
    expected = members[np.lexsort((members, -counts[members]))[:16]]
    assert sorted(small) == sorted(expected.tolist())
    for target_id, row in small.items():
        np.testing.assert_array_equal(row, full[target_id])
    assert np.flatnonzero(tensors["t2d"]).tolist() == sorted(small)
    assert tensors["d2t"].dtype == np.int64 and tensors["t2d"].dtype == np.bool_
    assert json.load(open(os.path.join(dst, "config.json")))["draft_vocab_size"] == 16
    config, params, d2t, _ = load_eagle3(convert_hf_checkpoint(dst, str(tmp_path / "conv"), dtype="float32",
                                                               progress=False))
    assert config.draft_vocab_size == 16
    np.testing.assert_array_equal(np.arange(16) + np.asarray(d2t), sorted(small))
    kernel = np.asarray(params["lm_head"]["kernel"])  # [hidden, V_draft]: draft id d is column d
    for d, target_id in enumerate(sorted(small)):
        np.testing.assert_allclose(kernel[:, d], full[target_id], rtol=0, atol=0)


def test_bad_sizes_and_heads_are_refused_before_writing(head, tmp_path):
    src, tokens = head
    for size in (0, 41):
        with pytest.raises(ValueError, match=f"size={size}: expected 1..40"):
            shrink_draft_vocab(src, str(tmp_path / "bad"), size, tokens)
    assert not os.path.exists(tmp_path / "bad")
    os.makedirs(tmp_path / "nohead")
    json.dump(TARGET_HF, open(tmp_path / "nohead" / "config.json", "w"))
    from safetensors.numpy import save_file
    save_file({"d2t": np.zeros(4, np.int64)}, str(tmp_path / "nohead" / "model.safetensors"))
    with pytest.raises(ValueError, match="no 'lm_head.weight' tensor"):
        shrink_draft_vocab(str(tmp_path / "nohead"), str(tmp_path / "bad"), 2, tokens)
    assert not os.path.exists(tmp_path / "bad")
