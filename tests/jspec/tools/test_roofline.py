"""The synthetic roofline benchmark (jspec/tools/roofline/): one tiny run on CPU, its JSON checked against numbers
by hand (forced acceptance, mean context, floor bytes) and against itself (every derived field from the fields it
is derived from); and the command line.

Each compile costs ~10 s on a small CPU, so the run times one configuration: the dynamic tree (the one whose
forced acceptance depends on the sharpened random head) at its full depth; plain decoding goes the same way
through the same code (``measure_row``). The floor model, the report and the plan have their own tests
(test_roofline_floor.py, test_roofline_report.py, test_roofline_plan.py)."""

import argparse
import json
import statistics

import pytest

from jspec.tools import roofline
from jspec.tools.roofline import run
from jspec.tools.roofline.report import format_table
from jspec.tools.roofline.shapes import DFLASH, DYNAMIC, SHAPES
from tests.jspec.tools.test_roofline_floor import BF16, TINY_DFLASH, TINY_EMBED, TINY_FC, TINY_HEAD, TINY_TARGET

FORCED = 3  # the tiny dynamic tree's depth: the deepest first-child path it can accept
REPEATS = 3
BATCH = 2  # not 1, so that a count that forgets the batch shows


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """(returned report, the JSON on disk) of the dynamic tree at batch BATCH, forced to accept FORCED drafts."""
    out = tmp_path_factory.mktemp("synthetic")
    report = roofline.run_synthetic("tiny", str(out), budget_seconds=300, batches=(BATCH,), force_accepts=(FORCED,),
                                    methods=(DYNAMIC,), repeats=REPEATS, show=False)
    with open(out / "synthetic_tiny.json") as f:
        return report, json.load(f)


# slow: jspec bench --roofline's JSON report; default tier: the roofline plan, floor and report tests
@pytest.mark.slow
def test_json_is_the_report_and_complete(tiny_run):
    report, on_disk = tiny_run
    assert on_disk == json.loads(json.dumps(report))
    assert on_disk["complete"] and on_disk["skipped"] == []
    assert [(r["method"], r["force_accept"]) for r in on_disk["rows"]] == [("eagle3-dynamic", FORCED)]
    assert on_disk["elapsed_seconds"] >= on_disk["rows"][0]["wall_seconds"] > 0


# slow: the roofline's safetensors header bytes by hand; default tier: the roofline's command line and floor tests
@pytest.mark.slow
def test_header_bytes_by_hand(tiny_run):
    report = tiny_run[1]
    assert report["target_param_bytes"] == BF16 * TINY_TARGET
    assert report["target_weight_bytes_per_forward"] == BF16 * (TINY_TARGET - TINY_EMBED)
    assert report["eagle3_param_bytes"] == BF16 * TINY_HEAD
    assert (report["prompt_len"], report["sequence_bucket"], report["steps_per_call"]) == (128, 256, 24)


# slow: the roofline's bandwidth arithmetic on a tiny run; default tier: test_roofline_floor
@pytest.mark.slow
def test_bandwidth_is_read_plus_write_over_the_median_pass(tiny_run):
    report = tiny_run[1]
    assert report["copy_bytes"] == 16 << 20  # the CPU default
    assert report["copy_bandwidth_bytes_per_second"] == pytest.approx(
        2 * report["copy_bytes"] / statistics.median(report["copy_seconds_per_pass"]), rel=1e-12)


# slow: the roofline row is timed at the forced acceptance; default tier: test_roofline_plan
@pytest.mark.slow
def test_row_is_timed_with_the_forced_acceptance(tiny_run):
    (row,) = tiny_run[1]["rows"]
    assert row["status"] == "ok", row["error"]
    assert row["acceptance_length"] == FORCED + 1 and row["forced_acceptance_reached"]
    assert row["verify_steps"] == SHAPES["tiny"].steps == 24
    assert row["new_tokens"] == 1 + 24 * (FORCED + 1)
    assert row["compile_seconds"] > 0 and row["step_seconds"] > 0
    assert row["spec_over_plain_step"] is None and row["tokens_per_second_over_plain"] is None  # no plain row


# slow: the roofline's step time arithmetic; default tier: test_roofline_floor
@pytest.mark.slow
def test_step_time_is_the_median_difference_per_verify_step(tiny_run):
    (row,) = tiny_run[1]["rows"]
    assert len(row["prefill_runs"]) == len(row["total_runs"]) == REPEATS
    assert row["prefill_seconds"] == statistics.median(row["prefill_runs"])
    assert row["total_seconds"] == statistics.median(row["total_runs"])
    assert row["step_seconds"] == pytest.approx((row["total_seconds"] - row["prefill_seconds"]) / 24, rel=1e-12)
    assert row["tokens_per_second"] == pytest.approx(BATCH * (FORCED + 1) / row["step_seconds"], rel=1e-12)


# slow: the roofline row's floor by hand; default tier: test_roofline_floor
@pytest.mark.slow
def test_floor_of_the_row_by_hand(tiny_run):
    """Mean context 128 + 4 * 23 / 2 = 174 tokens over the 24 steps; 3 head forwards (2 drafting, 1 extend)."""
    report = tiny_run[1]
    (row,) = report["rows"]
    assert row["mean_context"] == 174.0 and row["drafter_forwards_per_step"] == 3
    expected = {"target_weights": BF16 * (TINY_TARGET - TINY_EMBED),
                "target_kv": 2 * 3 * BATCH * 174 * 2 * 16 * BF16,  # K and V, layers, batch, context, kv heads, dim
                "drafter_weights": BF16 * (3 * (TINY_HEAD - TINY_FC) + TINY_FC),  # fc in one forward only
                "drafter_kv": 3 * 2 * 1 * BATCH * 174 * 2 * 16 * BF16}
    expected["total"] = sum(expected.values())
    assert row["floor_bytes"] == pytest.approx(expected, rel=1e-12)
    floor_seconds = expected["total"] / report["copy_bandwidth_bytes_per_second"]
    assert row["floor_seconds"] == pytest.approx(floor_seconds, rel=1e-12)
    assert row["step_over_floor"] == pytest.approx(row["step_seconds"] / floor_seconds, rel=1e-12)


# slow: the roofline table; default tier: test_roofline_report
@pytest.mark.slow
def test_table_shows_the_row(tiny_run):
    report, _ = tiny_run
    (row,) = report["rows"]
    cells = format_table(report).split("\n")[3].split()  # title, header, rule, the row
    assert cells[:5] == [str(BATCH), "eagle3-dynamic", str(FORCED), "4.00", f"{1e3 * row['step_seconds']:.2f}"]
    assert cells[5:7] == [f"{1e3 * row['floor_seconds']:.2f}", f"{row['step_over_floor']:.2f}"]


def test_command_line_options():
    parser = argparse.ArgumentParser()
    run.add_synthetic_arguments(parser)
    args = parser.parse_args(["--synthetic", "llama3-8b,llama3-1b", "--out", "d", "--synthetic-batches", "1,8",
                              "--synthetic-force-accepts", "0,4"])
    assert (args.synthetic, args.out, args.synthetic_batches) == ("llama3-8b,llama3-1b", "d", (1, 8))
    assert args.synthetic_force_accepts == (0, 4) and args.budget_seconds == run.DEFAULT_BUDGET_SECONDS
    assert args.synthetic_repeats == 3


def test_main_needs_a_shape_and_rejects_unknown_ones():
    with pytest.raises(SystemExit):
        roofline.main([])
    with pytest.raises(ValueError, match="llama3-70b"):
        roofline.main(["--synthetic", "llama3-70b"])


# slow: the roofline rows through the mesh code path on a 1x1 mesh; default tier: the roofline plan, floor and report
# tests, and test_sharded_params (the mesh placement it uses)
@pytest.mark.slow
def test_synthetic_through_a_one_device_mesh():
    """--synthetic-mesh 1x1: the same rows through the mesh code path (what a GPU run compares against the
    no-mesh figures)."""
    mesh = run._mesh("1x1")
    report = run.run_synthetic("tiny", None, budget_seconds=300, batches=(1,), methods=("plain",), repeats=1,
                               show=False, mesh=mesh)
    assert report["mesh"] == {"data": 1, "model": 1}
    (row,) = report["rows"]
    assert row["status"] == "ok", row["error"]
    with pytest.raises(ValueError, match="expected DPxTP"):
        run._mesh("8")


# slow: the roofline times a DFlash chain at its whole block; default tier: test_roofline_floor's DFlash bytes,
# test_roofline_plan's bucket arithmetic
@pytest.mark.slow
def test_dflash_row_commits_its_whole_block_in_as_many_steps_as_the_bucket_holds(tmp_path):
    """The DFlash chain forced to accept its whole block (7 drafts): 8 tokens a step, 15 steps (127 // 8: the
    prompt's 128 slots of the 256-slot bucket hold no more), one drafter forward a step."""
    report = roofline.run_synthetic("tiny", str(tmp_path), budget_seconds=300, batches=(1,), force_accepts=(7,),
                                    methods=(DFLASH,), repeats=1, show=False)
    (row,) = report["rows"]
    assert row["status"] == "ok", row["error"]
    assert row["acceptance_length"] == 8 and row["forced_acceptance_reached"]
    assert row["verify_steps"] == SHAPES["tiny"].steps_for(8) == 15 and row["new_tokens"] == 1 + 15 * 8
    assert row["drafter_forwards_per_step"] == 1
    assert report["specs"][DFLASH]["num_steps"] == 7 and report["dflash_param_bytes"] == BF16 * TINY_DFLASH
