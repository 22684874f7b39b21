"""The synthetic roofline benchmark (jspec/bench_synthetic.py): one tiny run on CPU (fields, forced acceptance,
floors); byte counts of the real shapes against their published parameter counts (abstract params, no memory);
ratios and the work order without compiling anything.

Each compile costs ~10 s on a small CPU, so the run times one configuration: the dynamic tree (the one whose
forced acceptance depends on the sharpened random head) at its full depth; plain decoding goes the same way
through the same code (``measure_row``)."""

import argparse
import json

import jax
import pytest

from jspec.tools import roofline as bs
from models.config import from_hf_config
from models.eagle3 import eagle3_config_from_hf, init_eagle3_params
from models.llama import init_params

FORCED = 3  # the tiny dynamic tree's depth: the deepest first-child path it can accept


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """(returned report, the JSON on disk) of the dynamic tree forced to accept FORCED drafts per step."""
    out = tmp_path_factory.mktemp("synthetic")
    report = bs.run_synthetic("tiny", str(out), budget_seconds=300, batches=(1,), force_accepts=(FORCED,),
                              methods=(bs.DYNAMIC,), repeats=3, show=False)
    with open(out / "synthetic_tiny.json") as f:
        return report, json.load(f)


def test_json_is_the_report_and_complete(tiny_run):
    report, on_disk = tiny_run
    assert on_disk == json.loads(json.dumps(report))
    for field in ("device", "jax_version", "copy_bandwidth_bytes_per_second", "target_weight_bytes_per_forward",
                  "eagle3_param_bytes", "prompt_len", "specs", "rows", "skipped"):
        assert field in on_disk, field
    assert on_disk["complete"] and on_disk["skipped"] == []
    assert on_disk["copy_bandwidth_bytes_per_second"] > 0
    assert [(r["method"], r["force_accept"]) for r in on_disk["rows"]] == [("eagle3-dynamic", FORCED)]


def test_row_is_timed_with_the_forced_acceptance(tiny_run):
    (row,) = tiny_run[1]["rows"]
    assert row["status"] == "ok", row["error"]
    assert row["acceptance_length"] == FORCED + 1 and row["forced_acceptance_reached"]
    assert row["verify_steps"] == bs.SHAPES["tiny"].steps
    assert row["new_tokens"] == 1 + bs.SHAPES["tiny"].steps * (FORCED + 1)
    assert row["step_seconds"] > 0 and row["compile_seconds"] > 0 and row["tokens_per_second"] > 0
    assert row["total_seconds"] > row["prefill_seconds"] > 0
    assert row["floor_seconds"] > 0 and row["step_over_floor"] > 0
    assert all(v > 0 for v in row["floor_bytes"].values())
    assert row["spec_over_plain_step"] is None  # no plain row to compare with


def test_table_lists_every_row(tiny_run):
    table = bs.format_table(tiny_run[0])
    assert "eagle3-dynamic" in table and "step/floor" in table


def test_ratios_against_plain_decoding_at_the_same_batch():
    def row(method, batch, step, accept):
        return {"method": method, "batch": batch, "status": "ok", "step_seconds": step, "acceptance_length": accept,
                "tokens_per_second": batch * accept / step, "floor_bytes": {"total": 2e9}}

    rows = [row("plain", 1, 0.010, 1.0), row("eagle3-chain", 1, 0.012, 5.0), row("eagle3-chain", 8, 0.02, 5.0),
            {"method": "plain", "batch": 8, "status": "oom"}]
    bs.add_ratios(rows, bandwidth=1e12)
    assert rows[0]["spec_over_plain_step"] == 1.0 and rows[0]["floor_seconds"] == pytest.approx(2e-3)
    assert rows[1]["spec_over_plain_step"] == pytest.approx(1.2)
    assert rows[1]["tokens_per_second_over_plain"] == pytest.approx(5.0 / 1.2)
    assert rows[1]["step_over_floor"] == pytest.approx(6.0)
    assert rows[2]["spec_over_plain_step"] is None and "floor_seconds" not in rows[3]


def _abstract(name):
    shape = bs.SHAPES[name]
    target, head = from_hf_config(shape.target_hf), eagle3_config_from_hf(shape.head_hf)
    params_t = jax.eval_shape(lambda: init_params(target, jax.random.key(0), bs.DTYPES[shape.dtype]))
    params_h = jax.eval_shape(lambda: init_eagle3_params(head, jax.random.key(0), bs.DTYPES[shape.dtype]))
    return target, head, params_t, params_h


@pytest.mark.parametrize("name,params", [("llama3-8b", 8_030_261_248), ("llama3-1b", 1_235_814_400)])
def test_real_shapes_have_the_published_parameter_counts(name, params):
    target, _, params_t, _ = _abstract(name)
    assert bs.tree_bytes(params_t) == 2 * params
    embedding = 2 * target.vocab_size * target.hidden_size
    expected = 2 * params if target.tie_word_embeddings else 2 * params - embedding
    assert bs.target_weight_bytes(target, params_t) == expected


def test_floor_bytes_of_an_eagle3_step_by_hand():
    target, head, params_t, params_h = _abstract("llama3-8b")
    models = bs.SyntheticModels("llama3-8b", bs.SHAPES["llama3-8b"], target, head, params_t,
                                {"head": params_h, "d2t": None})
    parts = bs.floor_bytes(models, bs.CHAIN, batch=8, context=600.0)
    fc = 2 * 3 * 4096 * 4096
    forwards = bs.SHAPES["llama3-8b"].chain.num_steps  # 3 drafting forwards + 1 extend
    assert parts["target_kv"] == 2 * 32 * 8 * 600 * 8 * 128 * 2
    assert parts["drafter_kv"] == forwards * 2 * 1 * 8 * 600 * 8 * 128 * 2
    assert parts["drafter_weights"] == forwards * (bs.tree_bytes(params_h) - fc) + fc
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total")


def test_plan_runs_the_deepest_k_first_and_the_largest_batch_after_the_small_ones():
    models = [bs.SyntheticModels(n, bs.SHAPES[n], None, None, None, None) for n in ("llama3-8b", "llama3-1b")]
    plans = bs.plan_rows(models, (32, 1, 8), None)
    assert len(plans) == 2 * 3 * (1 + 5 + 7)
    first = [(p.model, p.batch, p.method, p.force_accept) for p in plans[:4]]
    assert first == [("llama3-8b", 1, "plain", None), ("llama3-8b", 1, "eagle3-chain", 4),
                     ("llama3-8b", 1, "eagle3-dynamic", 6), ("llama3-1b", 1, "plain", None)]
    tiers = [p.tier for p in plans]
    assert tiers == sorted(tiers)
    assert max(p.batch for p in plans if p.tier == 0) == 8
    assert {p.force_accept for p in plans if p.tier == 2} == {0}


def test_budget_skips_past_the_time_and_after_out_of_memory():
    plan = bs.RowPlan("llama3-8b", 8, bs.CHAIN, 4, 0)
    budget = bs.Budget(seconds=1000.0)
    assert budget.skip_reason(plan) is None
    budget.record(plan, {"wall_seconds": 2000.0, "status": "oom"})
    assert "out of memory at batch 8" in budget.skip_reason(bs.RowPlan("llama3-8b", 32, bs.CHAIN, 0, 1))
    assert "budget" in budget.skip_reason(bs.RowPlan("llama3-8b", 1, bs.CHAIN, 0, 2))  # 2000 s estimated
    assert budget.skip_reason(bs.RowPlan("llama3-1b", 1, bs.CHAIN, 0, 0)) is None  # nothing known of it


def test_command_line_options():
    parser = argparse.ArgumentParser()
    bs.add_synthetic_arguments(parser)
    args = parser.parse_args(["--synthetic", "llama3-8b,llama3-1b", "--out", "d", "--synthetic-batches", "1,8",
                              "--synthetic-force-accepts", "0,4"])
    assert (args.synthetic, args.out, args.synthetic_batches) == ("llama3-8b,llama3-1b", "d", (1, 8))
    assert args.synthetic_force_accepts == (0, 4) and args.budget_seconds == bs.DEFAULT_BUDGET_SECONDS
