"""``jspec serve`` as a process of its own: ready line, a completion through OpenAI's client, SIGTERM while a
stream is in flight (the stream ends, the process exits 0), and bad flags (exit 2 with one clear line)."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
READY_SECONDS = 300.0  # load + warm-up (every program compiled) on a loaded 2-core machine: well under a minute alone
EXIT_SECONDS = 60.0    # from SIGTERM to exit: the stream's rest (--shutdown-timeout 20 at most) and uvicorn's close


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Serve:
    """``python -m jspec.tools.cli serve ARGV`` with its output collected as it comes."""

    def __init__(self, argv: list[str], jspec_home: str):
        self.process = subprocess.Popen([sys.executable, "-m", "jspec.tools.cli", "serve", *argv],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO,
                                        env={**os.environ, "JSPEC_HOME": jspec_home})
        self.chunks: list[bytes] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while chunk := self.process.stdout.read1(4096):
            self.chunks.append(chunk)

    @property
    def output(self) -> str:
        return b"".join(self.chunks).decode(errors="replace")

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            assert self.process.poll() is None, f"ended first ({self.process.returncode}): {self.output[-2000:]}"
            assert time.monotonic() < deadline, f"no {text!r} after {timeout}s: {self.output[-2000:]}"
            time.sleep(0.05)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


# slow: a real `jspec serve` process answers and drains on SIGTERM; default tier: test_app's in-process server
@pytest.mark.slow
def test_serve_answers_then_drains_on_sigterm(tmp_path):
    port = free_port()
    serve = Serve(["--port", str(port), "--max-seq-len", "128", "--max-batch-size", "2", "--max-total-tokens", "1024",
                   "--shutdown-timeout", "20"],
                  str(tmp_path))
    try:
        serve.wait_for(" ready", READY_SECONDS)
        ready = [line for line in serve.output.splitlines() if line.endswith(" ready")]
        assert ready == [f"jspec serve: http://127.0.0.1:{port}/v1 (model 'jspec-code', drafter ngram chain 10) "
                         f"ready"], serve.output
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        out = client.completions.create(model="jspec-code", prompt="def fibonacci(n):", max_tokens=8)
        assert out.usage.completion_tokens == 8 and out.choices[0].finish_reason == "length"

        started, chunks, errors = threading.Event(), [], []

        def stream() -> None:
            try:
                for chunk in client.completions.create(model="jspec-code", prompt="import os\n", max_tokens=100,
                                                       temperature=1.0, seed=5, stream=True):
                    chunks.append(chunk)
                    started.set()
            except Exception as error:  # cut by the shutdown: allowed, as long as it ends
                errors.append(error)
            finally:
                started.set()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert started.wait(timeout=60), "the stream never started"
        sent = time.monotonic()
        serve.process.send_signal(signal.SIGTERM)
        code = serve.process.wait(timeout=EXIT_SECONDS)
        reader.join(timeout=10)
        assert not reader.is_alive(), "the stream did not end"
        assert code == 0, serve.output[-2000:]
        assert time.monotonic() - sent < EXIT_SECONDS
        finished = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finished or errors, "the stream neither finished nor was cut"
        assert "Traceback" not in serve.output, serve.output[-2000:]
    finally:
        serve.kill()


@pytest.mark.parametrize("argv, message", [
    (["--max-num-seqs", "0"], "jspec: error: --max-num-seqs 0: expected an integer >= 1"),
    (["--port", "70000"], "jspec: error: --port 70000: expected 0 .. 65535"),
    (["--bogus"], "jspec: error: unrecognized arguments: --bogus"),
    (["--port", "eighty"], "jspec serve: error: argument --port: invalid int value: 'eighty'"),
    (["--short-draft-len", "9", "--drafter", "ngram"],
     "jspec: error: --short-draft-len 9: expected 0 or fewer drafts than the drafter's chain"),
])
def test_bad_flags_exit_2_with_one_clear_line(tmp_path, monkeypatch, capsys, argv, message):
    """In this process: refused before a model is loaded or a port opened."""
    monkeypatch.setenv("JSPEC_HOME", str(tmp_path))
    err = _refused(["serve", *argv], capsys)
    assert message in err and "Traceback" not in err, err


def test_a_taken_port_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JSPEC_HOME", str(tmp_path))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = _refused(["serve", "--port", str(port)], capsys)
    assert f"cannot listen on 127.0.0.1:{port}" in err, err


def _refused(argv: list[str], capsys) -> str:
    """``jspec argv`` run in this process, which must exit with status 2 -> what it wrote on stderr."""
    from jspec.tools.cli import main

    try:
        status = main(argv)
    except SystemExit as exit:
        status = exit.code
    err = capsys.readouterr().err
    assert status == 2, err[-2000:]
    return err
