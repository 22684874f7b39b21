"""Every tree kernel forced (tree build, tree verify, tree attention) in the engine: greedy output equal to plain
decoding on the bundled model, on one device and on a 4-device mesh (Pallas interpreters on this CPU; the compiled
forms are the `gpu` / `tpu` marked kernel tests)."""

from __future__ import annotations

import pytest

from tests.virtual_devices import run_on_virtual_devices

# slow: the engine with every tree kernel forced to its TPU and its Triton form (interpreters) = plain decoding, on
# one device and on dp 2 x tp 2; default tier: each kernel against its reference in both forms (tests/pallas_kernels)
# and test_sharded_kernels (the Triton forms per shard on 4 devices)
pytestmark = pytest.mark.slow

LOWERINGS = ("tpu_interpret", "interpret")  # the Mosaic TPU forms, the Triton forms


def test_forced_kernels_equal_plain_decoding_on_one_device_and_a_mesh():
    report = run_on_virtual_devices("tests.jspec.forced_kernels", 4, *LOWERINGS, timeout=1200)
    for kernels in LOWERINGS:
        assert report[kernels]["single"] == report["plain"], kernels
        assert report[kernels]["dp2xtp2"] == report["plain"], kernels
