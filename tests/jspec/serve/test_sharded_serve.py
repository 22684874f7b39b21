"""The slot engine on a tensor-parallel mesh (4 virtual CPU devices, in a subprocess: the device count is fixed
when JAX starts): every request equals the single-device offline engine's output alone."""

from __future__ import annotations

import pytest

from tests.virtual_devices import run_on_virtual_devices

# slow: the slot engine on a tp 4 mesh equals one device offline; default tier: test_multihost's tp 4 engine,
# test_app's served request
pytestmark = pytest.mark.slow


def test_served_on_tp4_equals_one_device_alone():
    result = run_on_virtual_devices("tests.jspec.serve.sharded_serve_worker", 4)
    assert result["finished"]
    assert result["served"] == result["alone"]
