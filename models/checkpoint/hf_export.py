"""Flax params out to Hugging Face layout: config.json + model.safetensors that transformers (and our own
importer) read as-is.

``write_hf_llama`` writes a Llama-family target (stacked layers unstacked into ``model.layers.{i}.``), with MTP
modules in MiMo's or DeepSeek's layout when given;
``write_hf_eagle3`` writes an EAGLE-3 head with ``midlayer.`` names, so that heads we train are ordinary HF
EAGLE-3 checkpoints. Both check the params against the config first and write atomically.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import numpy as np
from flax import traverse_util

from models.checkpoint.hf_eagle3 import check_eagle3_layers, eagle3_d2t
from models.checkpoint.hf_params import expected_shapes
from models.checkpoint.mtp_layouts import abstract_module, module_hf_names, module_prefix
from models.checkpoint.store import DTYPES, abstract_eagle3_head, atomic_directory
from models.config import QKV_BIAS_MODEL_TYPES, from_hf_config
from models.mtp import MTP_LAYOUTS


def _checked_params(params: Any, abstract_for_dtype: Callable[[str], Any], what: str) -> tuple[dict, str]:
    """Flattens ``params`` and checks one dtype and the exact shapes of ``abstract_for_dtype(dtype)``
    -> (flat params, dtype name); ValueError listing every mismatch."""
    flat = traverse_util.flatten_dict(params)
    dtypes = sorted({str(np.asarray(leaf).dtype) for leaf in flat.values()})
    if len(dtypes) != 1 or dtypes[0] not in DTYPES:
        raise ValueError(f"{what} have dtypes {dtypes}: expected one of {sorted(DTYPES)}")
    expected = {path: shape for path, (shape, _) in expected_shapes(abstract_for_dtype(dtypes[0])).items()}
    got = {path: tuple(np.shape(leaf)) for path, leaf in flat.items()}
    if got != expected:
        wrong = sorted("/".join(p) + f": got {got.get(p)}, expected {expected.get(p)}"
                       for p in set(got) | set(expected) if got.get(p) != expected.get(p))
        raise ValueError(f"{what} do not match config.json: {wrong}")
    return flat, dtypes[0]


# --- EAGLE-3 heads -------------------------------------------------------------------------------------------

def _eagle3_hf_name(path: tuple[str, ...]) -> tuple[str, bool]:
    """Inverse of eagle3_param_path, writing the ``midlayer.`` spelling: param path -> (HF name, transpose?)."""
    *module, leaf = path
    return ".".join(module) + ".weight", leaf == "kernel"


def write_hf_eagle3(directory: str, hf_config: dict, params: Any, d2t: Any, overwrite: bool = False) -> str:
    """Writes an HF-layout EAGLE-3 checkpoint (config.json + model.safetensors, ``midlayer.`` names) at
    ``directory`` from head ``params`` (the Eagle3Head tree) and ``d2t`` (int[V_draft]), with ``t2d``
    (bool[V_target], the draft vocabulary's members) beside d2t as SpecForge writes it.

    config.json is ``hf_config`` with architectures ["LlamaForCausalLMEagle3"] and torch_dtype set to the
    params' dtype. Raises ValueError when the params or d2t do not fit the config.
    """
    from safetensors.numpy import save_file

    from models.eagle3 import eagle3_config_from_hf

    check_eagle3_layers(hf_config)
    config = eagle3_config_from_hf(hf_config)
    flat, dtype = _checked_params(params, lambda dtype: abstract_eagle3_head(config, dtype), "EAGLE-3 params")
    tensors = {}
    for path, leaf in flat.items():
        name, transpose = _eagle3_hf_name(path)
        array = np.asarray(leaf)
        tensors[name] = np.ascontiguousarray(array.T if transpose else array)
    d2t = eagle3_d2t(np.asarray(d2t), config.draft_vocab_size, config.target_vocab_size)
    tensors["d2t"] = d2t.astype(np.int64)
    t2d = np.zeros(config.target_vocab_size, bool)  # SpecForge writes the inverse map too: a membership mask
    t2d[np.arange(config.draft_vocab_size) + d2t] = True
    tensors["t2d"] = t2d
    hf_config = dict(hf_config, architectures=["LlamaForCausalLMEagle3"], torch_dtype=dtype)
    with atomic_directory(directory, overwrite) as out:
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2)
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return os.path.abspath(directory)


# --- Llama-family targets, written back to HF layout ----------------------------------------------------------

def _llama_hf_name(path: tuple[str, ...]) -> tuple[str, bool]:
    """Inverse of llama_param_path for one non-layer param path, or a layer path's name with ``{}`` for the
    layer index: param path -> (HF name, transpose?)."""
    if path == ("embed_tokens", "embedding"):
        return "model.embed_tokens.weight", False
    if path == ("norm", "weight"):
        return "model.norm.weight", False
    if path == ("lm_head", "kernel"):
        return "lm_head.weight", True
    if path[0] != "layers":
        raise ValueError(f"param {'/'.join(path)} is not part of a Llama-family model")
    *module, leaf = path[1:]
    suffix = {"kernel": "weight", "bias": "bias", "weight": "weight"}[leaf]
    return "model.layers.{}." + ".".join(module) + "." + suffix, leaf == "kernel"


def write_hf_llama(directory: str, hf_config: dict, params: Any, overwrite: bool = False, mtp_params: Any = None,
                   mtp_layout: str = "mimo") -> str:
    """Writes an HF-layout Llama-family checkpoint (config.json + model.safetensors) at ``directory`` from our
    ``params`` (layers stacked on axis 0 are unstacked into ``model.layers.{i}.``).

    config.json is ``hf_config`` with torch_dtype set to the params' dtype. Raises ValueError when the params do
    not match the config's shapes.

    mtp_params: MTP modules to ship inside the checkpoint, as ``load_mtp`` returns them ({"modules": (module
    params, ...)}, models/mtp.py), written in ``mtp_layout`` (models/checkpoint/mtp_layouts.py) with
    ``num_nextn_predict_layers`` in config.json: "mimo" names them ``model.mtp_layers.{k}.*`` and makes the
    config MiMo's (a Qwen2-family ``hf_config``); "deepseek" names them ``model.layers.{L + k}.*`` with copies of
    the target's embedding and lm_head (``embed_tokens``, ``shared_head.head``; a module's own lm_head instead
    of the latter).
    """
    from safetensors.numpy import save_file

    from models.llama import param_shapes

    if mtp_params is not None:
        hf_config = _with_mtp_fields(hf_config, len(mtp_params["modules"]), mtp_layout)
    config = from_hf_config(hf_config)
    flat, dtype = _checked_params(
        params, lambda dtype: param_shapes(config, DTYPES[dtype]),
        "params")
    tensors = {}
    for path, leaf in flat.items():
        name, transpose = _llama_hf_name(path)
        array = np.asarray(leaf)
        slices = [(name.format(i), array[i]) for i in range(array.shape[0])] if path[0] == "layers" \
            else [(name, array)]
        for hf_name, value in slices:
            tensors[hf_name] = np.ascontiguousarray(value.T if transpose else value)
    if mtp_params is not None:
        tensors.update(mtp_hf_tensors(mtp_params["modules"], mtp_layout, config, dtype, tensors))
    hf_config = dict(hf_config, torch_dtype=dtype)
    with atomic_directory(directory, overwrite) as out:
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2)
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return os.path.abspath(directory)


def _with_mtp_fields(hf_config: dict, num_modules: int, layout: str) -> dict:
    """``hf_config`` with ``num_nextn_predict_layers``; for layout "mimo" MiMo's model_type and architecture."""
    if layout not in MTP_LAYOUTS:
        raise ValueError(f"mtp_layout={layout!r}: expected one of {MTP_LAYOUTS}")
    hf_config = dict(hf_config, num_nextn_predict_layers=num_modules)
    if layout == "mimo":
        if hf_config.get("model_type") not in QKV_BIAS_MODEL_TYPES:
            raise ValueError(f"mtp_layout='mimo' writes a MiMo checkpoint, a Qwen2-family target: expected "
                             f"model_type in {QKV_BIAS_MODEL_TYPES}, got {hf_config.get('model_type')!r}")
        hf_config.update(architectures=["MiMoForCausalLM"], model_type="mimo")
    return hf_config


def mtp_hf_tensors(modules: Any, layout: str, config: Any, dtype: str, target: dict[str, np.ndarray]
                 ) -> dict[str, np.ndarray]:
    """HF-named tensors of the MTP ``modules`` (checked against the target's shapes and dtype)."""
    from models.mtp import MtpConfig

    layer = MtpConfig.for_target(config, len(modules), layout).layer
    tensors = {}
    for index, module in enumerate(modules):
        own_lm_head = "lm_head" in module
        if own_lm_head and layout == "mimo":
            raise ValueError(f"MTP module {index} has an lm_head of its own, which the mimo layout cannot hold "
                             f"(MiMo's modules share the target's); use mtp_layout='deepseek'")
        what = f"MTP module {index} params"
        flat, module_dtype = _checked_params(module, lambda dtype: abstract_module(layer, DTYPES[dtype], own_lm_head),
                                             what)
        if module_dtype != dtype:
            raise ValueError(f"{what} are {module_dtype}, expected the target's {dtype}")
        names = module_hf_names(layout, index, config.num_layers, traverse_util.unflatten_dict(flat))
        for name, (path, _, transpose, expert) in names.items():
            array = np.asarray(flat[path]) if expert is None else np.asarray(flat[path][expert])
            tensors[name] = np.ascontiguousarray(array.T if transpose else array)
        if layout == "deepseek":  # DeepSeek-V3 ships copies of the target's embedding and lm_head in each module
            prefix = module_prefix(layout, index, config.num_layers)
            embedding = target["model.embed_tokens.weight"]
            tensors[prefix + "embed_tokens.weight"] = embedding.copy()
            if not own_lm_head:
                tensors[prefix + "shared_head.head.weight"] = target.get("lm_head.weight", embedding).copy()
    return tensors
