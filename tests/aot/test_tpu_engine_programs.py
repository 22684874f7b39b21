"""The engine's programs (whole generate, one decode step) compiled for a TPU by libtpu's compiler, on one v5e chip
and split over four (tensor parallel), the Mosaic kernels inside: at tiny shapes, so every method compiles in
seconds (Llama-3-8B and 70B: ``jspec bench --aot``, docs/benchmarks.md)."""

import pytest

from jspec.tools.aot_programs import METHODS, Deployment, compile_engine_programs

pytestmark = pytest.mark.aot


@pytest.mark.parametrize("method", METHODS)
def test_every_method_compiles_for_one_v5e_chip(method):
    programs = compile_engine_programs(Deployment("tiny", "v5e", 1), method, batch=2, prompt_len=16, seq_len=64)
    assert programs.step.cost_analysis()["flops"] > 0
    assert programs.generate.memory_analysis().argument_size_in_bytes >= programs.weight_bytes_per_device
    # impl="auto" under the TPU device: the tree kernels run as Mosaic custom calls, not as their jnp references
    mosaic_calls = programs.step.as_text().count('custom_call_target="tpu_custom_call"')
    assert (mosaic_calls > 0) == (method != "plain"), mosaic_calls


def test_a_speculative_step_compiles_split_over_four_v5e_chips():
    programs = compile_engine_programs(Deployment("tiny", "v5e", 4), "eagle3-dynamic", batch=4, prompt_len=16,
                                       seq_len=64)
    text = programs.step.as_text()
    assert "all-reduce" in text and 'custom_call_target="tpu_custom_call"' in text
