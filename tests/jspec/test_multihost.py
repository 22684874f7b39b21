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
CHAIN = 4  # a chain of the head's drafts: the collectives of a verify pass as a tree's, fewer programs to compile


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list[str], **env) -> subprocess.Popen:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2".strip()
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu", **env)
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_two(commands: list[list[str]], timeout: float = 400, envs: list[dict] | None = None
            ) -> list[tuple[int, str, str]]:
    """Starts both processes, waits for both (killing both after ``timeout`` s) -> (rc, stdout, stderr) each."""
    procs = [start(c, **(envs[i] if envs else {})) for i, c in enumerate(commands)]
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
                                              spec=jspec.SpecConfig(tree="chain", num_steps=CHAIN), max_seq_len=256)
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


CLI_DRAFTER = "ngram"  # auto's candidates: plain decoding and two n-gram chains


def _seed_auto_cache(home: str, best: str, best_seconds: float) -> tuple[str, dict]:
    """Writes, under ``home``, the auto cache the CLI below reads on a 2-process tp4 mesh: ``best_seconds`` per
    step for the candidate labelled ``best`` and 1 s for every other -> (its path, its contents)."""
    import jspec
    from jspec import auto, autotune

    target = jspec.bundled_model()
    profile = autotune.load_profile(target)
    pool = auto.candidates([CLI_DRAFTER])
    timings = {autotune.timing_key(c, autotune.timed_acceptance(c, profile.get(c.label, 0.0)), False):
               (best_seconds if c.label == best else 1.0) for c in pool}
    key = autotune.cache_key(target, [CLI_DRAFTER], 1, 256, None, autotune.mesh_layout(4, 1, None, 2))
    path = os.path.join(home, "auto", key + ".json")
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        json.dump({"step_seconds": timings}, f)
    return path, {"step_seconds": timings}


# slow: the CLI on two processes prints once and decides auto on process 0's cache; default tier:
# test_two_processes_tp4_equal_one_device
@pytest.mark.slow
def test_cli_multihost_only_process_0_prints(single_device_tokens, tmp_path):
    """Greedy output equals one device's (any drafter gives plain decoding's tokens). Also: auto (--drafter with no
    tree flag) decides on process 0's cache for both processes, though process 1's own cache says otherwise (each
    process reading its own would run different programs, and the run would fail at the first collective that
    differs). Both caches are seeded, so nothing is timed: the broadcast alone is under test."""
    homes = [str(tmp_path / "home0"), str(tmp_path / "home1")]
    seeds = [_seed_auto_cache(homes[0], "ngram chain 4", 2e-4), _seed_auto_cache(homes[1], "ngram chain 9", 1e-4)]
    address = f"127.0.0.1:{free_port()}"
    base = [sys.executable, "-m", "jspec.tools.cli", "generate", PROMPTS[0], "--json", "--drafter", CLI_DRAFTER,
            "--max-new-tokens", str(MAX_NEW_TOKENS), "--max-seq-len", "256", "--no-baseline", "-tp", "4",
            "--coordinator-address", address, "--num-processes", "2", "--no-compile-cache"]
    results = run_two([base + ["--process-id", str(i)] for i in (0, 1)],
                      envs=[{"JSPEC_HOME": home} for home in homes])
    # Both processes' stderr on failure: one's shutdown error names the other as the one that stopped.
    assert [rc for rc, _, _ in results] == [0, 0], "\n".join(
        f"--- process {i} (rc {rc}):\n{err[-3000:]}" for i, (rc, _, err) in enumerate(results))
    report = json.loads(results[0][1].strip().splitlines()[-1])
    assert report["token_ids"] == [single_device_tokens[0]]
    assert results[1][1].strip() == ""
    assert report["auto"]["drafter"] == "ngram" and report["auto"]["spec"]["num_steps"] == 4  # process 0's choice
    measured_ms = sorted(c["step_ms"] for c in report["auto"]["candidates"])
    assert measured_ms == pytest.approx([0.2, 1000.0, 1000.0])  # process 0's timings, not process 1's
    for path, contents in seeds:  # nothing was re-timed or written
        assert json.load(open(path)) == contents


@pytest.mark.parametrize("flags, message", [
    (["--coordinator-address", "127.0.0.1:1"], "needs all three"),
    (["--coordinator-address", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"], "--process-id 2"),
    (["-tp", "0"], "--tensor-parallel-size 0"),
])
def test_cli_parallel_flags_refused(flags, message, capsys, monkeypatch):
    """Refused with exit status 2 before anything starts: no process group joined, no model loaded."""
    import jax

    import jspec
    from jspec.tools.cli import main

    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: pytest.fail("joined a process group"))
    monkeypatch.setattr(jspec.SpecEngine, "from_pretrained", lambda *a, **k: pytest.fail("loaded a model"))
    try:
        status = main(["generate", "x", "--no-baseline"] + flags)
    except SystemExit as exit:
        status = exit.code
    err = capsys.readouterr().err
    assert status == 2 and message in err, err[-2000:]
