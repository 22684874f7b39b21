"""Quantized checkpoints as users download them, written here with the publishers' tensor names and configs
(compressed-tensors int8 / fp8 / packed int4, ModelOpt FP8): they convert, run as a dequantize-then-run reference
(transformers on the dequantized weights) does, and load quantized again with their own scheme."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import jspec
from models.attention import KVCache
from models.checkpoint import convert_hf_checkpoint
from tests.hf_models import make_hf_model

LINEAR = (".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".o_proj.weight", ".gate_proj.weight",
          ".up_proj.weight", ".down_proj.weight")
GROUP = 16
TOKENS = [[1, 5, 9, 22, 7, 3, 64, 12, 30, 2]]


def compressed_tensors_config(fmt: str, bits: int, kind: str, strategy: str, group_size=None) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "ignore": ["lm_head"], "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": None, "output_activations": None,
                "weights": {"num_bits": bits, "type": kind, "strategy": strategy, "symmetric": True,
                            "group_size": group_size, "dynamic": False, "observer": "minmax"}}}}


def quantize(weight: torch.Tensor, fmt: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One Linear weight [out, in] -> (its tensors under the publisher's suffixes, the dequantized weight)."""
    w = weight.double()
    if fmt == "int8":
        scale = w.abs().amax(dim=1, keepdim=True) / 127
        q = torch.round(w / scale).to(torch.int8)
        return {"weight": q, "weight_scale": scale.float()}, q.double() * scale.float().double()
    if fmt in ("fp8", "modelopt"):
        scale = (w.abs().amax(dim=1, keepdim=True) if fmt == "fp8" else w.abs().max()) / 448
        q = (w / scale).to(torch.float8_e4m3fn)
        tensors = {"weight": q, "weight_scale": scale.float().reshape(-1, 1) if fmt == "fp8" else scale.float()}
        if fmt == "modelopt":
            tensors["input_scale"] = torch.tensor(0.05)  # static activation scale: dropped (weight-only)
        return tensors, q.double() * scale.float().double()
    groups = w.reshape(w.shape[0], -1, GROUP)
    scale = groups.abs().amax(dim=2) / 7
    q = torch.clamp(torch.round(groups / scale[..., None]), -8, 7).reshape(w.shape).to(torch.int64)
    unsigned = (q + 8).reshape(w.shape[0], -1, 8)
    packed = (unsigned << (4 * torch.arange(8))).sum(dim=2)
    packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)
    dequantized = (q.double().reshape(groups.shape) * scale.float().double()[..., None]).reshape(w.shape)
    return {"weight_packed": packed, "weight_scale": scale.float(),
            "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}, dequantized


def replica(root, fmt: str):
    """(the HF directory of a quantized replica, a transformers model holding its dequantized weights)."""
    model = make_hf_model("llama")
    hf_dir = os.path.join(root, "hf")
    model.config.save_pretrained(hf_dir)
    tensors = {}
    with torch.no_grad():
        for name, param in model.state_dict().items():
            if not name.endswith(LINEAR):
                tensors[name] = param.contiguous()
                continue
            stored, dequantized = quantize(param, fmt)
            module = name[:-len("weight")]
            tensors.update({module + suffix: value.contiguous() for suffix, value in stored.items()})
            param.copy_(dequantized.float())
    save_file(tensors, os.path.join(hf_dir, "model.safetensors"))
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    if fmt == "modelopt":
        with open(os.path.join(hf_dir, "hf_quant_config.json"), "w") as f:
            json.dump({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8",
                                                                          "exclude_modules": ["lm_head"]}}, f)
    else:
        config["quantization_config"] = {
            "int8": compressed_tensors_config("int-quantized", 8, "int", "channel"),
            "fp8": compressed_tensors_config("float-quantized", 8, "float", "channel"),
            "int4": compressed_tensors_config("pack-quantized", 4, "int", "group", GROUP)}[fmt]
        with open(os.path.join(hf_dir, "config.json"), "w") as f:
            json.dump(config, f)
    return hf_dir, model


def engine_logits(engine: jspec.SpecEngine, tokens: list[list[int]]) -> np.ndarray:
    config = engine.config
    ids = jnp.asarray(tokens, jnp.int32)
    cache = KVCache.zeros(config.num_layers, ids.shape[0], ids.shape[1], config.num_kv_heads, config.head_dim,
                          jnp.float32, per_layer=True)
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    out = engine.setup.target_model().apply({"params": engine.params}, ids, positions, cache,
                                            jnp.zeros((ids.shape[0],), jnp.int32))
    return np.asarray(out.logits)


# slow: compressed-tensors [int8-int8], [fp8-fp8] per channel = their dequantize-then-run reference; default tier:
# [int4-int4] (the same reader), [modelopt-fp8] (fp8 read)
@pytest.mark.parametrize("fmt, scheme", [pytest.param("int8", "int8", marks=pytest.mark.slow),
                                         pytest.param("fp8", "fp8", marks=pytest.mark.slow),
                                         ("int4", "int4"), ("modelopt", "fp8")])
def test_a_quantized_checkpoint_converts_and_runs_as_its_dequantized_weights(tmp_path, fmt, scheme):
    hf_dir, reference = replica(str(tmp_path), fmt)
    out = convert_hf_checkpoint(hf_dir, str(tmp_path / "jspec"), dtype="float32", progress=False)
    assert json.load(open(os.path.join(out, "jspec.json")))["quantization"]["scheme"] == scheme
    with torch.no_grad():
        want = reference(torch.tensor(TOKENS)).logits.numpy()
    stored = jspec.SpecEngine.from_pretrained(out, max_batch_size=1, max_seq_len=64, quantization="none")
    np.testing.assert_allclose(engine_logits(stored, TOKENS), want, atol=1e-4, rtol=1e-4)
    requantized = jspec.SpecEngine.from_pretrained(out, max_batch_size=1, max_seq_len=64)
    assert requantized.quantization.scheme == scheme
    kernel = requantized.params["layers_0"]["self_attn"]["q_proj"]["kernel"]
    assert kernel.qvalue.dtype == {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "int4": jnp.int4}[scheme]
    # quantized again by qwix (its own absmax scales): close to the reference, not equal (logits here are ~0.5)
    assert np.abs(engine_logits(requantized, TOKENS) - want).max() < 0.1


@pytest.mark.parametrize("change, message", [
    (lambda c: c["config_groups"]["group_0"]["weights"].update(symmetric=False), "zero points"),
    (lambda c: c.update(format="marlin-24"), "format='marlin-24'"),
    (lambda c: c["config_groups"]["group_0"].update(targets=["Embedding"]), "targets"),
    (lambda c: c.update(quant_method="gptq"), "quant_method='gptq'"),
])
def test_unsupported_quantization_is_refused_by_name(tmp_path, change, message):
    hf_dir, _ = replica(str(tmp_path), "int8")
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    change(config["quantization_config"])
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=message):
        convert_hf_checkpoint(hf_dir, str(tmp_path / "out"), progress=False)
    assert not os.path.exists(tmp_path / "out")


# slow: [int8], [fp8] stored by jspec convert = quantized at load; default tier: [int4] (qvalue widened on disk and
# narrowed back)
@pytest.mark.parametrize("scheme", [pytest.param("int8", marks=pytest.mark.slow),
                                    pytest.param("fp8", marks=pytest.mark.slow), "int4"])
def test_a_target_stored_quantized_loads_as_quantized_at_load(tmp_path, scheme):
    """jspec convert --quantization: the kernels stored as qvalue and scale (int4 held in int8 on disk); the loaded
    params equal quantizing the float conversion at load, so do the tokens; the stored kernels take their share of
    the bytes on disk."""
    from models.checkpoint.hf_import import convert_hf_checkpoint as convert
    from models.quantization import QuantizationConfig

    model = make_hf_model("llama")
    hf_dir = str(tmp_path / "hf")
    model.save_pretrained(hf_dir)
    config = QuantizationConfig(scheme, group_size=GROUP)
    float_dir = convert(hf_dir, str(tmp_path / "float"), dtype="float32", progress=False)
    stored_dir = convert(hf_dir, str(tmp_path / "stored"), dtype="float32", progress=False, quantization=config)
    assert json.load(open(os.path.join(stored_dir, "jspec.json")))["quantization"]["stored"] is True
    at_load = jspec.SpecEngine.from_pretrained(float_dir, max_batch_size=1, max_seq_len=64, quantization=config)
    stored = jspec.SpecEngine.from_pretrained(stored_dir, max_batch_size=1, max_seq_len=64)
    assert stored.quantization == config
    for a, b in zip(jax.tree.leaves(at_load.params), jax.tree.leaves(stored.params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    prompt = [[5, 9, 13, 2, 40]]
    assert stored.generate(prompt, max_new_tokens=12).token_ids == at_load.generate(prompt, max_new_tokens=12).token_ids
