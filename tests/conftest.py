"""Shared pytest setup: float32 matmuls at full precision and the `gpu` marker."""

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
