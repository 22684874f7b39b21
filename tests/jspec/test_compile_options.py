"""Each generation program compiles with its own XLA options (jspec.compile_options): speculative programs on a
CPU without YNNPACK fusions, plain decoding with XLA's defaults; an explicit GenerateSetup.compiler_options wins;
an option this jaxlib does not know falls back to the defaults; the output is the same whatever the options."""

import copy
import dataclasses

import jax
import pytest

import jspec
from jspec import compile_options
from jspec.compile_options import CPU_MULTI_TOKEN_OPTIONS, program_options
from jspec.generate_setup import GenerateSetup
from models.config import ModelConfig
from tests.spec_fixtures import near_bigram_target, plain_engine, random_head, spec_engine

YNN_FUSION = "__ynn_fusion"


@pytest.fixture(scope="module")
def engines():
    params_t = near_bigram_target()
    return spec_engine(params_t, random_head(), "chain", max_batch_size=2), plain_engine(params_t, max_batch_size=2)


def compiled_text(engine, prompts) -> str:
    """The optimized HLO of the engine's generate program for ``prompts``."""
    batch, params = engine._prepare(prompts, 8, 0.0, 0, 1.0, 0, None)
    setup = engine.setup.with_max_seq_len(batch.seq_len)
    return jspec.generate.lower(*engine._arguments(batch, params), setup=setup).compile().as_text()


def with_options(engine, options):
    """The engine with its programs compiled under ``options`` (nothing compiled carried over)."""
    other = copy.copy(engine)
    other.setup = dataclasses.replace(engine.setup, compiler_options=options)
    other._compiled = {}
    return other


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU choice")
def test_speculative_steps_compile_without_ynn_fusions_and_plain_steps_with_defaults(engines):
    spec, plain = engines
    assert program_options(spec.setup) == CPU_MULTI_TOKEN_OPTIONS
    assert program_options(spec.setup, speculate=False) == {}  # the server's plain steps with the drafter's upkeep
    assert program_options(plain.setup) == {}
    assert YNN_FUSION not in compiled_text(spec, [[1, 2, 3]])


def test_explicit_options_win_and_are_validated(engines):
    spec, _ = engines
    assert program_options(dataclasses.replace(spec.setup, compiler_options=())) == {}
    chosen = (("xla_cpu_enable_fast_math", "false"),)
    assert program_options(dataclasses.replace(spec.setup, compiler_options=chosen)) == dict(chosen)
    with pytest.raises(ValueError, match="compiler_options"):
        dataclasses.replace(spec.setup, compiler_options={"xla_cpu_enable_fast_math": "false"})
    with pytest.raises(ValueError, match="compiler_options"):
        dataclasses.replace(spec.setup, compiler_options=(("xla_cpu_enable_fast_math", False),))


def test_an_option_this_jaxlib_does_not_know_falls_back_to_the_defaults(engines, monkeypatch):
    spec, _ = engines
    monkeypatch.setattr(compile_options, "CPU_MULTI_TOKEN_OPTIONS", {"xla_no_such_option_here": "1"})
    assert program_options(spec.setup) == {}


# slow: greedy output is the same under either XLA option set; default tier: every greedy = plain test (the default
# options), test_speculative_steps_compile_without_ynn_fusions_and_plain_steps_with_defaults
@pytest.mark.slow
def test_greedy_output_is_the_same_under_either_options(engines):
    spec, plain = engines
    prompts = [[5, 9, 2, 7], [3, 3, 1]]
    defaults = with_options(spec, ())
    expected = plain.generate(prompts, max_new_tokens=24).token_ids
    assert spec.generate(prompts, max_new_tokens=24).token_ids == expected
    assert defaults.generate(prompts, max_new_tokens=24).token_ids == expected


def test_float32_programs_off_a_cpu_trace_at_the_highest_matmul_precision(monkeypatch):
    """TF32 (XLA's float32 default on a GPU) would let a verify pass and a decode step round differently: float32
    programs off a CPU trace under jax.default_matmul_precision("highest"); bfloat16 ones and CPU ones as JAX does."""
    setup = GenerateSetup(target=ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8,
                                             num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8), max_seq_len=8)

    @compile_options.setup_jit
    def product(a, *, setup):
        return a @ a

    a = jax.numpy.ones((4, 4))
    with jax.default_matmul_precision("default"):  # as a user's program has it (tests/conftest.py sets "highest")
        assert compile_options.matmul_precision(setup) is None
        assert "HIGHEST" not in product.lower(a, setup=setup).as_text()
        monkeypatch.setattr(compile_options, "_platform", lambda _: "gpu")
        assert compile_options.matmul_precision(setup) == "highest"
        assert compile_options.matmul_precision(dataclasses.replace(setup, dtype="bfloat16")) is None
        assert "HIGHEST" in product.lower(a, setup=setup).as_text()
