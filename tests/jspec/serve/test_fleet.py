"""Replicas behind sglang-router: ``jspec serve --data-parallel-size 2`` starts two replicas (one process each) and
the SGLang Model Gateway in front of them with its cache-aware policy, at one address. Through it, 32 concurrent
greedy completions from the official client equal offline decoding; requests sharing a long prefix go to the
replica whose cache holds it (its prefix hits); SIGTERM drains the fleet and exits 0."""

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
    # SIGTERM drains the replicas and stops the router
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 0
