"""The test session compiles with XLA:CPU's optimisations and fusion emitters off (tests/conftest.py: the same values,
compiled faster); users run XLA's defaults. Here one greedy-equality test per drafter family runs again in a pytest
process of its own under XLA's defaults (its own compilation cache): speculative output = plain decoding in the
programs users run."""

import os
import subprocess
import sys

import pytest

from tests.conftest import TEST_XLA_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# One per drafter family: EAGLE-3, a draft model, n-gram lookup, lookup then EAGLE-3 (the bundled model, as the
# README's command runs it), MTP, DFlash, PARD, a user drafter.
REPRESENTATIVES = (
    "tests/jspec/test_spec_engine.py::test_greedy_output_equals_plain_decoding[random-dynamic]",
    "tests/jspec/test_draft_model.py::test_greedy_output_equals_plain_decoding[chain]",
    "tests/jspec/test_ngram.py::test_greedy_output_equals_plain_decoding[chain]",
    "tests/jspec/test_hybrid.py::test_bundled_ngram_eagle3_equals_plain_decoding",
    "tests/jspec/test_mtp.py::test_greedy_output_equals_plain_decoding_dynamic_tree[mtp_eagle-mimo]",
    "tests/jspec/test_dflash.py::test_greedy_output_equals_plain_decoding[chain]",
    "tests/jspec/test_pard.py::test_greedy_output_equals_plain_decoding[chain]",
    "tests/jspec/test_user_drafters.py::test_greedy_output_is_the_targets_and_drafts_are_accepted[chain]",
)


# slow: every family's programs compiled again with XLA's optimisations (minutes); default tier: the same tests
# under the session's flags, where each representative above runs (or its slow-tier siblings do)
@pytest.mark.slow
def test_one_greedy_equality_test_per_drafter_family_passes_under_xla_defaults(tmp_path):
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache")}
    # an explicit optimisation level is XLA's default (3); tests/conftest.py then adds none of its own flags
    flags = env.get("XLA_FLAGS", "")
    for flag in TEST_XLA_FLAGS.split():
        flags = flags.replace(flag, "")
    env["XLA_FLAGS"] = (flags + " --xla_backend_optimization_level=3").strip()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-m", "",
                          *REPRESENTATIVES], capture_output=True, text=True, cwd=REPO, env=env, timeout=1200)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert f"{len(REPRESENTATIVES)} passed" in run.stdout, run.stdout[-2000:]
