"""The Pallas tree kernels under shard_map on 4 virtual CPU devices (Pallas interpreter): tree attention with rows
over "data" and heads over "model", tree build and greedy verification per data shard, and paged tree attention
(Triton and TPU forms) with rows over "data" and the pool's KV heads over "model", equal to one device."""

from __future__ import annotations

from tests.virtual_devices import run_on_virtual_devices


def test_kernels_on_a_mesh_equal_one_device():
    report = run_on_virtual_devices("tests.jspec.sharded_kernels", 4)
    assert report["tree_attention"] < 1e-5
    assert report["tree_build"] == 0 and report["verify_greedy"] == 0
    for impl in ("interpret", "tpu_interpret"):  # the paged kernel's Triton and TPU forms
        assert report["paged_attention"][impl] < 1e-5
        assert report["paged_attention"][f"{impl}_vs_dense"] < 1e-5
