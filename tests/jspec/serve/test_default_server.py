"""`jspec serve` as a new user starts it, on a machine with the stock vm.max_map_count (65,530): with no flags and
with --max-batch-size 8, the server warms up, answers, and its process stays under the limit. At b60d1ef the
default server compiled every bucket up front (89 programs, about 83,000 mappings) and refused to start."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import TEST_XLA_FLAGS
from tests.jspec.serve.default_server_worker import STOCK_MAX_MAP_COUNT

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.slow  # two cold server start-ups with XLA's default optimisations; default tier: test_slots'
# test_a_missing_bucket_runs_on_a_larger_one_while_it_compiles_off_the_scheduler (the mechanism that makes room)
@pytest.mark.parametrize("flags", [[], ["--max-batch-size", "8"]], ids=["no-flags", "max-batch-size-8"])
def test_the_default_server_starts_and_answers_under_the_stock_mapping_limit(flags, tmp_path):
    env = {**os.environ, "JSPEC_HOME": str(tmp_path)}
    # what users run: XLA's defaults (the suite's flags compile programs of other sizes)
    xla_flags = env.get("XLA_FLAGS", "")
    for flag in TEST_XLA_FLAGS.split():
        xla_flags = xla_flags.replace(flag, "")
    env["XLA_FLAGS"] = xla_flags.strip()
    run = subprocess.run([sys.executable, "-m", "tests.jspec.serve.default_server_worker", *flags],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["maps"] < STOCK_MAX_MAP_COUNT, result
    assert result["tokens"] == result["expected"] and result["served_compiles"] == []
