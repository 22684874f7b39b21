"""Per-device parameter bytes of the bundled target split over tp=4 (tests/jspec/test_sharded_params.py runs this
in a subprocess with 4 virtual CPU devices). Prints one JSON report."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import jax

import jspec
from jspec.sharding import make_mesh, named, param_specs
from models.checkpoint import load_llama
from models.checkpoint.store import read_hf_config, read_jspec_meta, write_jspec_dir


def device_bytes(tree) -> dict[str, int]:
    """Device -> bytes of the shards of ``tree``'s arrays it holds."""
    held: dict[str, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[str(shard.device)] = held.get(str(shard.device), 0) + shard.data.nbytes
    return held


def split_and_replicated(tree) -> tuple[int, int]:
    """(bytes of the arrays split over "model", bytes of the replicated ones), whole arrays."""
    split = replicated = 0
    for leaf in jax.tree.leaves(tree):
        if "model" in jax.tree.leaves(tuple(leaf.sharding.spec)):
            split += leaf.nbytes
        else:
            replicated += leaf.nbytes
    return split, replicated


def rewritten(directory: str, out: str) -> str:
    """The bundled target written again as jspec writes checkpoints now (orbax checkpoints of groups of leaves)."""
    _, params, dtype = load_llama(directory)
    os.makedirs(out)
    write_jspec_dir(out, read_hf_config(directory), jax.device_get(params), "llama", dtype, directory)
    return out


def main() -> dict:
    mesh = make_mesh(4, 1)
    directory = jspec.bundled_model()
    shardings = lambda config, abstract: named(mesh, param_specs(abstract, config, 4))  # noqa: E731
    _, restored, _ = load_llama(directory, "float32", shardings)
    tmp = tempfile.mkdtemp()
    try:
        per_leaf = rewritten(directory, os.path.join(tmp, "target"))
        _, restored_per_leaf, _ = load_llama(per_leaf, "float32", shardings)
        formats = [read_jspec_meta(directory)["format"], read_jspec_meta(per_leaf)["format"]]
    finally:
        shutil.rmtree(tmp)
    engine = jspec.SpecEngine.from_pretrained(directory, tensor_parallel_size=4)
    report = {"formats": formats}
    for name, tree in (("restored", restored), ("restored_per_leaf", restored_per_leaf), ("engine", engine.params)):
        report[name] = {"device_bytes": device_bytes(tree), "split_replicated": split_and_replicated(tree),
                        "single_device_leaves": sum(isinstance(leaf.sharding, jax.sharding.SingleDeviceSharding)
                                                    for leaf in jax.tree.leaves(tree)),
                        "total": int(sum(leaf.nbytes for leaf in jax.tree.leaves(tree)))}
    report["kv_heads"] = engine.setup.target.num_kv_heads
    report["k_proj_per_device"] = list(engine.params["layers_0"]["self_attn"]["k_proj"]["kernel"]
                                       .addressable_shards[0].data.shape)
    return report


if __name__ == "__main__":
    assert len(jax.devices()) == 4, jax.devices()
    print(json.dumps(main()))
