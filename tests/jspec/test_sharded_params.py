"""Per-device parameter bytes at tp=4, read from each array's addressable shards (4 virtual CPU devices, bundled
target, as shipped and rewritten as the converter writes now (groups of leaves, format 3)): orbax restores every
parameter straight into its sharding, and each device holds 1/4 of every split
weight plus the replicated ones (norms). The bundled target has 2 KV heads: at tp=4 each is stored twice, so each
device holds one KV head's k/v projection."""

from __future__ import annotations

import pytest

from tests.virtual_devices import run_on_virtual_devices


@pytest.fixture(scope="module")
def report():
    return run_on_virtual_devices("tests.jspec.sharded_params", 4)


@pytest.mark.parametrize("which", ["restored", "restored_per_leaf", "engine"])
def test_each_device_holds_a_quarter_of_the_split_weights(report, which):
    got = report[which]
    split, replicated = got["split_replicated"]
    assert got["single_device_leaves"] == 0
    assert replicated < 0.01 * (split + replicated)  # only norms are whole on every device
    assert len(got["device_bytes"]) == 4
    for device, held in got["device_bytes"].items():
        assert held == split // 4 + replicated, (device, held, split, replicated)


def test_both_checkpoint_formats_restore_into_the_sharding(report):
    assert report["formats"] == [1, 3]  # the bundled checkpoint (one tree), and as the converter writes now


def test_kv_heads_repeated_to_one_per_device(report):
    assert report["kv_heads"] == 4
    assert report["k_proj_per_device"] == [256, 64]  # hidden 256 -> one head of 64
