"""Replicas behind sglang-router: ``jspec serve --data-parallel-size 2`` starts two replicas (one process each) and
the SGLang Model Gateway in front of them with its cache-aware policy, at one address. Through it, 32 concurrent
greedy completions from the official client equal offline decoding; requests sharing a long prefix go to the
replica whose cache holds it (its prefix hits); a replica killed under load loses no request, is started again
and served through the router again;
SIGTERM drains the fleet (accepted requests finish) and exits 0."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

import jspec
from tests.jspec.serve.test_app import CODE

# slow (two replicas compile their server programs, and the router starts); default tier: test_app's
# test_what_routers_read (the worker endpoints the router reads), tests/jspec/tools/test_serve_fleet.py
pytestmark = pytest.mark.slow
STARTUP_SECONDS = 600


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    pytest.importorskip("sglang_router")
    log = open(tmp_path_factory.mktemp("fleet") / "fleet.log", "w+")
    process = subprocess.Popen([sys.executable, "-m", "jspec.tools.cli", "serve", "--data-parallel-size", "2",
                                "--port", str(_free_port()), "--max-num-seqs", "8",
                                "--max-seq-len", "256", "--no-adapt"],
                               stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    deadline, ready = time.monotonic() + STARTUP_SECONDS, None
    while ready is None and time.monotonic() < deadline and process.poll() is None:
        time.sleep(1.0)
        log.seek(0)
        ready = re.search(r"jspec serve: (http://\S+)/v1 \(2 replicas behind sglang-router: (.+)\) ready", log.read())
    if ready is None:
        process.kill()
        log.seek(0)
        pytest.fail(f"the fleet did not start:\n{log.read()[-3000:]}")
    yield process, ready.group(1), ready.group(2).split()
    if process.poll() is None:
        process.kill()
    log.close()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def test_requests_through_the_router_equal_offline_and_a_shared_prefix_stays_on_one_replica(fleet):
    process, url, replicas = fleet
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=120)
    model = client.models.list().data[0].id
    engine = jspec.SpecEngine.from_pretrained(jspec.bundled_model(), max_batch_size=4, max_seq_len=256)
    tokenizer = engine.tokenizer
    lines = CODE.splitlines()
    prompts = ["\n".join(lines[i % len(lines):i % len(lines) + 3]) for i in range(32)]
    done = {r: _metric(r, "jspec:request_success_total") for r in replicas}
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        served = list(pool.map(lambda p: client.completions.create(model=model, prompt=p, max_tokens=16,
                                                                   temperature=0).choices[0].text, prompts))
    offline = [engine.generate([tokenizer.encode(p).ids], max_new_tokens=16).texts[0] for p in prompts]
    assert served == offline
    assert all(_metric(r, "jspec:request_success_total") > done[r] for r in replicas)  # both replicas served
    # a long shared prefix: after the first request caches it, the cache-aware policy keeps its followers there
    prefix = CODE[:600]
    before = {r: (_metric(r, "jspec:prefix_cache_hits_total"), _metric(r, "jspec:request_success_total"))
              for r in replicas}
    for i in range(6):
        client.completions.create(model=model, prompt=prefix + f"\n# {i}", max_tokens=2, temperature=0)
    gained = {r: (_metric(r, "jspec:prefix_cache_hits_total") - before[r][0],
                  _metric(r, "jspec:request_success_total") - before[r][1]) for r in replicas}
    holder = max(replicas, key=lambda r: gained[r][1])
    assert gained[holder][1] >= 5 and gained[holder][0] > 0, gained


def test_a_killed_replica_loses_no_request_and_comes_back(fleet):
    """SIGKILL on a replica while 16 requests run: each completes (the router retries what the replica dropped on
    the other) within 60 s, none twice; the launcher starts the replica again on its port and registers it with the
    router again, which sends it requests within a minute."""
    process, url, replicas = fleet
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=60, max_retries=0)
    model = client.models.list().data[0].id
    children = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(process.pid)], capture_output=True,
                              text=True, check=True).stdout
    victim_port = replicas[0].rsplit(":", 1)[1]
    victim = next(int(line.split()[0]) for line in children.splitlines() if f"--port {victim_port}" in line)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = [pool.submit(client.completions.create, model=model, prompt=f"def f{i}(x):", max_tokens=48,
                               temperature=0) for i in range(16)]
        time.sleep(1.0)
        os.kill(victim, signal.SIGKILL)
        finished = [answer.result(timeout=60).choices[0].finish_reason for answer in answers]
    assert len(finished) == 16 and set(finished) <= {"length", "stop"}
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:  # started again by the launcher, on its port
        try:
            if httpx.get(replicas[0] + "/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(1.0)
    assert httpx.get(replicas[0] + "/health", timeout=5).status_code == 200
    # registered with the router again by the launcher: requests reach it. The cache-aware policy sends a prompt
    # to the replica whose tree holds most of it, and one that matches no tree to the smallest tree: the restarted
    # replica's, empty. These prompts (digits first) match nothing the earlier tests sent, nor the rounds before:
    # a round sent before the router took the replica back would otherwise pin the same prompts to the other.
    served = _metric(replicas[0], "jspec:request_success_total")
    deadline, round_ = time.monotonic() + 60, 0
    while _metric(replicas[0], "jspec:request_success_total") == served and time.monotonic() < deadline:
        round_ += 1
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda i: client.completions.create(model=model, prompt=f"{7919 * (16 * round_ + i)} = total",
                                                              max_tokens=24, temperature=0), range(16)))
    assert _metric(replicas[0], "jspec:request_success_total") > served


def test_sigterm_drains_the_fleet(fleet):
    process, url, _ = fleet
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=60, max_retries=0)
    model = client.models.list().data[0].id
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = [pool.submit(client.completions.create, model=model, prompt=f"def g{i}():", max_tokens=32,
                               temperature=0) for i in range(4)]
        time.sleep(0.5)
        process.send_signal(signal.SIGTERM)  # accepted requests finish
        assert all(answer.result(timeout=60).choices[0].finish_reason in ("length", "stop") for answer in answers)
    assert process.wait(timeout=120) == 0
