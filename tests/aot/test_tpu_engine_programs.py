"""The engine's programs (whole generate, one decode step) compiled for a TPU by libtpu's compiler, on one v5e chip
and split over four (tensor parallel), the Mosaic kernels inside: at tiny shapes, so every method compiles in
seconds (Llama-3-8B and 70B: ``jspec bench --aot``, docs/aot.md)."""

import json

import pytest

from jspec.tools.aot_programs import Deployment, compile_engine_programs
from jspec.tools.aot_table import run_aot_table

pytestmark = pytest.mark.aot
TINY = dict(prompt_len=16, seq_len=64)


def assert_mosaic_kernels_inside(programs, expected: bool):
    """impl="auto" under the TPU device: the tree kernels run as Mosaic custom calls, not as their jnp references."""
    calls = programs.step.as_text().count('custom_call_target="tpu_custom_call"')
    assert (calls > 0) == expected, calls


@pytest.mark.parametrize("method", ["eagle3-dynamic", "dflash-block"])
def test_a_method_compiles_for_one_v5e_chip(method):
    programs = compile_engine_programs(Deployment("tiny", "v5e", 1), method, batch=2, **TINY)
    assert programs.step.cost_analysis()["flops"] > 0
    assert programs.generate.memory_analysis().argument_size_in_bytes >= programs.weight_bytes_per_device
    assert_mosaic_kernels_inside(programs, True)


def test_a_speculative_step_compiles_split_over_four_v5e_chips():
    programs = compile_engine_programs(Deployment("tiny", "v5e", 4), "eagle3-dynamic", batch=4, whole=False, **TINY)
    assert "all-reduce" in programs.step.as_text()
    assert_mosaic_kernels_inside(programs, True)


def test_the_aot_table_compares_a_chain_step_with_the_plain_one(tmp_path):
    """jspec bench --aot's rows: plain and an EAGLE-3 chain on one v5e chip, written to aot.json."""
    lines = []
    report = run_aot_table([Deployment("tiny", "v5e", 1)], ["plain", "eagle3-chain"], batch=2, out_dir=str(tmp_path),
                           echo=lines.append, **TINY)
    plain, chain = report["rows"]
    assert plain["status"] == chain["status"] == "ok", report
    for row in (plain, chain):
        assert row["arguments_over_weights"] >= 1.0 and row["fits"] and row["step_flops"] > 0
    # the chain's step reads the head's weights too, and verifies 4 tokens where plain decodes 1
    assert chain["bytes_over_plain"] > 1.0 and chain["flops_over_plain"] > 1.0
    assert json.load(open(tmp_path / "aot.json"))["rows"] == report["rows"]
    assert len(lines) == 2 and "tiny/v5e-1/bfloat16 eagle3-chain B2" in lines[1], lines
