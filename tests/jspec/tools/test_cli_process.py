"""The jspec command as a process of its own: Ctrl-C ends it at once with exit code 130 (and an interrupted
convert leaves nothing behind), and a second identical call loads its programs from the compilation cache."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from jspec.tools.demo_model import write_random_hf_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PROMPT = "def fibonacci(n):"
EXIT_SECONDS = 5.0  # from SIGINT to exit, on a loaded 2-core machine; it takes well under a second


class Jspec:
    """``python -m jspec.tools.cli ARGV`` (or ``python -c CODE``) with its stdout collected as it comes."""

    def __init__(self, argv: list[str], jspec_home: str, code: str | None = None):
        command = [sys.executable, "-c", code] if code else [sys.executable, "-m", "jspec.tools.cli"]
        self.process = subprocess.Popen(command + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                                        env={**os.environ, "JSPEC_HOME": jspec_home})
        self.chunks: list[bytes] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while chunk := self.process.stdout.read1(4096):
            self.chunks.append(chunk)

    @property
    def stdout(self) -> str:
        return b"".join(self.chunks).decode(errors="replace")

    def wait_for(self, ready, timeout: float = 300.0) -> None:
        """Waits until ``ready(stdout)``; fails if the process ends first."""
        deadline = time.monotonic() + timeout
        while not ready(self.stdout):
            assert self.process.poll() is None, f"ended first ({self.process.returncode}): {self.finish()[1]}"
            assert time.monotonic() < deadline, f"not ready after {timeout}s: {self.stdout[-500:]}"
            time.sleep(0.02)

    def interrupt(self) -> tuple[int, float, str]:
        """SIGINT -> (exit code, seconds until it exited, stderr)."""
        assert self.process.poll() is None, "it ended before the interrupt"
        start = time.monotonic()
        self.process.send_signal(signal.SIGINT)
        try:
            code = self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        seconds = time.monotonic() - start
        return code, seconds, self.finish()[1]

    def finish(self, timeout: float = 300.0) -> tuple[int, str]:
        """Waits for the end -> (exit code, stderr)."""
        code = self.process.wait(timeout=timeout)
        self.reader.join()
        return code, self.process.stderr.read().decode(errors="replace")


def streaming_started(stdout: str) -> bool:
    """The completion of PROMPT has begun to appear after its echo."""
    echo = f"--- {PROMPT!r}\n{PROMPT}"
    return echo in stdout and len(stdout) > stdout.index(echo) + len(echo)


# A method named in full: the default (auto) would first time every candidate in the fresh $JSPEC_HOME
# (tests/jspec/test_auto.py covers that path).
FIXED_METHOD = ("--drafter", "ngram", "--tree", "chain", "--num-draft-tokens", "10")
def test_ctrl_c_while_streaming_exits_130_at_once(tmp_path):
    for attempt in range(3):  # one run in six once crashed or ignored it: try several
        run = Jspec(["generate", *FIXED_METHOD, "--max-new-tokens", "1000", "--max-seq-len", "2048", PROMPT],
                    str(tmp_path))
        run.wait_for(streaming_started)
        code, seconds, stderr = run.interrupt()
        assert code == 130 and seconds < EXIT_SECONDS, (attempt, code, seconds, stderr)
        assert stderr.endswith("jspec: interrupted\n") and "Traceback" not in stderr, stderr
def test_ctrl_c_during_one_long_generate_call_exits_130_at_once(tmp_path):
    run = Jspec(["generate", *FIXED_METHOD, "--no-stream", "--max-new-tokens", "1000", "--max-seq-len", "2048",
                 "def f(x):",
                 "import os", "class A:"], str(tmp_path))
    run.wait_for(lambda out: "[jspec] drafter" in out)
    time.sleep(2.0)  # loading, compiling or generating: each blocks in C++ for long stretches
    code, seconds, stderr = run.interrupt()
    assert code == 130 and seconds < EXIT_SECONDS and stderr.endswith("jspec: interrupted\n"), (code, seconds, stderr)


# Converts with orbax's save held up right after it wrote the params, so that the interrupt lands mid-conversion.
SLOW_CONVERT = """
import sys, time
import orbax.checkpoint as ocp
save = ocp.StandardCheckpointer.save
def slow_save(self, *args, **kwargs):
    save(self, *args, **kwargs)
    print("saving", flush=True)
    time.sleep(120)
ocp.StandardCheckpointer.save = slow_save
from jspec.tools.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_during_convert_leaves_nothing_behind(tmp_path):
    hf = write_random_hf_checkpoint(str(tmp_path / "hf"), config={
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1})
    out_parent = tmp_path / "converted"
    run = Jspec(["convert", "--src", hf, "--dst", str(out_parent / "model")], str(tmp_path), code=SLOW_CONVERT)
    run.wait_for(lambda out: "saving" in out)
    assert os.listdir(out_parent)  # the staging directory
    code, seconds, stderr = run.interrupt()
    assert code == 130 and seconds < EXIT_SECONDS, (code, seconds, stderr)
    assert os.listdir(out_parent) == []


def cache_files(jspec_home) -> list[str]:
    return sorted(os.path.relpath(os.path.join(root, name), jspec_home)
                  for root, _, files in os.walk(os.path.join(jspec_home, "compile-cache")) for name in files)


# slow: a second identical `jspec generate` process loads every program from $JSPEC_HOME's cache; default tier:
# test_cli's compiled programs kept under $JSPEC_HOME
@pytest.mark.slow
def test_a_second_identical_call_compiles_nothing(tmp_path, no_session_compile_cache):
    argv = ["generate", *FIXED_METHOD, "--no-baseline", "--max-new-tokens", "16", "def f(x):"]
    outputs, entries = [], []
    for _ in range(2):
        run = Jspec(argv, str(tmp_path))
        code, stderr = run.finish()
        assert code == 0, stderr
        outputs.append(run.stdout.split("\n--- 16 tokens")[0])
        entries.append(cache_files(tmp_path))
    assert entries[0], "the first call wrote no cache entries"
    assert entries[1] == entries[0]  # the second found every program in the cache and wrote none
    assert outputs[1] == outputs[0]
