"""Converting streams: a sharded 1.9 GB checkpoint converts in about two of its largest arrays of host memory.

The conversion runs in a fresh process (tests/models/convert_memory_probe.py) whose peak RSS (VmHWM) is compared
with that of a process that only imports the same modules and saves a tiny orbax checkpoint.
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from models.checkpoint import load_llama, load_params, save_params
from tests.models.convert_memory_probe import (SYNTHETIC_CONFIG, synthetic_tensor, synthetic_tensor_shapes,
                                               write_synthetic_checkpoint)

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "convert_memory_probe.py")


def probe_peak_rss(*args: str) -> int:
    """Peak RSS in bytes of ``convert_memory_probe.py args`` run in a fresh process."""
    result = subprocess.run([sys.executable, PROBE, *args], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])["peak_rss_bytes"]


# slow: conversion streams: peak memory about the largest array; default tier: the converters' equality tests
@pytest.mark.slow
def test_sharded_conversion_peak_memory_is_about_the_largest_array(tmp_path):
    src, dst = str(tmp_path / "hf"), str(tmp_path / "out")
    total = write_synthetic_checkpoint(src, SYNTHETIC_CONFIG, num_shards=4)
    shapes = synthetic_tensor_shapes(SYNTHETIC_CONFIG)
    layers = SYNTHETIC_CONFIG["num_hidden_layers"]
    largest = max(4 * int(np.prod(shape)) * (layers if ".layers." in name else 1) for name, shape in shapes.items())
    assert total >= 10**9 and len(os.listdir(src)) == 6  # config, index, 4 shards

    extra = probe_peak_rss("convert", src, dst) - probe_peak_rss("baseline")
    # One stacked parameter (gate_proj: f32[8, 2048, 5632], 369 MB) plus tensorstore's write buffers; the whole
    # model held at once (as before streaming) would be 2 x 1.9 GB.
    assert extra < 2.5 * largest, (extra, largest, total)
    assert extra < 0.5 * total, (extra, largest, total)

    config, params, dtype = load_llama(dst)
    assert dtype == "float32" and config.num_layers == layers
    np.testing.assert_array_equal(np.asarray(params["embed_tokens"]["embedding"]),
                                  synthetic_tensor("model.embed_tokens.weight", shapes["model.embed_tokens.weight"]))
    np.testing.assert_array_equal(np.asarray(params["lm_head"]["kernel"]),
                                  synthetic_tensor("lm_head.weight", shapes["lm_head.weight"]).T)
    for layer, module, leaf in [(3, "mlp", "gate_proj"), (7, "self_attn", "k_proj"), (0, "mlp", "down_proj")]:
        name = f"model.layers.{layer}.{module}.{leaf}.weight"
        np.testing.assert_array_equal(np.asarray(params["layers"][module][leaf]["kernel"][layer]),
                                      synthetic_tensor(name, shapes[name]).T)
    name = "model.layers.5.input_layernorm.weight"
    np.testing.assert_array_equal(np.asarray(params["layers"]["input_layernorm"]["weight"][5]),
                                  synthetic_tensor(name, shapes[name]))


def test_params_of_a_small_model_are_stored_as_one_group(tmp_path):
    params = {"a": {"kernel": np.arange(6, dtype=np.float32).reshape(2, 3)}, "b": np.ones(4, np.int32)}
    save_params(str(tmp_path / "params"), params)
    assert sorted(os.listdir(tmp_path / "params")) == ["group-0", "leaves.json"]
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    restored = load_params(str(tmp_path / "params"), abstract)
    jax.tree.map(np.testing.assert_array_equal, restored, params)
    with pytest.raises(ValueError, match=r"missing: \['c'\], unexpected: \[\]"):
        load_params(str(tmp_path / "params"), dict(abstract, c=jax.ShapeDtypeStruct((1,), np.float32)))


def test_format_1_single_tree_checkpoints_still_load(tmp_path):
    import orbax.checkpoint as ocp

    params = {"a": {"kernel": np.arange(6, dtype=np.float32).reshape(2, 3)}, "b": np.ones(4, np.int32)}
    with ocp.StandardCheckpointer() as checkpointer:  # how format 1 wrote params/: one orbax tree
        checkpointer.save(str(tmp_path / "params"), params)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    jax.tree.map(np.testing.assert_array_equal, load_params(str(tmp_path / "params"), abstract), params)
