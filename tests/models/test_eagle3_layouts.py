"""One EAGLE-3 head, many files: the same weights written in each writer's layout (EAGLE's pytorch_model.bin,
SpecForge, speculators, ModelOpt) convert to heads that draft exactly as the original; the layer ids are honoured
in each writer's convention; fields jspec does not implement are refused by name, leaving nothing behind."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from safetensors.torch import save_file

import jspec
from jspec.drafters.eagle3 import Eagle3Drafter
from models.checkpoint import convert_hf_eagle3, load_eagle3, write_hf_eagle3
from tests.spec_fixtures import HEAD, MAX_SEQ_LEN, SPECS, TARGET, distilled_head, near_bigram_target

LAYER = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 64, "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
         "model_type": "llama", "torch_dtype": "float32"}
SPECFORGE = dict(LAYER, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=64, rope_theta=10000.0)
PROMPTS = [[1, 5, 9, 3], [7, 7, 2], [30, 12, 41, 8, 19]]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(target params, original head params, its HF tensors by canonical name, work dir)."""
    params_t = near_bigram_target()
    params_d = distilled_head(params_t)  # test_spec_engine's head: distilled once per session
    work = tmp_path_factory.mktemp("layouts")
    write_hf_eagle3(work / "canonical", SPECFORGE, params_d["head"], params_d["d2t"])
    tensors = load_file(str(work / "canonical" / "model.safetensors"))
    return params_t, params_d, tensors, work


def _write(directory, config: dict, tensors: dict[str, np.ndarray], rename=lambda n: n, bin_file=False):
    os.makedirs(directory)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    named = {rename(k): torch.from_numpy(np.array(v)) for k, v in tensors.items()}
    if bin_file:
        torch.save(named, os.path.join(directory, "pytorch_model.bin"))
    else:
        save_file(named, os.path.join(directory, "model.safetensors"))
    return str(directory)


def _layers0(name: str) -> str:
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def eagle_dir(work, tensors):
    """EAGLE's own: LlamaForCausalLM, pytorch_model.bin, no rope_theta, d2t and t2d, no embed_tokens."""
    t2d = np.zeros(64, bool)
    config = dict(LAYER, architectures=["LlamaForCausalLM"], draft_vocab_size=64, tie_word_embeddings=False,
                  hidden_act="silu")
    return _write(work / "eagle", config, dict(tensors, t2d=t2d), bin_file=True)


def specforge_dir(work, tensors, ids=(1, 1, 0), name="specforge", **extra):
    config = dict(SPECFORGE, eagle_config={"eagle_aux_hidden_state_layer_ids": list(ids)}, **extra)
    return _write(work / name, config, tensors)


def speculators_dir(work, tensors, params_t, ids=(2, 2, 1), name="speculators", **extra):
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
              "transformer_layer_config": dict(LAYER, rope_theta=10000.0), "draft_vocab_size": 64,
              "target_hidden_size": 32, "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": list(ids),
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}]}}
    config.update(extra)
    embed = np.asarray(params_t["embed_tokens"]["embedding"])
    return _write(work / name, config, dict(tensors, **{"embed_tokens.weight": embed}), _layers0)


def modelopt_dir(work, tensors, name="modelopt", **flags):
    eagle_config = {"use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True,
                    "use_last_layernorm": True, "use_mtp_layernorm": False, "parallel_draft_step": 1,
                    "eagle_aux_hidden_state_layer_ids": [1, 1, 0]}
    eagle_config.update(flags)
    return _write(work / name, dict(SPECFORGE, eagle_config=eagle_config), tensors, _layers0)


def _engine(params_t, head, params_d):
    drafter = Eagle3Drafter(head, TARGET, SPECS["chain"], MAX_SEQ_LEN)
    return jspec.SpecEngine(TARGET, params_t, drafter=drafter, drafter_params=params_d, max_batch_size=4,
                            max_seq_len=MAX_SEQ_LEN)


def _run(engine, params_d):
    engine.drafter_params = params_d  # same shapes: the compiled program is reused
    out = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    return out.token_ids, out.stats.acceptance_length, out.stats.accepted_per_position


@pytest.fixture(scope="module")
def reference(setup):
    """The original head's (tokens, acceptance, per-position acceptance), through the fixture's drafter config."""
    params_t, params_d, _, _ = setup
    return _run(_engine(params_t, HEAD, params_d), params_d)


def test_every_layout_converts_to_the_same_head(setup, reference):
    params_t, params_d, tensors, work = setup
    assert reference[1] > 1.2  # the distilled head is accepted: the comparison means something
    sources = {"eagle": eagle_dir(work, tensors), "specforge": specforge_dir(work, tensors),
               "speculators": speculators_dir(work, tensors, params_t), "modelopt": modelopt_dir(work, tensors)}
    engines = {}
    for layout, src in sources.items():
        dst = convert_hf_eagle3(src, work / f"{layout}-out", progress=False)
        config, head, d2t, _ = load_eagle3(dst)
        assert config.target_taps(TARGET) == (2, 2, 1), layout  # = the default rule for 4 layers
        with open(os.path.join(dst, "config.json")) as f:
            recorded = json.load(f)["jspec_eagle3"]
        assert recorded["layout"] == layout
        assert recorded["suggested_num_steps"] == (3 if layout == "speculators" else None)
        for got, want in zip(jax.tree.leaves(head), jax.tree.leaves(params_d["head"]), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        # Recorded taps equal to the default rule draft as the rule does: one compiled engine serves every layout.
        config = dataclasses.replace(config, taps=None) if config.taps == HEAD.tap_layers(TARGET) else config
        if config not in engines:
            engines[config] = _engine(params_t, config, {"head": head, "d2t": d2t})
        assert _run(engines[config], {"head": head, "d2t": d2t}) == reference, layout
    assert len(engines) == 1


# slow: a SpecForge head's layer ids move the taps (lossless, drafts differ); default tier:
# test_every_layout_converts_to_the_same_head (each layout's ids read into the same taps)
@pytest.mark.slow
def test_layer_ids_are_honoured(setup, reference):
    params_t, params_d, tensors, work = setup
    plain = jspec.SpecEngine(TARGET, params_t, max_batch_size=4, max_seq_len=MAX_SEQ_LEN)
    expected = plain.generate(PROMPTS, max_new_tokens=NEW_TOKENS).token_ids
    dst = convert_hf_eagle3(specforge_dir(work, tensors, ids=(0, 1, 2), name="moved"), work / "moved-out",
                            progress=False)
    config, head, d2t, _ = load_eagle3(dst)
    assert config.taps == (1, 2, 3)
    moved = _run(_engine(params_t, config, {"head": head, "d2t": d2t}), {"head": head, "d2t": d2t})
    assert moved[0] == reference[0] == expected  # lossless either way
    assert moved[1:] != reference[1:]  # but the drafts differ


def test_a_last_layer_output_tap_is_refused_at_load(setup):
    """SpecForge id L-1 (the last layer's output) is HF hidden_states[L], after the final norm in HF: no layer's
    input, so the target cannot tap it; the converter records it and the target check refuses it."""
    _, _, tensors, work = setup
    dst = convert_hf_eagle3(specforge_dir(work, tensors, ids=(1, 1, 3), name="last"), work / "last-out",
                            progress=False)
    config, _, _, _ = load_eagle3(dst)
    with pytest.raises(ValueError, match=r"\[4\] is not the input of a layer.*after the final norm"):
        Eagle3Drafter(config, TARGET, SPECS["chain"], MAX_SEQ_LEN)


@pytest.mark.parametrize("make, field", [
    (lambda w, t, p: modelopt_dir(w, t, "bad", parallel_draft_step=2), "parallel_draft_step"),
    (lambda w, t, p: modelopt_dir(w, t, "bad", use_mtp_layernorm=True), "use_mtp_layernorm"),
    (lambda w, t, p: modelopt_dir(w, t, "bad", use_aux_hidden_state=False), "use_aux_hidden_state"),
    (lambda w, t, p: modelopt_dir(w, t, "bad", use_last_layernorm=False), "use_last_layernorm"),
    (lambda w, t, p: specforge_dir(w, t, name="bad", norm_before_fc=True), "norm_before_fc"),
    (lambda w, t, p: speculators_dir(w, t, p, name="bad", norm_before_residual=True), "norm_before_residual"),
    (lambda w, t, p: speculators_dir(w, t, p, name="bad", norm_before_residual=None), "norm_before_residual"),
    (lambda w, t, p: specforge_dir(w, dict(t, **{"fc.bias": np.zeros(32, np.float32)}), name="bad"), "fc.bias"),
    (lambda w, t, p: specforge_dir(w, dict(t, **{"midlayer.extra.weight": np.zeros(3, np.float32)}), name="bad"),
     "midlayer.extra.weight"),
    (lambda w, t, p: specforge_dir(w, dict(t, **{"embed_tokens.weight": np.zeros((5, 32), np.float32)}),
                                   name="bad"), "embed_tokens.weight"),
    (lambda w, t, p: specforge_dir(w, t, ids=(1, 2), name="bad"), "eagle_aux_hidden_state_layer_ids"),
])
def test_unsupported_fields_are_refused_by_name(setup, tmp_path, make, field):
    params_t, _, tensors, _ = setup
    src = make(tmp_path, tensors, params_t)
    with pytest.raises(ValueError, match=field):
        convert_hf_eagle3(src, tmp_path / "out", progress=False)
    assert not os.path.exists(tmp_path / "out")


class _Payload:
    """Unpickling this would create a directory: a stand-in for code a crafted checkpoint runs."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.makedirs, (self.marker,)


def test_a_pickle_with_an_object_is_refused(setup, tmp_path):
    _, _, tensors, _ = setup
    src = eagle_dir(tmp_path, tensors)
    state = {k: torch.from_numpy(np.array(v)) for k, v in tensors.items()}
    marker = str(tmp_path / "ran")
    torch.save(dict(state, payload=_Payload(marker)), os.path.join(src, "pytorch_model.bin"))
    with pytest.raises(ValueError, match="refused to load.*unsupported GLOBAL os.makedirs"):
        convert_hf_eagle3(src, tmp_path / "out", progress=False)
    assert not os.path.exists(marker) and not os.path.exists(tmp_path / "out")


def test_the_bin_layout_says_pip_install_torch_without_torch(setup, tmp_path, monkeypatch):
    import builtins

    _, _, tensors, _ = setup
    src = eagle_dir(tmp_path, tensors)
    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("no torch")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    with pytest.raises(ValueError, match="pip install torch"):
        convert_hf_eagle3(src, tmp_path / "out", progress=False)
    assert not os.path.exists(tmp_path / "out")


def test_recorded_taps_and_the_default_for_old_converted_dirs():
    from models.eagle3 import eagle3_config_from_hf

    old = eagle3_config_from_hf(SPECFORGE)  # converted before jspec_eagle3 existed: the default rule
    assert old.taps is None and old.target_taps(TARGET) == (2, 2, 1)
    recorded = eagle3_config_from_hf(dict(SPECFORGE, jspec_eagle3={"tap_layers": [0, 3, 1]}))
    assert recorded.target_taps(TARGET) == (0, 3, 1)
    recorded.check_target(TARGET)
    for bad in ([1, 2], [1, -1, 2], "0,1,2"):
        with pytest.raises(ValueError, match="jspec_eagle3.tap_layers"):
            eagle3_config_from_hf(dict(SPECFORGE, jspec_eagle3={"tap_layers": bad}))
