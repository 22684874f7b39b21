"""A mixture-of-experts target on meshes equals one device (greedy, float32): tp 2 x dp 4 (tensor parallelism in each
data group: every expert's width split over "model") plain, and tp 2 x ep 4 (vLLM's expert parallelism: two whole
experts a data group, each split over "model"; the tokens gathered from every data group and the outputs scattered
back) plain and under EAGLE-3's dynamic tree. The target is gpt-oss-shaped (expert and router biases, sinks, windows
that bind; tests/models/moe_mesh_cases.py)."""

import pytest

from tests.virtual_devices import run_on_virtual_devices

# slow (one subprocess on 8 devices: 8 engines); default tier: test_moe's experts held in two shards add up to one
# device's (the expert-parallel combination), test_moe's speculation on a MoE target equals plain decoding
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report():
    return run_on_virtual_devices("tests.models.moe_mesh_cases", 8)


@pytest.mark.parametrize("method,mesh", [("plain", "tp2xdp4"), ("plain", "tp2xep4"), ("eagle3", "tp2xep4")])
def test_meshes_give_one_devices_tokens(report, method, mesh):
    assert report[f"{method}/{mesh}"]["tokens"] == report[f"{method}/one"]["tokens"]


def test_expert_parallelism_splits_whole_experts_over_data(report):
    assert report["plain/tp2xdp4"]["experts_spec"] == ["None", "None", "model"]
    assert report["plain/tp2xep4"]["experts_spec"] == ["data", "None", "model"]
    assert report["eagle3/one"]["acceptance_length"] > 1.0
