"""Checkpoint conversion: sharded input, dtype, tokenizer files, clear errors, nothing left behind on failure; the
params/ store: groups of leaves closed at a byte budget, drawn lazily, older per-leaf directories still loading."""

import json
import os
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec
from safetensors.numpy import load_file, save_file

from jspec.tools.demo_model import write_random_hf_checkpoint
from models.checkpoint import convert_hf_llama, load_llama, load_params, save_params
from models.checkpoint import store
from models.config import from_hf_config

SMALL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 40, "hidden_size": 16,
    "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    "rms_norm_eps": 1e-5, "eos_token_id": 2, "bos_token_id": 1,
}


@pytest.fixture
def hf_dir(tmp_path):
    return write_random_hf_checkpoint(str(tmp_path / "hf"), config=SMALL)


def test_sharded_checkpoint_from_transformers(hf_checkpoint, tmp_path):
    """save_pretrained with a small max_shard_size writes an index + shards; the result equals unsharded."""
    model, _, unsharded_dir = hf_checkpoint("qwen3")
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()
    convert_hf_llama(str(sharded), str(tmp_path / "out"), progress=False)
    _, a, _ = load_llama(str(tmp_path / "out"))
    _, b, _ = load_llama(unsharded_dir)
    flat_a, flat_b = jax_leaves(a), jax_leaves(b)
    assert len(flat_a) == len(flat_b)
    for x, y in zip(flat_a, flat_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def jax_leaves(tree):
    import jax
    return jax.tree.leaves(tree)


def test_bfloat16_conversion_and_tokenizer_copy(hf_dir, tmp_path):
    out = convert_hf_llama(hf_dir, str(tmp_path / "out"), dtype="bfloat16", progress=False)
    assert sorted(os.listdir(out)) == ["config.json", "jspec.json", "params", "tokenizer.json"]
    config, params, dtype = load_llama(out)
    assert dtype == "bfloat16"
    assert params["layers"]["self_attn"]["q_proj"]["kernel"].dtype == jnp.bfloat16
    hf = load_file(os.path.join(hf_dir, "model.safetensors"))
    np.testing.assert_allclose(np.asarray(params["layers"]["mlp"]["up_proj"]["kernel"][1], np.float32),
                               hf["model.layers.1.mlp.up_proj.weight"].T, rtol=1e-2)
    _, params32, _ = load_llama(out, dtype="float32")
    assert params32["norm"]["weight"].dtype == jnp.float32
    assert config == from_hf_config(SMALL)


def _break(hf_dir, edit):
    path = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.1.mlp.gate_proj.weight"), r"missing: \['layers/mlp/gate_proj/kernel \(layers \[1\]\)'\]"),
    (lambda t: t.update({"model.layers.0.self_attn.extra.weight": np.zeros(3, np.float32)}),
     r"unexpected: \['model.layers.0.self_attn.extra.weight'\]"),
    (lambda t: t.update({"model.norm.weight": np.zeros(7, np.float32)}), r"misshapen: \['model.norm.weight: got \(7,\)"),
])
def test_bad_tensors_are_listed_and_nothing_is_written(hf_dir, tmp_path, edit, message):
    _break(hf_dir, edit)
    dst = tmp_path / "out"
    with pytest.raises(ValueError, match=message):
        convert_hf_llama(hf_dir, str(dst), progress=False)
    assert not dst.exists()
    assert [p for p in os.listdir(tmp_path) if p.startswith(".out")] == []  # no temp dir left either


def test_missing_and_existing_paths(hf_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        convert_hf_llama(str(tmp_path / "nowhere"), str(tmp_path / "x"), progress=False)
    os.remove(os.path.join(hf_dir, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        convert_hf_llama(hf_dir, str(tmp_path / "x"), progress=False)
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="already exists"):
        convert_hf_llama(hf_dir, str(tmp_path / "taken"), progress=False)


def test_missing_shard_named(hf_checkpoint, tmp_path):
    model, _, _ = hf_checkpoint("llama")
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    os.remove(sharded / victim)
    with pytest.raises(FileNotFoundError, match=victim):
        convert_hf_llama(str(sharded), str(tmp_path / "out"), progress=False)


# Leaves of 20, 40, 12, 204, 28, 60 and 4 bytes; at a 64-byte budget the open group closes before a leaf that would
# take it past 64 bytes, and the 204-byte leaf, bigger than the budget, is a group of its own.
BUDGET = 64
TREE = {"embed": np.arange(5, dtype=np.float32), "layers": {"kernel": np.linspace(-1, 1, 10, dtype=np.float32),
                                                            "bias": np.arange(3, dtype=np.int32) - 1,
                                                            "big": np.arange(51, dtype=np.float32).reshape(3, 17)},
        "norm": np.full(7, 0.5, np.float32), "head": np.arange(15, dtype=np.float32).reshape(3, 5),
        "d2t": np.array([9], np.int32)}
TREE_GROUPS = [[0, 1], [2], [3], [4], [5, 6]]  # in flatten order: embed, kernel, bias, big, norm, head, d2t


def abstract_of(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def one_device_shardings(abstract):
    """A NamedSharding per leaf on a one-device mesh, its spec naming the mesh axis where the leaf has a dim."""
    mesh = jax.sharding.Mesh(np.array(jax.local_devices()[:1]), ("model",))
    return jax.tree.map(lambda a: NamedSharding(mesh, PartitionSpec(*[None] * (a.ndim - 1), "model")
                                                if a.ndim else PartitionSpec()), abstract)


def assert_loads_back(directory, tree):
    """``tree`` restored from ``directory``, leaf for leaf, each on the sharding asked for, and with none given."""
    abstract = abstract_of(tree)
    restored = load_params(directory, abstract, one_device_shardings)
    jax.tree.map(np.testing.assert_array_equal, restored, tree)
    for leaf, sharding in zip(jax.tree.leaves(restored), jax.tree.leaves(one_device_shardings(abstract))):
        assert leaf.sharding == sharding, (leaf.sharding, sharding)
    unplaced = load_params(directory, abstract)
    jax.tree.map(np.testing.assert_array_equal, unplaced, tree)
    assert {leaf.sharding for leaf in jax.tree.leaves(unplaced)} == {
        jax.sharding.SingleDeviceSharding(jax.local_devices()[0])}


def test_leaves_are_written_in_groups_closed_at_the_byte_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "GROUP_BYTES", BUDGET)
    directory = str(tmp_path / "params")
    save_params(directory, TREE)
    listing = json.loads((tmp_path / "params" / "leaves.json").read_text())
    assert listing["leaves"] == [list(path) for path in traverse_util.flatten_dict(TREE)]
    assert listing["groups"] == TREE_GROUPS
    assert sorted(os.listdir(directory)) == ["group-0", "group-1", "group-2", "group-3", "group-4", "leaves.json"]
    assert_loads_back(directory, TREE)


def test_a_small_tree_is_one_checkpoint(tmp_path):
    save_params(str(tmp_path / "params"), TREE)
    assert sorted(os.listdir(tmp_path / "params")) == ["group-0", "leaves.json"]
    assert json.loads((tmp_path / "params" / "leaves.json").read_text())["groups"] == [list(range(7))]
    assert_loads_back(str(tmp_path / "params"), TREE)


def test_an_iterator_is_drawn_one_leaf_at_a_time_and_only_the_open_group_is_held(tmp_path, monkeypatch):
    """Before each leaf is drawn, the arrays still alive are exactly those of the open group: drawing ahead, or
    holding a written group's arrays, changes the counts."""
    monkeypatch.setattr(store, "GROUP_BYTES", 3 * 28)
    alive_at_draw, refs = [], []

    def leaves():
        for index in range(8):
            alive_at_draw.append(sum(ref() is not None for ref in refs))
            array = np.full(7, index, np.float32)  # 28 bytes: a group closes at its third leaf
            refs.append(weakref.ref(array))
            yield (f"w{index}",), array
            del array

    save_params(str(tmp_path / "params"), leaves())
    assert alive_at_draw == [0, 1, 2, 0, 1, 2, 0, 1]
    assert all(ref() is None for ref in refs)
    assert json.loads((tmp_path / "params" / "leaves.json").read_text())["groups"] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert_loads_back(str(tmp_path / "params"), {f"w{index}": np.full(7, index, np.float32) for index in range(8)})


@pytest.mark.parametrize("leaves, message", [
    ([(("a", "b"), np.zeros(2)), (("c",), np.zeros(1)), (("a", "b"), np.zeros(2))], "param a/b given twice"),
    ([(("a.b",), np.zeros(2))], r"keys must not contain '\.' or '/'"),
    ([(("a", "b/c"), np.zeros(2))], r"keys must not contain '\.' or '/'"),
])
def test_bad_paths_are_named(tmp_path, leaves, message):
    with pytest.raises(ValueError, match=message):
        save_params(str(tmp_path / "params"), iter(leaves))


def test_format_2_per_leaf_directories_still_load(tmp_path):
    import orbax.checkpoint as ocp

    directory = tmp_path / "params"
    directory.mkdir()
    flat = traverse_util.flatten_dict(TREE)
    with ocp.StandardCheckpointer() as checkpointer:  # how format 2 wrote params/: one orbax checkpoint per leaf
        for path, array in flat.items():
            checkpointer.save(str(directory / ".".join(path)), traverse_util.unflatten_dict({path: array}))
    (directory / "leaves.json").write_text(json.dumps({"leaves": [list(path) for path in flat]}))
    assert_loads_back(str(directory), TREE)
