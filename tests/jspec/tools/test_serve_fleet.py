"""``jspec serve --data-parallel-size N``'s launcher, host only: the command line each replica gets, the devices
each one sees, and the refusal without sglang-router."""

from __future__ import annotations

import argparse
import importlib.util

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


def test_a_tpu_host_is_refused_by_name(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(serve_fleet.shutil, "which", lambda name: None)
    monkeypatch.setattr(serve_fleet, "_has_tpu", lambda: True)
    with pytest.raises(ValueError, match="--data-parallel-size 2 on a TPU host"):
        serve_fleet.replica_envs(2, 1)
