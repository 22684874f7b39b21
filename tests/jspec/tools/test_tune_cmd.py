"""`jspec tune`: times every candidate of spec="auto" on this device now, whatever is cached or shipped, and caches
the step costs where a later `jspec generate` with the same shapes finds them."""

import json
import os

import jspec
from jspec import autotune
from jspec.tools.cli import main
def test_tune_times_every_candidate_and_caches_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JSPEC_HOME", str(tmp_path))
    assert main(["tune", "--drafter", "ngram", "--max-seq-len", "64", "--no-compile-cache"]) == 0
    captured = capsys.readouterr()
    assert "auto: timing 3 methods once on this device" in captured.err
    assert "step costs measured on this device" in captured.out and "ngram chain 9" in captured.out
    key = autotune.cache_key(jspec.bundled_model(), ["ngram"], 1, 64, None)
    cached = json.load(open(os.path.join(tmp_path, "auto", key + ".json")))
    assert sorted(k.split(" | ")[0] for k in cached["step_seconds"]) == ["ngram chain 4", "ngram chain 9", "plain"]
    assert all(k.endswith("| streamed") and v > 0 for k, v in cached["step_seconds"].items())


def test_tune_refuses_bad_flags_in_one_line(capsys):
    assert main(["tune", "--batch-size", "0"]) == 2
    assert capsys.readouterr().err == "jspec: error: --batch-size 0: expected an integer >= 1\n"
    assert main(["tune", "--drafter", "none"]) == 2
    assert "--drafter none" in capsys.readouterr().err
