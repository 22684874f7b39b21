"""scripts/eval_acceptance.py's options: a slice of the HumanEval prompts, the dynamic trees' selection, and a
short real run whose output must equal plain decoding."""

import json

import pytest

from jspec.tools.eval_acceptance import main, method_specs, prompt_slice


def test_prompt_slice_parses_and_refuses_clearly():
    assert prompt_slice("148:164", 164) == slice(148, 164)
    assert prompt_slice(":5", 164) == slice(None, 5)
    assert prompt_slice("100:", 164) == slice(100, None)
    with pytest.raises(ValueError, match="'1-5': expected START:END"):
        prompt_slice("1-5", 164)
    with pytest.raises(ValueError, match="'170:180' selects no prompt of 164"):
        prompt_slice("170:180", 164)


def test_selection_reaches_the_dynamic_trees_only():
    specs = method_specs(24, 8, 2, selection="top1_chain")
    assert specs["eagle3-dynamic"][1].selection == "top1_chain"
    assert specs["draft-model-dynamic"][1].selection == "top1_chain"
    assert specs["eagle3-chain"][1].tree == "chain"
    assert method_specs(24, 8, 2)["eagle3-dynamic"][1].selection == "eagle2"


# slow: scripts/eval_acceptance.py on a slice of HumanEval = plain; default tier: test_tree_selection
@pytest.mark.slow
def test_a_slice_of_prompts_with_top1_chain_trees_equals_plain(tmp_path, capsys):
    out = tmp_path / "acceptance.json"
    assert main(["--methods", "plain,eagle3-dynamic", "--prompts", "160:164", "--limit", "2", "--max-new-tokens",
                 "12", "--num-steps", "4", "--topk", "2", "--num-draft-tokens", "8", "--selection", "top1_chain",
                 "--max-seq-len", "512", "--json", str(out), "--samples", "1"]) == 0
    report = json.loads(out.read_text())
    assert report["prompts"] == "160:164" and report["num_prompts"] == 2
    assert report["samples"][0]["task_id"] == "HumanEval/160"
    dynamic = next(m for m in report["methods"] if m["method"] == "eagle3-dynamic")
    assert dynamic["spec"]["selection"] == "top1_chain"
    assert dynamic["mismatches"] == 0
    assert dynamic["acceptance_length"] > 1.0
