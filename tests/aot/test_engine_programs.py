"""The engine's programs (whole generate, one decode step) compiled by the real compilers of hardware this machine
lacks, the kernels inside: libtpu's for one v5e chip and four (tensor parallel), XLA's GPU compiler for one H100 and
four; and the server's paged step programs over the pool it would allocate. At tiny shapes, so every method compiles
in seconds (Llama-3-8B and 70B: ``jspec bench --aot``,
docs/aot.md)."""

import json
import re

import jax
import pytest

from jspec.tools.aot import cost_of
from jspec.tools.aot_programs import Deployment, compile_engine_programs
from jspec.tools.aot_server import compile_server_step
from jspec.tools.aot_table import run_aot_table, run_server_table

pytestmark = pytest.mark.aot
TINY = dict(prompt_len=16, seq_len=64)
# The custom call each platform's Pallas kernels become (the TPU compiler adds custom calls of its own).
KERNEL_CALLS = {"v5e": "tpu_custom_call", "h100": "__gpu$xla.gpu.triton"}


def assert_kernels_inside(programs, chip):
    """impl="auto" under the chip's device: the tree kernels run as its compiled Pallas form, not as their jnp
    references."""
    calls = re.findall(r'custom_call_target="([^"]+)"', programs.step.as_text())
    assert KERNEL_CALLS[chip] in calls, calls


@pytest.mark.parametrize("chip,method", [("v5e", "eagle3-dynamic"), ("v5e", "dflash-block"),
                                         ("h100", "eagle3-dynamic"), ("h100", "dflash-block")])
def test_a_method_compiles_for_one_chip(chip, method):
    """The step of each method; the whole generate program of the dynamic tree (the aot table's test compiles plain's
    and the chain's on a v5e)."""
    whole = method == "eagle3-dynamic"
    programs = compile_engine_programs(Deployment("tiny", chip, 1), method, batch=2, whole=whole, **TINY)
    cost = cost_of(programs.step)
    assert cost["flops"] > 0 and cost["bytes accessed"] >= programs.weight_bytes_per_device
    if whole:
        assert programs.generate.memory_analysis().argument_size_in_bytes >= programs.weight_bytes_per_device
    assert_kernels_inside(programs, chip)


@pytest.mark.parametrize("chip,grouped_matmul", [("v5e", "tpu_custom_call"), ("h100", "__gpu$xla.gpu.triton")])
def test_a_mixture_of_experts_verify_step_runs_its_experts_as_grouped_matmuls(chip, grouped_matmul):
    """A MoE target's EAGLE-3 verify step, split over two chips: the experts' grouped matmuls are kernels (XLA's
    own on a TPU; tokamax's Triton kernel on an H100, where XLA's ragged_dot multiplies every row by every expert),
    each expert's width split over the chips (the partial sums all-reduced)."""
    programs = compile_engine_programs(Deployment("tiny-moe", chip, 2), "eagle3-chain", batch=2, whole=False, **TINY)
    text = programs.step.as_text()
    kernels = [line for line in text.splitlines() if f'custom_call_target="{grouped_matmul}"' in line]
    # gate, up and down in each of the 3 layers (their metadata names ragged_dot; XLA's TPU kernel may take more)
    assert sum("ragged" in line for line in kernels) >= 9, kernels
    assert "all-reduce" in text


@pytest.mark.parametrize("chip,chips", [("v5e", 4), ("h100", 4)])
def test_a_speculative_step_compiles_split_over_chips(chip, chips):
    programs = compile_engine_programs(Deployment("tiny", chip, chips), "eagle3-dynamic", batch=chips, whole=False,
                                       **TINY)
    assert "all-reduce" in programs.step.as_text()
    assert_kernels_inside(programs, chip)


@pytest.mark.parametrize("chip", ["v5e"])  # the H100's chip figures: the server test's pool; its cost: cost_of above
def test_the_aot_table_compares_a_chain_step_with_the_plain_one(tmp_path, chip):
    """jspec bench --aot's rows: plain and an EAGLE-3 chain on one chip, written to aot.json."""
    lines = []
    report = run_aot_table([Deployment("tiny", chip, 1)], ["plain", "eagle3-chain"], batch=2, out_dir=str(tmp_path),
                           echo=lines.append, **TINY)
    plain, chain = report["rows"]
    assert plain["status"] == chain["status"] == "ok", report
    for row in (plain, chain):
        assert row["arguments_over_weights"] >= 1.0 and row["fits"] and row["step_flops"] > 0
    # the chain's step reads the head's weights too, and verifies 4 tokens where plain decodes 1
    assert chain["bytes_over_plain"] > 1.0 and chain["flops_over_plain"] > 1.0
    assert json.load(open(tmp_path / "aot.json"))["rows"] == report["rows"]
    assert len(lines) == 2 and f"tiny/{chip}-1/bfloat16 eagle3-chain B2" in lines[1], lines


def test_a_server_step_program_compiles_over_the_pool_the_server_would_allocate():
    """The server's paged chunk keeping log-probabilities, over two H100s, on the pool sized as jspec serve sizes it
    on a GPU (90% of its HBM less the weights and the program's workspace) and updated in place: it fits."""
    program = compile_server_step(Deployment("tiny", "h100", 2), "eagle3-chain", "logprobs", rows=4, seq_len=64)
    assert program.pool_tokens > 1_000_000  # the tiny model's slots are a few KiB: the pool fills the chip
    assert 0 < program.workspace_bytes_per_device < 2**30
    budget = 0.9 * program.hbm_bytes_per_device  # the workspace measured over a small pool holds at the full one
    assert budget * 0.99 < program.memory_bytes_per_device <= budget
    step = program.programs[0]  # the store comes back placed as it went in: the next call takes it, in place
    store_in, store_out = (jax.tree.leaves(tree) for tree in (step.input_shardings[0][2], step.output_shardings[0]))
    shapes = [leaf.shape for leaf in jax.tree.leaves(step.out_info[0])]
    assert len(store_in) == len(store_out) == len(shapes)
    assert all(a.is_equivalent_to(b, len(shape)) for a, b, shape in zip(store_in, store_out, shapes))


def test_a_speculative_structured_step_is_two_programs_with_the_paged_kernel_inside():
    """On a TPU: the proposal, then the verification under each node's grammar mask, whose paged tree attention is
    the Mosaic kernel reading the pool through the page table."""
    program = compile_server_step(Deployment("tiny", "v5e", 1), "eagle3-dynamic", "structured", rows=4, seq_len=64,
                                  max_total_tokens=4096)
    assert len(program.programs) == 2 and program.pool_tokens == 4096
    assert KERNEL_CALLS["v5e"] in program.programs[1].as_text()


def test_the_server_table_writes_each_variant(tmp_path):
    lines = []
    report = run_server_table([Deployment("tiny", "v5e", 1)], ["plain"], ["step", "structured"], rows=2,
                              out_dir=str(tmp_path), echo=lines.append, seq_len=64, max_total_tokens=4096)
    assert [row["status"] for row in report["programs"]] == ["ok", "ok"], report
    assert all(row["pool_tokens"] == 4096 and row["fits"] for row in report["programs"])
    assert json.load(open(tmp_path / "aot_server.json")) == report
    assert "tiny/v5e-1/bfloat16 plain structured R2: a pool of 4,096 token slots" in lines[1], lines
