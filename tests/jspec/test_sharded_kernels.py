"""The Pallas tree kernels under shard_map on 4 virtual CPU devices (Pallas interpreter): tree attention with rows
over "data" and heads over "model", tree build and greedy verification per data shard, equal to one device."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_kernels_on_a_mesh_equal_one_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-m", "tests.jspec.sharded_kernels"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["tree_attention"] < 1e-5
    assert report["tree_build"] == 0 and report["verify_greedy"] == 0
