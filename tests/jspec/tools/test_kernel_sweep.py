"""jspec.tools.kernel_sweep (``jspec bench --kernel-sweep``): the bytes it counts, the shares it reports, the three
columns computing the same attention; on a CPU in the Pallas interpreter (speed is never checked here)."""

from __future__ import annotations

import types

import pytest

from jspec.tools import kernel_sweep
from jspec.tools.kernel_sweep import Shape, peak_bandwidth, run_kernel_sweep, sweep_shapes


def test_the_sweep_covers_the_issue_grid():
    shapes = sweep_shapes()
    assert {s.cache_size for s in shapes} == {1024, 4096, 8192, 16384, 32768}
    assert {s.tokens for s in shapes} == {1, 8, 32} and {s.batch for s in shapes} == {1, 8, 32, 64}
    assert Shape(2, 8, 1024).kv_bytes == 2 * 2 * 1024 * 8 * 128 * 2  # K and V, bf16, Llama-3-8B KV heads


def test_published_bandwidth_by_device_kind():
    assert peak_bandwidth(types.SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3")) == 3.35e12
    assert peak_bandwidth(types.SimpleNamespace(device_kind="cpu")) is None


def test_a_row_reports_every_column_against_the_copy_bandwidth(monkeypatch):
    monkeypatch.setattr(kernel_sweep, "copy_bandwidth", lambda nbytes, iters: 1e9)
    lines = []
    # head_dim 64 and 72 slots: the Mosaic GPU forms run too (the dense one's second tile clamped to slots 8-71)
    report = run_kernel_sweep("interpret", iters=1, shapes=[Shape(1, 3, 72, 4, 2, 64)], echo=lines.append)
    (row,) = report["rows"]
    assert report["share"] == "copy" and report["hbm_bytes_per_second"] is None
    for name in kernel_sweep.COLUMNS:
        assert row[f"{name}_bytes_per_second"] == pytest.approx(row["kv_bytes"] / row[f"{name}_ms"] * 1e3)
        assert row[f"{name}_pct_copy"] == pytest.approx(100 * row[f"{name}_bytes_per_second"] / 1e9)
    assert all(row[f"max_abs_difference_{name}"] < 2e-2 for name in ("kernel", "dense", "mgpu", "mgpu_paged"))
    assert len(lines) == 3 and lines[-1].split()[:3] == ["1", "3", "72"]
