"""The roofline's work order and budget (jspec/tools/roofline/plan.py), on the real shapes' configs (no params)."""

from jspec.tools.roofline.plan import Budget, RowPlan, accept_counts, plan_rows
from jspec.tools.roofline.shapes import CHAIN, SHAPES, SyntheticModels


def test_accept_counts_are_the_requested_ones_that_fit_the_depth():
    chain = SHAPES["llama3-8b"].chain  # depth 4
    assert accept_counts(chain, None) == [0, 1, 2, 3, 4]
    assert accept_counts(chain, (6, 4, 0, 4, -1)) == [0, 4]


def test_plan_runs_the_deepest_k_first_and_the_largest_batch_after_the_small_ones():
    models = [SyntheticModels(n, SHAPES[n], None, None, None, None, None, None) for n in ("llama3-8b", "llama3-1b")]
    plans = plan_rows(models, (32, 1, 8), None)
    assert len(plans) == 2 * 3 * (1 + 5 + 7 + 16)  # plain; chain k 0..4; dynamic 0..6; DFlash's block of 16: 0..15
    first = [(p.model, p.batch, p.method, p.force_accept) for p in plans[:5]]
    assert first == [("llama3-8b", 1, "plain", None), ("llama3-8b", 1, "eagle3-chain", 4),
                     ("llama3-8b", 1, "eagle3-dynamic", 6), ("llama3-8b", 1, "dflash-chain", 15),
                     ("llama3-1b", 1, "plain", None)]
    tiers = [p.tier for p in plans]
    assert tiers == sorted(tiers)
    assert max(p.batch for p in plans if p.tier == 0) == 8
    assert {p.force_accept for p in plans if p.tier == 2} == {0}


def test_a_deep_commit_runs_as_many_steps_as_the_sequence_bucket_holds():
    shape = SHAPES["llama3-8b"]  # prompt 512, bucket 1024, 32 steps a call
    assert shape.steps_for(5) == 32 and shape.new_tokens(5) == 161
    assert shape.steps_for(16) == 31 and shape.new_tokens(16) == 1 + 31 * 16
    assert shape.prompt_len + shape.new_tokens(16) <= 2 * shape.prompt_len


def test_budget_skips_past_the_time_and_after_out_of_memory():
    plan = RowPlan("llama3-8b", 8, CHAIN, 4, 0)
    budget = Budget(seconds=1000.0)
    assert budget.skip_reason(plan) is None
    budget.record(plan, {"wall_seconds": 2000.0, "status": "oom"})
    assert "out of memory at batch 8" in budget.skip_reason(RowPlan("llama3-8b", 32, CHAIN, 0, 1))
    assert "budget" in budget.skip_reason(RowPlan("llama3-8b", 1, CHAIN, 0, 2))  # 2000 s estimated
    assert budget.skip_reason(RowPlan("llama3-1b", 1, CHAIN, 0, 0)) is None  # nothing known of it


def test_budget_estimate_is_the_costliest_so_far_and_half_again_for_a_larger_batch():
    budget = Budget(seconds=1000.0)
    assert budget.estimate(RowPlan("tiny", 1, CHAIN, 3, 0)) == 0.0
    budget.record(RowPlan("tiny", 4, CHAIN, 3, 0), {"wall_seconds": 100.0, "status": "ok"})
    budget.record(RowPlan("tiny", 1, CHAIN, 0, 2), {"wall_seconds": 40.0, "status": "ok"})
    assert budget.estimate(RowPlan("tiny", 4, CHAIN, 1, 3)) == 100.0
    assert budget.estimate(RowPlan("tiny", 8, CHAIN, 1, 3)) == 150.0
    assert budget.estimate(RowPlan("tiny", 8, "plain", None, 1)) == 100.0  # any method of the same model
