"""Two processes x 2 CPU devices on 127.0.0.1 (jax.distributed, gloo), tp=4 across both: each process returns the
single-device engine's tokens. The CLI's multi-host flags: only process 0 prints."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = ["def fibonacci(n):", "import os\n\ndef list_files(path):"]
MAX_NEW_TOKENS = 24
DRAFTER = "eagle3"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list[str]) -> subprocess.Popen:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_two(commands: list[list[str]], timeout: float = 400) -> list[tuple[int, str, str]]:
    """Starts both processes, waits for both (killing both after ``timeout`` s) -> (rc, stdout, stderr) each."""
    procs = [start(c) for c in commands]
    try:
        return [(p.wait(timeout=timeout), p.stdout.read(), p.stderr.read()) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


@pytest.fixture(scope="module")
def single_device_tokens():
    import jspec

    engine = jspec.SpecEngine.from_pretrained(jspec.bundled_model(), drafter=DRAFTER, max_batch_size=2,
                                              max_seq_len=256)
    return engine.generate(PROMPTS, max_new_tokens=MAX_NEW_TOKENS).token_ids


def test_two_processes_tp4_equal_one_device(single_device_tokens):
    address = f"127.0.0.1:{free_port()}"
    results = run_two([[sys.executable, "-m", "tests.jspec.multihost_worker", address, str(i)] for i in (0, 1)])
    for rc, out, err in results:
        assert rc == 0, err[-3000:]
    reports = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in results]
    assert [r["process"] for r in reports] == [0, 1]
    for report in reports:  # every process returns the whole output
        assert report["token_ids"] == single_device_tokens


def test_cli_multihost_only_process_0_prints(single_device_tokens):
    address = f"127.0.0.1:{free_port()}"
    base = [sys.executable, "-m", "jspec.tools.cli", "generate", PROMPTS[0], "--json", "--drafter", DRAFTER,
            "--max-new-tokens", str(MAX_NEW_TOKENS), "--max-seq-len", "256", "--no-baseline", "-tp", "4",
            "--coordinator-address", address, "--num-processes", "2", "--no-compile-cache"]
    results = run_two([base + ["--process-id", str(i)] for i in (0, 1)])
    for rc, out, err in results:
        assert rc == 0, err[-3000:]
    report = json.loads(results[0][1].strip().splitlines()[-1])
    assert report["token_ids"] == [single_device_tokens[0]]
    assert results[1][1].strip() == ""


@pytest.mark.parametrize("flags, message", [
    (["--coordinator-address", "127.0.0.1:1"], "needs all three"),
    (["--coordinator-address", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"], "--process-id 2"),
    (["-tp", "0"], "--tensor-parallel-size 0"),
])
def test_cli_parallel_flags_refused(flags, message):
    done = subprocess.run([sys.executable, "-m", "jspec.tools.cli", "generate", "x", "--no-baseline"] + flags,
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]
