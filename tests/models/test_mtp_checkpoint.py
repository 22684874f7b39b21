"""MTP modules inside a target checkpoint (MiMo's ``model.mtp_layers.*``, DeepSeek's ``model.layers.{L + k}.*``):
written in HF layout with the exact HF names, converted beside the target into ``mtp/``, loaded back unchanged;
bad module tensors are refused by name with nothing written."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jspec.tools.cli import main
from models.checkpoint import (convert_hf_checkpoint, convert_hf_llama, has_mtp, load_llama, load_mtp,
                               write_hf_llama)
from models.checkpoint import hf_mtp
from models.checkpoint.hf_llama import llama_param_path
from models.checkpoint.mtp_layouts import abstract_module
from models.config import from_hf_config
from models.llama import param_shapes
from models.mtp import MtpConfig

SIZES = {"vocab_size": 40, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "rms_norm_eps": 1e-5, "eos_token_id": 2,
         "bos_token_id": 1}
TARGETS = {
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **SIZES},
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **SIZES},
    "qwen3-tied": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 8,
                   "tie_word_embeddings": True, **SIZES},
}
# (layout, target): MiMo is a Qwen2 target; DeepSeek's structure on an untied Llama and a tied Qwen3 (q/k norms).
CASES = [("mimo", "qwen2"), ("deepseek", "llama"), ("deepseek", "qwen3-tied")]
H, V, L = SIZES["hidden_size"], SIZES["vocab_size"], SIZES["num_hidden_layers"]

# Module 0's tensors, by the HF names of each layout (vLLM's mimo_mtp.py / deepseek_mtp.py), with HF shapes.
BLOCK = {"input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
         "self_attn.q_proj.weight": (16, H), "self_attn.k_proj.weight": (8, H), "self_attn.v_proj.weight": (8, H),
         "self_attn.o_proj.weight": (H, 16), "mlp.gate_proj.weight": (24, H), "mlp.up_proj.weight": (24, H),
         "mlp.down_proj.weight": (H, 24)}
MIMO_MODULE_0 = {**{f"model.mtp_layers.0.{name}": shape for name, shape in BLOCK.items()},
                 "model.mtp_layers.0.self_attn.q_proj.bias": (16,), "model.mtp_layers.0.self_attn.k_proj.bias": (8,),
                 "model.mtp_layers.0.self_attn.v_proj.bias": (8,), "model.mtp_layers.0.token_layernorm.weight": (H,),
                 "model.mtp_layers.0.hidden_layernorm.weight": (H,), "model.mtp_layers.0.input_proj.weight": (H, 2 * H),
                 "model.mtp_layers.0.final_layernorm.weight": (H,)}
DEEPSEEK_MODULE_0 = {**{f"model.layers.{L}.{name}": shape for name, shape in BLOCK.items()},
                     f"model.layers.{L}.enorm.weight": (H,), f"model.layers.{L}.hnorm.weight": (H,),
                     f"model.layers.{L}.eh_proj.weight": (H, 2 * H), f"model.layers.{L}.shared_head.norm.weight": (H,),
                     f"model.layers.{L}.shared_head.head.weight": (V, H), f"model.layers.{L}.embed_tokens.weight": (V, H)}


def random_tree(abstract, seed):
    """float32 numpy arrays of ``abstract``'s shapes, every leaf distinct (so a swapped tensor shows)."""
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree.flatten(abstract)
    return jax.tree.unflatten(treedef, [rng.normal(0.0, 0.5, leaf.shape).astype(np.float32) for leaf in leaves])


def make_target(target):
    hf_config = TARGETS[target]
    config = from_hf_config(hf_config)
    return hf_config, config, random_tree(param_shapes(config), 1)


def make_modules(config, num_modules, own_lm_head=()):
    layer = MtpConfig.for_target(config, num_modules).layer
    return {"modules": tuple(random_tree(abstract_module(layer, jnp.float32, index in own_lm_head), 10 + index)
                             for index in range(num_modules))}


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for path, x in jax.tree_util.tree_leaves_with_path(a):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(_at(b, path)), err_msg=jax.tree_util.keystr(path))


def _at(tree, path):
    for key in path:
        tree = tree[key.key if hasattr(key, "key") else key.idx]
    return tree


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(layout, target) -> (HF dir with 2 modules, target params, module params), written once."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for layout, target in CASES:
        hf_config, config, params = make_target(target)
        modules = make_modules(config, 2)
        hf_dir = write_hf_llama(str(root / f"{layout}-{target}"), hf_config, params, mtp_params=modules,
                                mtp_layout=layout)
        out[layout, target] = hf_dir, params, modules
    return out


def copy_source(written, case, tmp_path):
    import shutil
    return shutil.copytree(written[case][0], tmp_path / "hf")


def edit_tensors(hf_dir, edit):
    path = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def edit_config(hf_dir, edit):
    path = os.path.join(hf_dir, "config.json")
    config = json.loads(open(path).read())
    edit(config)
    with open(path, "w") as f:
        json.dump(config, f)


def assert_nothing_written(tmp_path):
    assert not (tmp_path / "out").exists()
    assert [p for p in os.listdir(tmp_path) if p.startswith(".out")] == []


# --- config.json ---------------------------------------------------------------------------------------------

def test_mimo_config_is_a_qwen2_target():
    """MiMo-7B's config.json (its fields as shipped): Qwen2's q/k/v bias, no sliding window, the MTP count read
    by the converter and ignored by the target's config."""
    mimo_7b = {"architectures": ["MiMoForCausalLM"], "model_type": "mimo", "attention_dropout": 0.0,
               "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 4096,
               "intermediate_size": 11008, "max_position_embeddings": 32768, "max_window_layers": 36,
               "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
               "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 640000,
               "sliding_window": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
               "use_sliding_window": False, "vocab_size": 151680}
    config = from_hf_config(mimo_7b)
    qwen2 = from_hf_config(dict(mimo_7b, model_type="qwen2", architectures=["Qwen2ForCausalLM"]))
    assert config == dataclasses.replace(qwen2, model_type="mimo")
    assert (config.qkv_bias, config.o_bias, config.qk_norm, config.sliding_window) == (True, False, False, None)
    assert (config.num_layers, config.head_dim, config.rope_theta) == (36, 128, 640000.0)


def slow_cases(*slow: tuple[str, str]) -> list:
    """CASES with the (layout, target) pairs named here in the slow tier (each test using it names its default-tier
    stand-in)."""
    return [pytest.param(*case, marks=pytest.mark.slow) if case in slow else case for case in CASES]


# slow: [mimo-qwen2] (MiMo's MTP modules stored as the module's tree); default tier: [deepseek-llama]
@pytest.mark.parametrize("layout, target", slow_cases(("mimo", "qwen2")))
def test_the_stored_tree_is_the_module_s(layout, target):
    """What the converter writes and load_mtp reads has models.mtp.MtpModule's parameter names and shapes."""
    from models.mtp import init_mtp_params

    config = MtpConfig.for_target(from_hf_config(TARGETS[target]), 1, layout)
    module = init_mtp_params(config, jax.random.key(0))["modules"][0]
    shapes = lambda tree: jax.tree.map(lambda leaf: tuple(leaf.shape), tree)
    assert shapes(abstract_module(config.layer)) == shapes(module)


# --- HF names ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout, target", CASES[:2])
def test_replica_has_the_hf_names(written, tmp_path, layout, target):
    hf_dir, params, modules = written[layout, target]
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    module_0 = MIMO_MODULE_0 if layout == "mimo" else DEEPSEEK_MODULE_0
    prefix = "model.mtp_layers.0." if layout == "mimo" else f"model.layers.{L}."
    assert {name: tensors[name].shape for name in tensors if name.startswith(prefix)} == module_0
    # module 1 has the same names; the target's own tensors are all still there
    prefix_1 = "model.mtp_layers.1." if layout == "mimo" else f"model.layers.{L + 1}."
    assert sum(name.startswith(prefix_1) for name in tensors) == len(module_0)
    target_names = [name for name in tensors if not name.startswith((prefix, prefix_1))]
    assert all(llama_param_path(name) is not None and (llama_param_path(name)[1] or 0) < L for name in target_names)
    assert len(target_names) == len(load_file(os.path.join(write_hf_llama(
        str(tmp_path / "plain"), TARGETS[target], params), "model.safetensors")))
    config = json.loads(open(os.path.join(hf_dir, "config.json")).read())
    assert config["num_nextn_predict_layers"] == 2
    if layout == "mimo":
        assert (config["architectures"], config["model_type"]) == (["MiMoForCausalLM"], "mimo")
    # Linear weights are [out, in]: input_proj / eh_proj [H, 2H] = our kernel [2H, H] transposed
    proj = "input_proj" if layout == "mimo" else "eh_proj"
    np.testing.assert_array_equal(tensors[prefix_1 + f"{proj}.weight"], modules["modules"][1]["input_proj"]["kernel"].T)
    if layout == "deepseek":  # the copies DeepSeek-V3 ships
        np.testing.assert_array_equal(tensors[prefix + "embed_tokens.weight"], tensors["model.embed_tokens.weight"])
        np.testing.assert_array_equal(tensors[prefix + "shared_head.head.weight"], tensors["lm_head.weight"])


# --- convert -> load ------------------------------------------------------------------------------------------

# slow: [deepseek-qwen3-tied] (DeepSeek MTP modules on a tied Qwen3 convert and load back); default tier:
# [deepseek-llama], [mimo-qwen2]
@pytest.mark.parametrize("layout, target", slow_cases(("deepseek", "qwen3-tied")))
def test_convert_then_load_gives_the_modules_back(written, tmp_path, layout, target):
    hf_dir, params, modules = written[layout, target]
    out = convert_hf_checkpoint(hf_dir, str(tmp_path / "out"), progress=False)
    assert has_mtp(out)
    config, loaded = load_mtp(out)
    target_config = from_hf_config(TARGETS[target])
    if layout == "mimo":
        target_config = dataclasses.replace(target_config, model_type="mimo")
    assert config == MtpConfig.for_target(target_config, 2, layout)
    assert_trees_equal(loaded, modules)  # no lm_head: DeepSeek's shared_head.head copies were the target's
    # checked against the HF file itself, not only the round trip: kernel = weight.T, biases as they are
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    prefix = "model.mtp_layers.1." if layout == "mimo" else f"model.layers.{L + 1}."
    block = loaded["modules"][1]["block"]
    np.testing.assert_array_equal(block["self_attn"]["q_proj"]["kernel"], tensors[prefix + "self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(block["mlp"]["down_proj"]["kernel"], tensors[prefix + "mlp.down_proj.weight"].T)
    norm = "hidden_layernorm" if layout == "mimo" else "hnorm"
    np.testing.assert_array_equal(loaded["modules"][1]["hidden_norm"]["weight"], tensors[prefix + f"{norm}.weight"])
    if layout == "mimo":
        np.testing.assert_array_equal(block["self_attn"]["v_proj"]["bias"], tensors[prefix + "self_attn.v_proj.bias"])


# slow: [deepseek-qwen3-tied], [mimo-qwen2] (a tied Qwen3 target, a MiMo target with MTP modules convert as without
# them); default tier: [deepseek-llama]
@pytest.mark.parametrize("layout, target", slow_cases(("deepseek", "qwen3-tied"), ("mimo", "qwen2")))
def test_the_target_converts_as_without_modules(written, tmp_path, layout, target):
    hf_dir, params, _ = written[layout, target]
    hf_config, _, _ = make_target(target)
    plain = write_hf_llama(str(tmp_path / "plain"), hf_config, params)
    config, loaded, _ = load_llama(convert_hf_llama(hf_dir, str(tmp_path / "out"), progress=False))
    plain_config, plain_params, _ = load_llama(convert_hf_llama(plain, str(tmp_path / "plain-out"), progress=False))
    assert_trees_equal(loaded, plain_params)
    assert config == (dataclasses.replace(plain_config, model_type="mimo") if layout == "mimo" else plain_config)
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "jspec.json", "mtp", "params"]
    assert not has_mtp(str(tmp_path / "plain-out"))


def test_bfloat16_conversion_and_cast_on_load(written, tmp_path):
    hf_dir, _, modules = written["mimo", "qwen2"]
    out = convert_hf_llama(hf_dir, str(tmp_path / "out"), dtype="bfloat16", progress=False)
    _, stored = load_mtp(out)
    kernel = stored["modules"][0]["input_proj"]["kernel"]
    assert kernel.dtype == jnp.bfloat16
    np.testing.assert_array_equal(kernel, modules["modules"][0]["input_proj"]["kernel"].astype(jnp.bfloat16))
    _, cast = load_mtp(out, dtype="float32")
    assert {leaf.dtype for leaf in jax.tree.leaves(cast)} == {jnp.dtype(jnp.float32)}
    np.testing.assert_array_equal(cast["modules"][0]["input_proj"]["kernel"], kernel.astype(jnp.float32))


@pytest.mark.parametrize("target", ["llama", "qwen3-tied"])
def test_a_differing_deepseek_head_is_kept(tmp_path, target):
    """Module 1 has an lm_head of its own (shared_head.head differs from the target's); module 0's is a copy."""
    hf_config, config, params = make_target(target)
    modules = make_modules(config, 2, own_lm_head=(1,))
    hf_dir = write_hf_llama(str(tmp_path / "hf"), hf_config, params, mtp_params=modules, mtp_layout="deepseek")
    head = load_file(os.path.join(hf_dir, "model.safetensors"))[f"model.layers.{L + 1}.shared_head.head.weight"]
    np.testing.assert_array_equal(head, modules["modules"][1]["lm_head"]["kernel"].T)
    _, loaded = load_mtp(convert_hf_llama(hf_dir, str(tmp_path / "out"), progress=False))
    assert "lm_head" not in loaded["modules"][0]
    assert_trees_equal(loaded, modules)


def test_deepseek_modules_without_the_copies(written, tmp_path):
    """A writer that leaves out embed_tokens and shared_head.head: the modules use the target's."""
    hf_dir = copy_source(written, ("deepseek", "llama"), tmp_path)
    edit_tensors(hf_dir, lambda t: [t.pop(name) for name in list(t) if name.endswith(("embed_tokens.weight",
                                                                                       "shared_head.head.weight"))
                                    and name.startswith("model.layers.")])
    _, loaded = load_mtp(convert_hf_llama(str(hf_dir), str(tmp_path / "out"), progress=False))
    assert_trees_equal(loaded, written["deepseek", "llama"][2])


def test_num_nextn_predict_layers_without_tensors_converts_the_target_alone(tmp_path):
    hf_config, _, params = make_target("qwen2")
    hf_dir = write_hf_llama(str(tmp_path / "hf"), dict(hf_config, num_nextn_predict_layers=1), params)
    out = convert_hf_llama(hf_dir, str(tmp_path / "out"), progress=False)
    assert not has_mtp(out) and not os.path.exists(os.path.join(out, "mtp"))
    with pytest.raises(FileNotFoundError, match="has no MTP modules"):
        load_mtp(out)


def test_jspec_convert_picks_the_modules_up(written, tmp_path, capsys):
    hf_dir, _, modules = written["deepseek", "llama"]
    assert main(["convert", "--src", hf_dir, "--dst", str(tmp_path / "out")]) == 0
    assert has_mtp(str(tmp_path / "out"))
    assert_trees_equal(load_mtp(str(tmp_path / "out"))[1], modules)


# --- refused, nothing written --------------------------------------------------------------------------------

@pytest.mark.parametrize("case, edit, message", [
    (("mimo", "qwen2"), lambda t: t.pop("model.mtp_layers.1.hidden_layernorm.weight"),
     r"missing: \['model.mtp_layers.1.hidden_layernorm.weight'\]"),
    (("mimo", "qwen2"), lambda t: t.pop("model.mtp_layers.0.self_attn.k_proj.bias"),
     r"missing: \['model.mtp_layers.0.self_attn.k_proj.bias'\]"),
    (("deepseek", "llama"), lambda t: t.update({f"model.layers.{L}.eh_proj.weight": np.zeros((H, H), np.float32)}),
     rf"misshapen: \['model.layers.{L}.eh_proj.weight: got \(16, 16\), expected \(16, 32\)'\]"),
    (("mimo", "qwen2"), lambda t: t.update({"model.mtp_layers.0.mtp_block.extra.weight": np.zeros(3, np.float32)}),
     r"unexpected: \['model.mtp_layers.0.mtp_block.extra.weight'\]"),
    (("mimo", "qwen2"), lambda t: t.update({"model.mtp_layers.2.token_layernorm.weight": np.zeros(H, np.float32)}),
     r"num_nextn_predict_layers=2.*unexpected: \['model.mtp_layers.2.token_layernorm.weight'\]"),
    (("deepseek", "llama"), lambda t: t.update({f"model.layers.{L + 1}.embed_tokens.weight": np.ones((V, H), np.float32)}),
     rf"model.layers.{L + 1}.embed_tokens.weight differs from the target's model.embed_tokens.weight"),
    (("deepseek", "llama"), lambda t: t.update({f"model.layers.{L}.embed_tokens.weight": np.ones((V, 3), np.float32)}),
     rf"model.layers.{L}.embed_tokens.weight: got \(40, 3\), expected \(40, 16\)"),
    (("deepseek", "llama"), lambda t: t.update({f"model.layers.{L}.shared_head.head.weight": np.ones((V, 3), np.float32)}),
     rf"misshapen: \['model.layers.{L}.shared_head.head.weight: got \(40, 3\), expected \(40, 16\)'\]"),
    (("mimo", "qwen2"), lambda t: t.update({f"model.layers.{L}.enorm.weight": np.zeros(H, np.float32)}),
     r"mixes MTP layouts \['deepseek', 'mimo'\]"),
])
def test_bad_module_tensors_are_named_and_nothing_is_written(written, tmp_path, case, edit, message):
    hf_dir = copy_source(written, case, tmp_path)
    edit_tensors(hf_dir, edit)
    with pytest.raises(ValueError, match=message):
        convert_hf_checkpoint(str(hf_dir), str(tmp_path / "out"), progress=False)
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("value, message", [
    (None, r"MTP-module tensors .* but config.json num_nextn_predict_layers=None"),
    (0, r"num_nextn_predict_layers=0; expected the number of modules"),
    (1, r"num_nextn_predict_layers=1, mimo layout\); unexpected: \['model.mtp_layers.1."),
    (3, r"missing: \['model.mtp_layers.2."),
    ("1", r"num_nextn_predict_layers='1': expected an integer >= 0"),
])
def test_num_nextn_predict_layers_must_match_the_tensors(written, tmp_path, value, message):
    hf_dir = copy_source(written, ("mimo", "qwen2"), tmp_path)
    edit_config(hf_dir, lambda c: c.pop("num_nextn_predict_layers") if value is None
                else c.update(num_nextn_predict_layers=value))
    with pytest.raises(ValueError, match=message):
        convert_hf_checkpoint(str(hf_dir), str(tmp_path / "out"), progress=False)
    assert_nothing_written(tmp_path)


def test_a_failure_while_writing_the_modules_leaves_nothing(written, tmp_path, monkeypatch):
    """The modules are written in the target's atomic write: the target is complete by then, and still removed."""
    read = hf_mtp.read_tensor

    def failing_read(file, name, out=None):
        if name.startswith("model.mtp_layers.1."):
            raise OSError(f"disk gone while reading {name}")
        return read(file, name, out)

    monkeypatch.setattr(hf_mtp, "read_tensor", failing_read)
    with pytest.raises(OSError, match="disk gone"):
        convert_hf_llama(written["mimo", "qwen2"][0], str(tmp_path / "out"), progress=False)
    assert_nothing_written(tmp_path)


def test_writer_refuses_what_a_layout_cannot_hold(tmp_path):
    hf_config, config, params = make_target("llama")
    with pytest.raises(ValueError, match=r"mtp_layout='mimo' writes a MiMo checkpoint.*got 'llama'"):
        write_hf_llama(str(tmp_path / "a"), hf_config, params, mtp_params=make_modules(config, 1))
    hf_config, config, params = make_target("qwen2")
    with pytest.raises(ValueError, match=r"MTP module 0 has an lm_head of its own"):
        write_hf_llama(str(tmp_path / "b"), hf_config, params, mtp_params=make_modules(config, 1, own_lm_head=(0,)))
    modules = make_modules(config, 1)
    del modules["modules"][0]["block"]["mlp"]
    with pytest.raises(ValueError, match=r"MTP module 0 params do not match.*block/mlp/up_proj/kernel"):
        write_hf_llama(str(tmp_path / "c"), hf_config, params, mtp_params=modules)
    assert not any((tmp_path / name).exists() for name in "abc")


def test_sharded_checkpoint_with_the_modules_in_their_own_shard(written, tmp_path):
    """As MiMo-7B ships: an index of shards, the MTP modules in the last one."""
    hf_dir, _, modules = written["mimo", "qwen2"]
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text(open(os.path.join(hf_dir, "config.json")).read())
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    shards = {"model-00001-of-00002.safetensors": {n: t for n, t in tensors.items() if "mtp_layers" not in n},
              "model-00002-of-00002.safetensors": {n: t for n, t in tensors.items() if "mtp_layers" in n}}
    for file, part in shards.items():
        save_file(part, str(sharded / file), metadata={"format": "pt"})
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {name: file for file, part in shards.items() for name in part}}))
    out = convert_hf_checkpoint(str(sharded), str(tmp_path / "out"), progress=False)
    assert_trees_equal(load_mtp(out)[1], modules)


# --- the converted modules drive the MTP drafter (jspec/drafters/mtp.py) --------------------------------------

def _mtp_registered() -> bool:
    from jspec.drafters import registry
    return "mtp" in registry.DRAFTERS


needs_mtp_drafter = pytest.mark.skipif(not _mtp_registered(), reason="no 'mtp' drafter registered")
PROMPTS = [[5, 9, 13], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


# slow: converted MiMo and DeepSeek MTP modules drive the engine losslessly; default tier: test_mtp's greedy = plain,
# the converters' round trips
@pytest.mark.slow
@needs_mtp_drafter
@pytest.mark.parametrize("layout, target, drafter, num_steps", [("mimo", "qwen2", "mtp", 3),
                                                                 ("deepseek", "llama", "mtp_vanilla", 2)])
def test_from_pretrained_with_the_converted_modules_is_lossless(tmp_path, layout, target, drafter, num_steps):
    """Greedy output of the converted target with its own modules drafting equals plain decoding (for any
    weights); DeepSeek's module 1 has an lm_head of its own."""
    import jspec

    hf_config, config, params = make_target(target)
    modules = make_modules(config, 2, own_lm_head=(1,) if layout == "deepseek" else ())
    hf_dir = write_hf_llama(str(tmp_path / "hf"), hf_config, params, mtp_params=modules, mtp_layout=layout)
    out = convert_hf_checkpoint(hf_dir, str(tmp_path / "out"), progress=False)
    kwargs = dict(max_batch_size=2, max_seq_len=64)
    plain = jspec.SpecEngine.from_pretrained(out, **kwargs).generate(PROMPTS, max_new_tokens=12).token_ids
    spec = jspec.SpecConfig(tree="chain", num_steps=num_steps)
    engine = jspec.SpecEngine.from_pretrained(out, drafter=drafter, spec=spec, **kwargs)
    assert engine.generate(PROMPTS, max_new_tokens=12).token_ids == plain


@needs_mtp_drafter
def test_mtp_drafter_on_a_target_without_modules_is_an_error(tmp_path):
    import jspec

    hf_config, _, params = make_target("qwen2")
    out = convert_hf_llama(write_hf_llama(str(tmp_path / "hf"), hf_config, params), str(tmp_path / "out"),
                           progress=False)
    with pytest.raises(ValueError, match=r"drafter='mtp'.*holds no MTP modules"):
        jspec.SpecEngine.from_pretrained(out, drafter="mtp", spec=jspec.SpecConfig(tree="chain", num_steps=2),
                                         max_batch_size=1, max_seq_len=64)
