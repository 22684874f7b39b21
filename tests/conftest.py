"""Shared pytest setup: float32 matmuls at full precision, the `gpu` and `tpu` markers, the xdist worker count."""

import os
import shutil

# One persistent compilation cache for the whole test session, its xdist workers and the processes its tests start
# (they inherit the environment), kept between sessions: a program compiled once (a shared fixture's engine, a
# CLI subprocess's) is loaded, not compiled, by every later module, worker and tier. Set before JAX is imported,
# which reads these from the environment. Tests of the CLI's own cache switch it off (`no_session_compile_cache`).
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SESSION_COMPILE_CACHE = os.path.join(REPO, ".pytest_cache", "jax-compile-cache")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", SESSION_COMPILE_CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
# Off a GPU, programs are compiled without LLVM's optimisations: most of the suite's time on a fresh clone is XLA:CPU
# compiling programs that then run a few steps, and this cuts it by about a third (the programs compute the same
# values; speed is measured by `jspec bench`, never here). The test processes inherit it (tests/virtual_devices.py).
# The legacy elemental emitters instead of XLA:CPU's fusion emitters: the same values, compiled in about 40% less
# time (a speculative test engine's generate program: 1.6 s against 2.6 s). A greedy-equality test per drafter family
# runs again under XLA's defaults, what users run (tests/jspec/test_xla_defaults.py).
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
if not (shutil.which("nvidia-smi") or os.path.exists("/dev/nvidia0")) and \
        "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + TEST_XLA_FLAGS).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

from jspec.serve import memory_maps  # noqa: E402
from tests import process_programs  # noqa: E402
from tests.compile_cache import session_compile_cache_off  # noqa: E402

RELEASE_AT = 0.4  # of vm.max_map_count: a module's programs (up to some 20,000 mappings) still fit after it

jax.config.update("jax_default_matmul_precision", "highest")


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def _has_tpu() -> bool:
    return jax.default_backend() == "tpu"


def pytest_xdist_auto_num_workers(config):
    """Workers for ``-n auto`` (pyproject addopts): two on a CPU-only machine, where most of the suite's time is
    single-threaded XLA compilation; none on a GPU machine, where every worker process would claim the device's
    memory. Decided without initialising a JAX backend in the controlling process."""
    if shutil.which("nvidia-smi") or os.path.exists("/dev/nvidia0"):
        return 0
    return min(2, os.cpu_count() or 1)


# The modules of each tier by their worker seconds, longest first (on the 2-core CI machine: the default tier's
# summed --durations=0 of a cold run at b54fa32; the slow tier's slowest 25 in .ci/run at f16f275, where its three
# longest modules, unlisted, had started last, then its other modules as listed before), run in that order: with --dist loadscope
# and --no-loadscope-reorder (pyproject; xdist otherwise reorders modules by their number of tests) each worker
# takes the next module when it is free, so the long ones start first and the short ones fill the end instead of
# one worker idling while the other finishes a long module it was handed last.
DEFAULT_TIER_ORDER = ("tests/jspec/serve/test_app.py", "tests/jspec/serve/test_slots.py",
                      "tests/pallas_kernels/test_tree_verify.py", "tests/jspec/test_logprobs.py",
                      "tests/jspec/test_ngram.py", "tests/jspec/test_multihost.py", "tests/jspec/test_dflash.py",
                      "tests/jspec/test_quantized_engine.py", "tests/jspec/test_spec_engine.py",
                      "tests/jspec/test_logits_processors.py", "tests/jspec/tools/test_cli.py",
                      "tests/jspec/test_hybrid.py", "tests/jspec/tools/test_cli_process.py",
                      "tests/models/test_llama_vs_hf.py", "tests/models/test_deepseek_v3.py",
                      "tests/models/test_windowed_families.py",
                      "tests/models/test_eagle3_layouts.py",
                      "tests/jspec/test_python_api.py", "tests/jspec/train/test_train_drafter.py",
                      "tests/jspec/tools/test_tune_cmd.py", "tests/jspec/test_spec_sampling.py",
                      "tests/jspec/test_tree_selection.py", "tests/jspec/test_sampling.py",
                      "tests/jspec/test_bf16_numerics.py", "tests/jspec/test_pard.py",
                      "tests/models/test_quantization.py", "tests/jspec/serve/test_paged.py",
                      "tests/jspec/serve/test_paged_scheduler.py", "tests/jspec/test_generate_program.py",
                      "tests/jspec/train/test_train_target.py", "tests/jspec/train/test_ttt.py",
                      "tests/pallas_kernels/test_tree_attention.py", "tests/pallas_kernels/test_window_and_sinks.py",
                      "tests/pallas_kernels/test_tree_build.py",
                      "tests/jspec/test_capture_hidden_states.py", "tests/jspec/test_draft_model.py",
                      "tests/models/test_checkpoint.py", "tests/models/test_paged_kv.py",
                      "tests/jspec/test_user_drafters.py", "tests/models/test_mtp.py",
                      "tests/models/test_shipped_targets.py", "tests/models/test_quantized_checkpoints.py",
                      "tests/jspec/structured_outputs/test_structured_generation.py",
                      "tests/jspec/train/test_pard.py", "tests/jspec/test_sharded_kernels.py",
                      "tests/jspec/test_auto.py", "tests/models/test_eagle3.py",
                      "tests/jspec/serve/test_scheduler.py", "tests/jspec/test_engine_vs_hf.py",
                      "tests/jspec/test_per_request_seeds.py", "tests/models/test_attention.py",
                      "tests/jspec/serve/test_kv_store.py", "tests/jspec/test_compile_options.py",
                      "tests/jspec/test_mtp.py", "tests/models/test_dflash.py", "tests/jspec/test_commit.py",
                      "tests/jspec/test_sharded_params.py", "tests/jspec/test_attention.py",
                      "tests/jspec/tools/test_bench_serve.py", "tests/models/test_mtp_checkpoint.py",
                      "tests/test_import_direction.py", "tests/jspec/test_chat.py",
                      "tests/jspec/tools/test_roofline_floor.py", "tests/jspec/tools/test_kernel_sweep.py",
                      "tests/pallas_kernels/test_paged_tree_attention.py", "tests/jspec/test_accept.py")
SLOW_TIER_ORDER = ("tests/jspec/serve/test_default_server.py", "tests/jspec/test_sharded_engine.py",
                   "tests/models/test_deepseek_v3.py", "tests/jspec/serve/test_fleet.py",
                   "tests/jspec/serve/test_windowed_served.py",
                   "tests/jspec/test_xla_defaults.py", "tests/jspec/tools/test_bench_serve.py",
                   "tests/jspec/serve/test_paged.py", "tests/jspec/test_bf16_numerics.py",
                   "tests/jspec/serve/test_sharded_serve.py", "tests/jspec/serve/test_app.py",
                   "tests/jspec/serve/test_slots.py", "tests/jspec/test_quantized_engine.py",
                   "tests/jspec/serve/test_serve_process.py", "tests/jspec/tools/test_draft_vocab_table.py",
                   "tests/models/test_streaming_convert.py", "tests/jspec/test_forced_kernels.py",
                   "tests/jspec/test_user_drafters.py", "tests/jspec/serve/test_paged_scheduler.py",
                   "tests/jspec/structured_outputs/test_structured_generation.py",
                   "tests/models/test_mtp_checkpoint.py", "tests/models/test_moe_drafters.py",
                   "tests/jspec/serve/test_moe_served.py", "tests/models/test_windowed_speculation.py",
                   "tests/models/test_moe_mesh.py", "tests/jspec/test_logprobs.py",
                   "tests/jspec/test_spec_engine.py", "tests/pallas_kernels/test_tree_verify.py",
                   "tests/models/test_eagle3_layouts.py", "tests/jspec/test_dflash.py",
                   "tests/jspec/tools/test_cli.py", "tests/jspec/train/test_train_target.py",
                   "tests/jspec/test_ngram.py", "tests/models/test_quantization.py",
                   "tests/models/test_llama_vs_hf.py", "tests/jspec/test_multihost.py",
                   "tests/jspec/test_capture_hidden_states.py", "tests/jspec/test_draft_model.py",
                   "tests/jspec/test_hybrid.py", "tests/jspec/test_mtp.py")


def _rank(order: tuple[str, ...]):
    def rank(item) -> int:
        path = item.nodeid.split("::")[0]
        return order.index(path) if path in order else len(order)
    return rank


def pytest_collection_modifyitems(config, items):
    """Orders long modules first; skips `gpu` / `tpu` tests off that device. (The slow tier is marked where each
    test is defined, ``@pytest.mark.slow``; pyproject's ``-m "not slow"`` deselects it, ``-m slow`` runs it.)"""
    order = SLOW_TIER_ORDER if config.option.markexpr.strip() == "slow" else DEFAULT_TIER_ORDER
    items.sort(key=_rank(order))  # stable: the order within each module, and of the other modules, is kept
    missing = [(marker, pytest.mark.skip(reason=f"needs a {marker.upper()}"))
               for marker, present in (("gpu", _has_gpu), ("tpu", _has_tpu)) if not present()]
    for item in items:
        for marker, skip in missing:
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """family -> (transformers model, HF dir, converted dir); each family built and converted once a session."""
    from tests.hf_models import make_hf_model, save_and_convert

    made = {}

    def get(family: str):
        if family not in made:
            model = make_hf_model(family)
            hf_dir, out_dir = save_and_convert(model, str(tmp_path_factory.mktemp(family)))
            made[family] = (model, hf_dir, out_dir)
        return made[family]

    return get


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After a test module, drops JAX's compilation caches and jspec's shared programs
    (``tests.process_programs.release``) when this process holds more than RELEASE_AT of ``vm.max_map_count``
    memory mappings: XLA:CPU keeps about three per kernel of every live compiled program, and a process past the
    limit dies inside LLVM ("Cannot allocate memory", then SIGSEGV; ``python -m tests.map_count_reproduction``
    shows it), or a server refuses to start. Below that, programs stay for later modules, which then compile
    less."""
    yield
    used, limit = memory_maps.maps_in_use(), memory_maps.max_map_count()
    if used is None or limit is None or used > RELEASE_AT * limit:
        process_programs.release()


@pytest.fixture
def no_session_compile_cache():
    with session_compile_cache_off():
        yield
