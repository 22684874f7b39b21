"""Run a test module in a fresh Python on N virtual CPU devices and read the JSON report it prints last.

JAX fixes its device count at start-up (``XLA_FLAGS=--xla_force_host_platform_device_count=N``), so the mesh tests run
their cases in a subprocess; the module's ``__main__`` prints one JSON object as its last stdout line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_on_virtual_devices(module: str, num_devices: int, *args: str, timeout: float = 600) -> dict:
    """``python -m module args...`` from the repository root on ``num_devices`` CPU devices -> its last stdout line,
    parsed as JSON; fails the test with the subprocess's stderr tail when it exits non-zero."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={num_devices}".strip()
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
