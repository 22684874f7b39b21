"""``jspec serve --data-parallel-size N``'s launcher, host only: the command line each replica gets, the devices
each one sees, the refusal without sglang-router, and a restarted replica registered with the real router again
(over workers that answer what the router reads)."""

from __future__ import annotations

import argparse
import http.server
import importlib.util
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from jspec.tools import serve_fleet


def test_each_replica_gets_the_command_line_less_what_the_launcher_sets():
    argv = ["serve", "--model", "m", "-dp", "2", "--port", "8000", "--host=0.0.0.0", "--max-num-seqs", "8",
            "--data-parallel-size=2", "--no-adapt"]
    assert serve_fleet.replica_argv(argv) == ["serve", "--model", "m", "--max-num-seqs", "8", "--no-adapt"]


def test_gpus_are_split_between_replicas(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5")
    envs = serve_fleet.replica_envs(3, 2)
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == ["0,1", "2,3", "4,5"]
    with pytest.raises(ValueError, match="needs 8 GPUs, but 6 are visible"):
        serve_fleet.replica_envs(4, 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(serve_fleet.shutil, "which", lambda name: None)
    assert len(serve_fleet.replica_envs(2, 1)) == 2  # no GPU: the replicas share the CPU


def test_without_sglang_router_it_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(serve_fleet.importlib.util, "find_spec",
                        lambda name, *a: None if name == "sglang_router" else real(name, *a))
    with pytest.raises(ValueError, match="pip install sglang-router"):
        serve_fleet.run_fleet(argparse.Namespace(data_parallel_size=2))


def test_a_tpu_hosts_chips_are_split_between_replicas(monkeypatch):
    """Each replica sees its own chips (consecutive, as a block of the chip grid) and runs its TPU runtime on a port
    of its own; chips that do not go round, or a count that is no block, are refused by name."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(serve_fleet.shutil, "which", lambda name: None)
    monkeypatch.setattr(serve_fleet, "_listdir", lambda path: {"/dev": ["accel0", "accel1", "accel2", "accel3",
                                                                        "accel4", "accel5", "accel6", "accel7",
                                                                        "null"]}.get(path, []))
    envs = serve_fleet.replica_envs(4, 2)
    assert [env["TPU_VISIBLE_CHIPS"] for env in envs] == ["0,1", "2,3", "4,5", "6,7"]
    assert {env["TPU_CHIPS_PER_PROCESS_BOUNDS"] for env in envs} == {"1,2,1"}
    assert len({env["TPU_MESH_CONTROLLER_PORT"] for env in envs}) == 4
    assert [env["TPU_VISIBLE_CHIPS"] for env in serve_fleet.replica_envs(2, 4)] == ["0,1,2,3", "4,5,6,7"]
    with pytest.raises(ValueError, match="needs 16 TPU chips, but this host has 8"):
        serve_fleet.replica_envs(8, 2)
    with pytest.raises(ValueError, match="--tensor-parallel-size 3 chips a replica is not a block"):
        serve_fleet.replica_envs(2, 3)


class _Worker(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible worker as far as the router reads one: its info, and completions that name its port."""

    def log_message(self, *args):
        pass

    def _send(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path.startswith("/v1/models"):
            return self._send({"object": "list", "data": [{"id": "m", "object": "model"}]})
        if "model_info" in self.path:
            return self._send({"model_path": "m", "model_type": "llama", "architectures": ["LlamaForCausalLM"]})
        if "server_info" in self.path:
            return self._send({"model_path": "m", "served_model_name": "m", "max_running_requests": 8})
        return self._send({})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        port = self.server.server_address[1]
        self._send({"id": "c", "object": "text_completion", "model": "m", "choices": [
            {"index": 0, "text": str(port), "finish_reason": "length"}], "usage": {
            "prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


def _serve_worker() -> http.server.ThreadingHTTPServer:
    worker = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Worker)
    threading.Thread(target=worker.serve_forever, daemon=True).start()
    return worker


def test_a_restarted_replica_is_registered_with_the_router_again():
    """The launcher's call after a restart, against the real router (sglang-router's gateway): the replica's old
    entry is deleted and a new one added (a new worker id, the same URL), and the router sends to it."""
    pytest.importorskip("sglang_router")
    workers = [_serve_worker() for _ in range(2)]
    urls = [f"http://127.0.0.1:{w.server_address[1]}" for w in workers]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    router = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                               str(port), "--policy", "round_robin", "--worker-urls", *urls],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        serve_fleet._wait_healthy(base + "/health", [router], "the router", time.monotonic() + 60)
        serve_fleet._wait_registered(base, urls, router, time.monotonic() + 60)

        def ids() -> dict[str, str]:
            return {w["url"]: w["id"] for w in serve_fleet._call("GET", base + "/workers")["workers"]}

        before = ids()
        assert set(before) == set(urls)
        assert serve_fleet.register_again(base, urls[0])
        deadline = time.monotonic() + 30
        while (urls[0] not in ids() or ids()[urls[0]] == before[urls[0]]) and time.monotonic() < deadline:
            time.sleep(0.2)
        after = ids()
        assert set(after) == set(urls) and after[urls[0]] != before[urls[0]] and after[urls[1]] == before[urls[1]]
        served = set()
        while len(served) < 2 and time.monotonic() < deadline:
            request = urllib.request.Request(base + "/v1/completions", data=json.dumps(
                {"model": "m", "prompt": "x", "max_tokens": 1}).encode(), headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=10) as response:
                served.add(json.loads(response.read())["choices"][0]["text"])
        assert served == {u.rsplit(":", 1)[1] for u in urls}
        assert not serve_fleet.register_again(f"http://127.0.0.1:{_closed_port()}", urls[0])  # no router: False
    finally:
        router.terminate()
        router.wait(10)
        for worker in workers:
            worker.shutdown()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
