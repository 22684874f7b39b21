"""The roofline's report (jspec/tools/roofline/report.py): ratios, the report's header fields and its table, on
rows and abstract models made by hand (nothing is timed or compiled)."""

import json
import os

import pytest

from jspec.tools.roofline import report as rp
from jspec.tools.roofline.shapes import CHAIN, DYNAMIC, PLAIN
from tests.jspec.tools.test_roofline_floor import BF16, TINY_EMBED, TINY_HEAD, TINY_TARGET, abstract_models


def timed_row(method, batch, step, accept, floor_total, k=None, reached=True):
    return {"method": method, "batch": batch, "force_accept": k, "status": "ok", "step_seconds": step,
            "acceptance_length": accept, "tokens_per_second": batch * accept / step,
            "floor_bytes": {"total": floor_total}, "compile_seconds": 12.34, "forced_acceptance_reached": reached}


def test_ratios_against_plain_decoding_at_the_same_batch():
    rows = [timed_row(PLAIN, 1, 0.010, 1.0, 2e9), timed_row(CHAIN, 1, 0.012, 5.0, 2e9, 4),
            timed_row(CHAIN, 8, 0.02, 5.0, 2e9, 4), {"method": PLAIN, "batch": 8, "status": "oom"}]
    rp.add_ratios(rows, bandwidth=1e12)
    assert rows[0]["spec_over_plain_step"] == 1.0 and rows[0]["floor_seconds"] == pytest.approx(2e-3)
    assert rows[0]["step_over_floor"] == pytest.approx(5.0)
    assert rows[1]["spec_over_plain_step"] == pytest.approx(1.2)
    assert rows[1]["tokens_per_second_over_plain"] == pytest.approx(5.0 / 1.2)
    assert rows[1]["step_over_floor"] == pytest.approx(6.0)
    assert rows[2]["floor_seconds"] == pytest.approx(2e-3) and rows[2]["step_over_floor"] == pytest.approx(10.0)
    assert rows[2]["spec_over_plain_step"] is None and rows[2]["tokens_per_second_over_plain"] is None
    assert "floor_seconds" not in rows[3]


def hand_report():
    rows = [{"method": PLAIN, "batch": 8, "force_accept": None, "status": "oom"},
            timed_row(DYNAMIC, 1, 0.011, 1.0, 2.2e9, k=0, reached=False),
            timed_row(CHAIN, 1, 0.012, 3.0, 3e9, k=2),
            timed_row(PLAIN, 1, 0.010, 1.0, 2e9)]
    rp.add_ratios(rows, bandwidth=1e12)
    return {"name": "tiny", "device": "cpu", "platform": "cpu", "copy_bandwidth_bytes_per_second": 1e12,
            "prompt_len": 128, "elapsed_seconds": 41.6, "skipped": [{"reason": "budget"}], "rows": rows}


def test_table_rows_are_the_numbers_by_hand_sorted_by_batch_method_k():
    assert rp.table_rows(hand_report()) == [
        # batch, method, k, accept, step ms, floor ms, step/floor, step/plain, tok/s, tok/s /plain, compile s
        ("1", "plain", "-", "1.00", "10.00", "2.00", "5.00", "1.00", "100", "1.00", "12.3", "ok"),
        ("1", "eagle3-chain", "2", "3.00", "12.00", "3.00", "4.00", "1.20", "250", "2.50", "12.3", "ok"),
        ("1", "eagle3-dynamic", "0", "1.00", "11.00", "2.20", "5.00", "1.10", "91", "0.91", "12.3", "ok*"),
        ("8", "plain", "-") + ("",) * 8 + ("oom",)]


def test_format_table_title_header_and_one_line_per_row():
    lines = rp.format_table(hand_report()).split("\n")
    assert lines[0] == "tiny on cpu (cpu): copy bandwidth 1000 GB/s, prompt 128, 42 s, 1 skipped"
    assert lines[1].split() == ["batch", "method", "k", "accept", "step", "ms", "floor", "ms", "step/floor",
                                "step/plain", "tok/s", "tok/s", "/plain", "compile", "s", "status"]
    assert set(lines[2]) == {"-"} and len(lines[2]) == len(lines[1])
    assert [line.split()[:3] for line in lines[3:]] == [["1", "plain", "-"], ["1", "eagle3-chain", "2"],
                                                        ["1", "eagle3-dynamic", "0"], ["8", "plain", "-"]]
    assert len({len(line) for line in lines[1:]}) == 1  # columns right-aligned to one width


def test_new_report_fields_by_hand_and_consistent():
    models = abstract_models("tiny")
    report = rp.new_report(models, 5e10, [1e-3, 2e-3], 1 << 20, (8, 1, 8), repeats=3, budget_seconds=60.0)
    assert report["target_param_bytes"] == BF16 * TINY_TARGET
    assert report["target_weight_bytes_per_forward"] == BF16 * (TINY_TARGET - TINY_EMBED)
    assert report["eagle3_param_bytes"] == BF16 * TINY_HEAD
    assert (report["prompt_len"], report["sequence_bucket"], report["steps_per_call"]) == (128, 256, 24)
    assert report["batches"] == [1, 8] and report["repeats"] == 3 and report["budget_seconds"] == 60.0
    assert report["copy_bandwidth_bytes_per_second"] == 5e10 and report["copy_bytes"] == 1 << 20
    assert report["specs"][CHAIN]["num_steps"] == models.shape.chain.num_steps
    assert report["specs"][DYNAMIC]["num_draft_tokens"] == models.shape.dynamic.num_draft_tokens
    assert report["target_config"]["num_layers"] == 3 and report["eagle3_config"]["target_hidden_size"] == 64
    assert (report["rows"], report["skipped"], report["complete"]) == ([], [], False)
    json.dumps(report)  # serialisable as it is


def test_write_json_replaces_the_file_whole(tmp_path):
    assert rp.write_json({"name": "tiny"}, None) is None
    path = rp.write_json({"name": "tiny", "rows": [1]}, str(tmp_path / "out"))
    assert path == str(tmp_path / "out" / "synthetic_tiny.json")
    rp.write_json({"name": "tiny", "rows": [1, 2]}, str(tmp_path / "out"))
    assert os.listdir(tmp_path / "out") == ["synthetic_tiny.json"]
    with open(path) as f:
        assert json.load(f) == {"name": "tiny", "rows": [1, 2]}
