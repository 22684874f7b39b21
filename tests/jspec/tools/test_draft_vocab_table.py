"""scripts/draft_vocab_table.py's rows on the bundled model: its EAGLE-3 head written back to the HF layout, cut
to two sizes; outputs equal plain decoding, coverage grows with N and at the head's own size is the share of the
counted tokens that are its draft-vocabulary members."""

import json
import os

import jax
import numpy as np
import pytest

import jspec
from jspec.tools.draft_vocab_table import HEADER, draft_vocab_rows, format_row
from models.checkpoint import load_eagle3, write_hf_eagle3

# slow: scripts/draft_vocab_table.py's rows on the bundled head; default tier: test_draft_vocab (shrink_draft_vocab)
pytestmark = pytest.mark.slow


def test_rows_for_two_sizes_of_the_bundled_head(tmp_path):
    bundle = os.path.dirname(jspec.bundled_model())
    head_dir = os.path.join(bundle, "eagle3")
    with open(os.path.join(head_dir, "config.json")) as f:
        hf_config = json.load(f)
    _, params, d2t, _ = load_eagle3(head_dir)
    head_hf = write_hf_eagle3(str(tmp_path / "head_hf"), hf_config,
                              jax.tree.map(lambda x: np.asarray(x, np.float32), params), np.asarray(d2t))
    tokens = np.random.default_rng(0).zipf(1.2, 20000) % hf_config["vocab_size"]
    spec = jspec.SpecConfig(tree="dynamic", num_steps=3, topk=2, num_draft_tokens=6, selection="top1_chain")
    rows = draft_vocab_rows(jspec.bundled_model(), head_hf, tokens, [256, hf_config["draft_vocab_size"]],
                            ["def fibonacci(n):", "import os\n\ndef walk(path):"], spec, batch_size=2,
                            max_new_tokens=12, max_seq_len=256, repeats=1, log=lambda line: None)
    small, full = rows
    assert [r["mismatches"] for r in rows] == [0, 0]
    members = np.arange(len(d2t)) + np.asarray(d2t, np.int64)
    assert 0 < small["coverage"] < full["coverage"] == pytest.approx(np.isin(tokens, members).mean())
    assert all(r["acceptance_length"] >= 1.0 and r["step_ms"] > 0 and r["chain3_step_ms"] > 0 for r in rows)
    assert full["acceptance_length"] > 1.0
    assert format_row(full).count("|") == HEADER.count("|")
