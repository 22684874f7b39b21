"""A z-lab DFlash drafter (``DFlashDraftModel``) or a DeepSpec DSpark drafter (``Qwen3DSparkModel``) in: its tensor
names -> param paths, and ``convert_hf_dflash``.

HF names (z-lab's dflash/model.py; SGLang's and vLLM's loaders read the same, with or without a ``model.``
prefix): ``fc.weight`` [H, n_ctx * H_target], ``hidden_norm.weight``, ``norm.weight``, ``layers.i.*`` (a Qwen3
decoder layer: ``self_attn.{q,k,v,o}_proj``, ``self_attn.{q,k}_norm``, ``input_layernorm``,
``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``). No embedding and no lm_head: the target's are used.
DSpark adds ``markov_head.markov_w1.weight`` [V, r] (an embedding), ``markov_head.markov_w2.weight`` [V, r] (a
Linear r -> V), ``confidence_head.proj.{weight,bias}`` [1, H (+ r)], [1], and writes frozen copies of the target's
``embed_tokens.weight`` / ``lm_head.weight``, which are dropped after a shape check (SGLang skips them too).
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

from models.checkpoint.hf_params import hf_to_params, resolve_dtype
from models.checkpoint.safetensors_io import iter_safetensors, safetensors_files
from models.checkpoint.store import (DTYPES, abstract_dflash, atomic_directory, check_destination, read_hf_config,
                                     write_jspec_dir)

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
# Tensors some ports write beside the draft: copies of the target's embedding / lm_head (vLLM reads them when
# present), refused by name rather than silently ignored (jspec uses the target's own).
OWN_VOCAB_TENSORS = ("embed_tokens.weight", "lm_head.weight")


def _canonical(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def dflash_param_path(hf_name: str) -> tuple[tuple[str, ...], None, bool] | None:
    """HF DFlash tensor name -> (param path in the DFlashDraft tree, None, transpose?); None if not ours."""
    name = _canonical(hf_name)
    if name == "fc.weight":
        return ("fc", "kernel"), None, True
    if name in ("hidden_norm.weight", "norm.weight"):
        return (name.split(".")[0], "weight"), None, False
    if name == "markov_head.markov_w1.weight":
        return ("markov_head", "markov_w1", "embedding"), None, False
    if name == "markov_head.markov_w2.weight":
        return ("markov_head", "markov_w2", "kernel"), None, True
    if name == "confidence_head.proj.weight":
        return ("confidence_head", "proj", "kernel"), None, True
    if name == "confidence_head.proj.bias":
        return ("confidence_head", "proj", "bias"), None, False
    match = _LAYER.match(name)
    if not match:
        return None
    index, module, kind = match.groups()
    parts = (f"layers_{index}",) + tuple(module.split("."))
    if kind == "bias":
        return parts + ("bias",), None, False
    if parts[-1].endswith("_proj"):  # Linear: weight [out, in] -> kernel [in, out]
        return parts + ("kernel",), None, True
    return parts + ("weight",), None, False


def _tensors(files: list[str], config: Any):
    for name, array in iter_safetensors(files):
        if _canonical(name) in OWN_VOCAB_TENSORS:
            want = (config.layer.vocab_size, config.layer.hidden_size)
            if config.layout != "dspark":
                raise ValueError(f"DFlash tensor {name} {tuple(array.shape)}: a drafter with its own embedding or "
                                 f"lm_head is not supported (jspec uses the target's, as z-lab's model does)")
            if tuple(array.shape) != want:
                raise ValueError(f"DSpark tensor {name}: got {tuple(array.shape)}, expected {want} (a frozen copy "
                                 f"of the target's, which jspec uses instead)")
            continue
        yield name, array


def convert_hf_dflash(src: str, dst: str, dtype: str = "auto", overwrite: bool = False,
                      progress: bool = True) -> str:
    """Converts z-lab's DFlash or DeepSpec's DSpark directory at ``src`` into a jspec directory at ``dst`` (kind
    "dflash"; config.json kept as written). Options that change the network and that jspec does not implement,
    and every missing, unexpected or misshapen tensor, raise ValueError naming them; nothing is left at ``dst`` on
    failure."""
    from models.dflash import dflash_config_from_hf

    check_destination(dst, overwrite)
    hf_config = read_hf_config(src)
    config = dflash_config_from_hf(hf_config)
    dtype = resolve_dtype(dtype, hf_config)
    tensors = _tensors(safetensors_files(src), config)
    if progress:
        from tqdm import tqdm
        tensors = tqdm(tensors, desc="converting", unit="tensor")
    params = hf_to_params(tensors, abstract_dflash(config, dtype), DTYPES[dtype], dflash_param_path)
    with atomic_directory(dst, overwrite) as out:
        write_jspec_dir(out, hf_config, params, "dflash", dtype, src)
    return os.path.abspath(dst)


def as_hf_tensors(params: Any) -> dict[str, np.ndarray]:
    """The inverse of :func:`dflash_param_path`: a DFlashDraft param tree -> z-lab's tensor names (for export
    and round trips)."""
    from flax import traverse_util

    tensors = {}
    for path, leaf in traverse_util.flatten_dict(params).items():
        array = np.asarray(leaf)
        if path[0].startswith("layers_"):
            head = f"layers.{path[0][len('layers_'):]}." + ".".join(path[1:-1])
        else:
            head = ".".join(path[:-1])
        kind = "bias" if path[-1] == "bias" else "weight"
        tensors[f"{head}.{kind}"] = array.T if path[-1] == "kernel" else array  # an embedding's table as it is
    return tensors
