"""jspec bench (jspec/bench.py): argument checks, the acceptance histogram, and one small end-to-end run whose
jspec and transformers outputs must agree token for token."""

import json
import os

import pytest

from jspec.tools import bench


def test_acceptance_histogram_from_per_position_fractions():
    # 100% of steps accepted >= 1 draft, 60% >= 2, 10% >= 3 (depth 3)
    hist = bench.acceptance_histogram([1.0, 0.6, 0.1])
    assert hist == pytest.approx([0.0, 0.4, 0.5, 0.1])
    assert sum(hist) == pytest.approx(1.0)
    assert bench.acceptance_histogram([]) == [1.0]  # plain decoding: every step commits one token


@pytest.mark.parametrize("flags, message", [
    (["--methods", "ngram"], "'plain'"),
    (["--methods", "plain,warp-drive"], "warp-drive"),
    (["--peers", "vllm"], "vllm"),
    (["--batch-sizes", "1,x"], "comma-separated integers"),
    (["--batch-sizes", "0"], "positive"),
    (["--repeats", "0"], "--repeats 0"),
    (["--ngram-depth", "0"], "--ngram-depth 0"),
    (["--methods", "plain,dflash"], "needs --dflash DIR"),
    (["--quantization", "none,int3"], "int3"),
])
def test_bad_arguments_are_refused_before_any_model_loads(flags, message, monkeypatch):
    monkeypatch.setattr(bench, "jspec_rows", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(ValueError, match=message):
        bench.main(flags)


def test_chart_and_table_from_rows(tmp_path, capsys):
    rows = [bench.Row("plain", 1, 100.0, [100.0], None, 1.0, 64, 2.0, None, [1.0]),
            bench.Row("ngram", 1, 150.0, [150.0], 1.5, 2.0, 64, 3.0, 0, [0.2, 0.5, 0.3]),
            bench.Row("hf-plain", 1, 20.0, [20.0], 0.2, None, 64, 0.0, 0, [], peer=True)]
    path = tmp_path / "chart.png"
    assert bench.write_chart(rows, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bench.print_table(rows)
    out = capsys.readouterr().out
    assert "ngram" in out and "1.50x" in out


# slow: jspec bench's table against transformers' generation; default tier: the bench argument and report tests
@pytest.mark.slow
def test_small_run_matches_transformers(tmp_path):
    assert bench.main(["--methods", "plain,ngram", "--peers", "hf-plain,hf-prompt-lookup", "--batch-sizes", "1",
                       "--num-prompts", "2", "--max-new-tokens", "6", "--repeats", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["method"]: r for r in report["rows"]}
    assert set(rows) == {"plain", "ngram", "hf-plain", "hf-prompt-lookup"}
    assert rows["ngram"]["mismatches"] == 0
    assert rows["hf-plain"]["mismatches"] == 0 and rows["hf-prompt-lookup"]["mismatches"] == 0
    assert rows["plain"]["num_generated_tokens"] == 12
    assert all(r["tokens_per_second"] > 0 for r in report["rows"])
    assert os.path.isfile(tmp_path / "bench.png")


# slow: jspec bench --quantization none,int8 runs every method on both weight formats, each lossless against its own
# plain decoding; default tier: the --quantization argument test and test_quantized_engine's default cases
@pytest.mark.slow
def test_methods_side_by_side_on_quantized_weights(tmp_path):
    """--quantization none,int8: every method on both weight formats in one run, each speculative method lossless
    against plain decoding of its own weights."""
    assert bench.main(["--methods", "plain,ngram", "--peers", "", "--quantization", "int8,none", "--batch-sizes", "1",
                       "--num-prompts", "2", "--max-new-tokens", "8", "--repeats", "1", "--out", str(tmp_path)]) == 0
    rows = {r["method"]: r for r in json.loads((tmp_path / "bench.json").read_text())["rows"]}
    assert list(rows) == ["plain", "ngram", "plain (int8)", "ngram (int8)"]
    assert rows["ngram"]["mismatches"] == 0 and rows["ngram (int8)"]["mismatches"] == 0
    assert rows["plain (int8)"]["quantization"] == "int8" and rows["plain"]["quantization"] is None

