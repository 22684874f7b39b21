"""The slot engine on a tensor-parallel mesh (4 virtual CPU devices, in a subprocess: the device count is fixed
when JAX starts): every request equals the single-device offline engine's output alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jspec.bundle import bundled_dir

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.skipif(bundled_dir("target") is None, reason="bundled code model not built")
def test_served_on_tp4_equals_one_device_alone():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-m", "tests.jspec.serve.sharded_serve_worker"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["finished"]
    assert result["served"] == result["alone"]
