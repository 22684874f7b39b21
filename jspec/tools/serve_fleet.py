"""``jspec serve --data-parallel-size N``: N replicas behind a router at one address.

Each replica is a ``jspec serve`` process of its own on its own devices (``--tensor-parallel-size`` each: GPUs split
by ``CUDA_VISIBLE_DEVICES``, a TPU host's chips by libtpu's ``TPU_VISIBLE_CHIPS``; on a CPU the processes share
it), listening on a free port of ``--host``; in front of them the SGLang Model Gateway (``pip install
sglang-router``; its cache-aware policy sends a request to the replica whose prefix cache holds the longest part of
it) listens on ``--host``/``--port``. The same, run by hand::

    jspec serve --port 8001 &  jspec serve --port 8002 &
    python -m sglang_router.launch_router --worker-urls http://127.0.0.1:8001 http://127.0.0.1:8002 \\
        --policy cache_aware --port 8000

SIGTERM drains every replica (accepted requests finish, as one server's SIGTERM does) and then stops the router;
SIGINT stops everything at once. A replica that dies is the router's to route around (it retries the requests the
replica dropped on another, and its circuit breaker and health checks stop sending to it) and the launcher's to
start again on the same port, once a minute at most. Once the new process answers ``/health``, the launcher
registers it with the router again (the gateway's worker API: ``DELETE /workers/{id}``, then ``POST /workers``):
the router then sends to it as to a new worker, with its circuit breaker closed and its cache-aware tree empty, as
the new process's prefix cache is (left to the router's own health checks, sglang-router 0.3.2 took a restarted
replica back once in four runs).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

STARTUP_SECONDS = 1800.0  # replicas compile their programs at start-up (minutes for a large model)
POLL_SECONDS = 0.5
HEALTH_CHECK_SECONDS = 5  # the router's health-check interval (its default, 60 s, leaves a dead replica listed long)
BREAKER_SECONDS = 10      # how long the router's circuit breaker keeps a failing replica out (default 60 s): a
                          # restarted one takes at least this long to start anyway
RESTART_SECONDS = 60.0    # a replica is started again at most this often
# Flags the launcher sets per replica, dropped from the command line it passes on (with their value).
_OWN_FLAGS = ("--data-parallel-size", "-dp", "--port", "--host")


def replica_argv(argv: list[str]) -> list[str]:
    """``jspec serve``'s command line without the flags the launcher sets per replica (:data:`_OWN_FLAGS`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in _OWN_FLAGS:
            skip = True
            continue
        if any(arg.startswith(flag + "=") for flag in _OWN_FLAGS):
            continue
        out.append(arg)
    return out


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _gpus() -> list[str]:
    """The NVIDIA GPUs this process may use (``CUDA_VISIBLE_DEVICES``, else ``nvidia-smi -L``), without starting
    JAX (which would claim their memory in this launcher)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d for d in visible.split(",") if d]
    if not shutil.which("nvidia-smi"):
        return []
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False).stdout
    return [str(i) for i, line in enumerate(listing.splitlines()) if line.startswith("GPU ")]


def _tpu_chips() -> list[str]:
    """This host's TPU chips by index (their device files: /dev/accel* on v4, v5e and v6e hosts, /dev/vfio/<n> on
    newer ones), without starting JAX."""
    accel = sorted(int(name[5:]) for name in _listdir("/dev") if name.startswith("accel") and name[5:].isdigit())
    vfio = sorted(int(name) for name in _listdir("/dev/vfio") if name.isdigit())
    return [str(i) for i in range(len(accel or vfio))]


def _listdir(path: str) -> list[str]:
    return os.listdir(path) if os.path.isdir(path) else []


# A replica's chips as a block of the host's chip grid (libtpu's TPU_CHIPS_PER_PROCESS_BOUNDS, x,y,z), by how many
# it has, each replica taking consecutive chip indices: the blocks of JAX's recipe for processes that share a TPU
# host without communicating (a v4 host has 4 chips, a v5e or v6e host 8).
TPU_CHIP_BLOCKS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}
TPU_FIRST_PORT = 8476  # libtpu's own; each replica's TPU runtime listens on the next one


def replica_envs(replicas: int, tensor_parallel_size: int) -> list[dict[str, str]]:
    """Each replica's environment: on a GPU machine its own ``tensor_parallel_size`` GPUs (``CUDA_VISIBLE_DEVICES``);
    on a TPU host its own chips (libtpu's variables for processes that share a host and do not communicate:
    ``TPU_VISIBLE_CHIPS``, its block of the chip grid, a port of its own); elsewhere as this one's (on a CPU the
    replicas share it). ValueError when the devices do not go round."""
    gpus = _gpus()
    if gpus:
        if len(gpus) < replicas * tensor_parallel_size:
            raise ValueError(f"--data-parallel-size {replicas} x --tensor-parallel-size {tensor_parallel_size} needs "
                             f"{replicas * tensor_parallel_size} GPUs, but {len(gpus)} are visible")
        return [dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(gpus[i * tensor_parallel_size:
                                                                      (i + 1) * tensor_parallel_size]))
                for i in range(replicas)]
    chips = _tpu_chips()
    if not chips:
        return [dict(os.environ) for _ in range(replicas)]
    if tensor_parallel_size not in TPU_CHIP_BLOCKS:
        raise ValueError(f"--data-parallel-size {replicas} on a TPU host: --tensor-parallel-size "
                         f"{tensor_parallel_size} chips a replica is not a block of the host's chip grid; expected "
                         f"one of {sorted(TPU_CHIP_BLOCKS)}")
    if len(chips) < replicas * tensor_parallel_size:
        raise ValueError(f"--data-parallel-size {replicas} x --tensor-parallel-size {tensor_parallel_size} needs "
                         f"{replicas * tensor_parallel_size} TPU chips, but this host has {len(chips)}")
    envs = []
    for i in range(replicas):
        mine = ",".join(chips[i * tensor_parallel_size:(i + 1) * tensor_parallel_size])
        port = TPU_FIRST_PORT + i
        envs.append(dict(os.environ, TPU_VISIBLE_CHIPS=mine, TPU_VISIBLE_DEVICES=mine,
                         TPU_CHIPS_PER_PROCESS_BOUNDS=TPU_CHIP_BLOCKS[tensor_parallel_size],
                         TPU_PROCESS_BOUNDS="1,1,1", TPU_MESH_CONTROLLER_ADDRESS=f"localhost:{port}",
                         TPU_MESH_CONTROLLER_PORT=str(port)))
    return envs


def _wait_healthy(url: str, processes: list[subprocess.Popen], what: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        dead = [p for p in processes if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{what} exited (status {dead[0].returncode}) before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=5.0) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):  # not listening yet, or 503 while warming up
            pass
        time.sleep(POLL_SECONDS)
    raise RuntimeError(f"{what} was not ready at {url} within {STARTUP_SECONDS:.0f} s")


def _wait_registered(router_url: str, worker_urls: list[str], router: subprocess.Popen, deadline: float) -> None:
    """Waits until the router lists every worker URL in ``GET /workers``: its ``/health`` answers before it has
    registered the workers it was started with, and a request in between gets no worker."""
    listed: set[str] = set()
    while time.monotonic() < deadline:
        if router.poll() is not None:
            raise RuntimeError(f"the router exited (status {router.returncode}) before it registered its workers")
        try:
            listed = {w.get("url") for w in _call("GET", router_url + "/workers").get("workers", [])}
        except (urllib.error.URLError, OSError, ValueError):
            listed = set()
        if listed >= set(worker_urls):
            return
        time.sleep(POLL_SECONDS)
    raise RuntimeError(f"the router at {router_url} listed {sorted(listed)}, not all of {worker_urls}, within "
                       f"{STARTUP_SECONDS:.0f} s")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _call(method: str, url: str, body: dict | None = None) -> dict:
    """One JSON call to the router's API -> its JSON reply ({} where it has none)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10.0) as response:
        text = response.read()
    return json.loads(text) if text.strip() else {}


def register_again(router_url: str, worker_url: str) -> bool:
    """Registers a restarted replica with the router as a new worker: its entries in ``GET /workers`` deleted
    (``DELETE /workers/{id}``), then ``POST /workers`` with its URL -> whether the router took it (an error is
    printed, not raised: the router may still take the replica back by its own health checks)."""
    try:
        for worker in _call("GET", router_url + "/workers").get("workers", []):
            if worker.get("url") == worker_url and worker.get("id"):
                _call("DELETE", f"{router_url}/workers/{urllib.parse.quote(str(worker['id']), safe='')}")
        _call("POST", router_url + "/workers", {"url": worker_url})
        return True
    except (urllib.error.URLError, OSError, ValueError) as error:
        print(f"jspec serve: registering {worker_url} with the router again failed ({error}); its health checks "
              f"may still take it back", flush=True)
        return False


def run_fleet(args: argparse.Namespace) -> int:
    """Starts ``args.data_parallel_size`` replicas and the router; serves until a signal (module docstring)."""
    if importlib.util.find_spec("sglang_router") is None:
        raise ValueError(f"--data-parallel-size {args.data_parallel_size} runs the replicas behind sglang-router: "
                         f"pip install sglang-router (or run one jspec serve per replica behind your own router)")
    host = args.host
    envs = replica_envs(args.data_parallel_size, args.tensor_parallel_size)
    ports = [_free_port(host) for _ in envs]
    base = [sys.executable, "-m", "jspec.tools.cli", *replica_argv(args.argv), "--host", host]  # argv: "serve" ...
    replicas = [subprocess.Popen(base + ["--port", str(port)], env=env) for port, env in zip(ports, envs)]
    router = None
    stopping = {"signal": None}

    def on_signal(signum, _frame):
        stopping["signal"] = signum

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        urls = [f"http://{_url_host(host)}:{port}" for port in ports]
        deadline = time.monotonic() + STARTUP_SECONDS
        for index, url in enumerate(urls):
            _wait_healthy(url + "/health", replicas, f"replica {index}", deadline)
        router = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port",
                                   str(args.port), "--policy", "cache_aware", "--health-check-interval-secs",
                                   str(HEALTH_CHECK_SECONDS), "--cb-timeout-duration-secs", str(BREAKER_SECONDS),
                                   "--worker-urls", *urls])
        router_url = f"http://{_url_host(host)}:{args.port}"
        _wait_healthy(router_url + "/health", [router], "the router", deadline)
        _wait_registered(router_url, urls, router, deadline)
        print(f"jspec serve: http://{_url_host(host)}:{args.port}/v1 ({len(urls)} replicas behind sglang-router: "
              f"{' '.join(urls)}) ready", flush=True)
        restarted = [-RESTART_SECONDS] * len(replicas)  # when each was last started again
        rejoining: set[int] = set()  # replicas started again, not yet registered with the router again
        while stopping["signal"] is None and router.poll() is None:
            for index, process in enumerate(replicas):
                if process.poll() is not None and time.monotonic() - restarted[index] > RESTART_SECONDS:
                    print(f"jspec serve: replica {index} ({urls[index]}) exited with status {process.returncode}; "
                          f"starting it again", flush=True)
                    replicas[index] = subprocess.Popen(base + ["--port", str(ports[index])], env=envs[index])
                    restarted[index] = time.monotonic()
                    rejoining.add(index)
                elif index in rejoining and process.poll() is None and _healthy(urls[index] + "/health"):
                    rejoining.discard(index)
                    if register_again(router_url, urls[index]):
                        print(f"jspec serve: replica {index} ({urls[index]}) is ready again; registered with the "
                              f"router", flush=True)
            time.sleep(POLL_SECONDS)
        return 0 if stopping["signal"] is not None else 1
    finally:
        graceful = stopping["signal"] != signal.SIGINT
        for process in replicas:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM if graceful else signal.SIGKILL)
        for process in replicas:
            try:
                process.wait(timeout=args.shutdown_timeout + 30.0 if graceful else 10.0)
            except subprocess.TimeoutExpired:
                process.kill()
        if router is not None and router.poll() is None:
            router.terminate()
            try:
                router.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                router.kill()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
