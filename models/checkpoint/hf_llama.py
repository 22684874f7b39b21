"""A Hugging Face Llama-family target in: its tensor names -> param paths, and ``convert_hf_llama``, which streams
the checkpoint into a jspec directory one stacked parameter at a time (with the MTP modules it ships, see
``hf_mtp``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from models.checkpoint.hf_gpt_oss import GptOssReader
from models.checkpoint.hf_language_model import LanguageModelReader
from models.checkpoint.hf_mtp import plan_mtp, stream_mtp_leaves
from models.checkpoint.hf_params import (UNUSED_TENSOR, TensorCheck, expected_shapes, naming_config, resolve_dtype,
                                         stacked_index)
from models.checkpoint.hf_quantized import DequantizingReader, read_quantization
from models.checkpoint.mtp_layouts import MTP_DIR, split_mtp_name
from models.checkpoint.safetensors_io import read_tensor, safetensors_files, tensor_headers
from models.checkpoint.store import DTYPES, atomic_directory, check_destination, read_hf_config, write_jspec_dir
from models.config import ModelConfig, from_hf_config
from models.quantization import QuantizationConfig, stored_leaves

_LLAMA_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)$")
# gpt-oss: every expert of a layer in one tensor ([E, in, out], or [E, out] for _bias: hf_gpt_oss's virtual names),
# the router, and the attention sinks
_STACKED_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)(_bias)?$")
_ROUTER = re.compile(r"^model\.layers\.(\d+)\.mlp\.router\.(weight|bias)$")
_SINKS = re.compile(r"^model\.layers\.(\d+)\.self_attn\.sinks$")
_CORRECTION = re.compile(r"^model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias$")  # DeepSeek-V3's router


def llama_param_path(hf_name: str) -> tuple[tuple[str, ...], int | tuple[int, ...] | None, bool] | None:
    """HF tensor name -> (param path, its index on the path's stacked axes: a layer, (layer, expert) for an expert's
    kernel, or None; transpose?); None if the name is not ours."""
    if hf_name == "model.embed_tokens.weight":
        return ("embed_tokens", "embedding"), None, False
    if hf_name == "model.norm.weight":
        return ("norm", "weight"), None, False
    if hf_name == "lm_head.weight":
        return ("lm_head", "kernel"), None, True
    if match := _STACKED_EXPERTS.match(hf_name):
        leaf = "bias" if match.group(3) else "kernel"
        return ("layers", "mlp", "experts", match.group(2), leaf), int(match.group(1)), False
    if match := _ROUTER.match(hf_name):
        weight = match.group(2) == "weight"
        return ("layers", "mlp", "gate", "kernel" if weight else "bias"), int(match.group(1)), weight
    if match := _SINKS.match(hf_name):
        return ("layers", "self_attn", "sinks"), int(match.group(1)), False
    if match := _CORRECTION.match(hf_name):
        return ("layers", "mlp", "e_score_correction_bias"), int(match.group(1)), False
    match = _LLAMA_LAYER.match(hf_name)
    if not match:
        return None
    layer, module, kind = int(match.group(1)), match.group(2), match.group(3)
    expert = _EXPERT.match(module)
    if expert and kind == "weight":  # one expert of a mixture (models/moe.py): stacked [L, E, in, out]
        return ("layers", "mlp", "experts", expert.group(2), "kernel"), (layer, int(expert.group(1))), True
    parts = tuple(module.split("."))
    if parts[-1].endswith(("_proj", "_proj_with_mqa")) or module == "mlp.gate":  # Linear: [out, in] -> [in, out]
        return ("layers",) + parts + ("kernel" if kind == "weight" else "bias",), layer, kind == "weight"
    return ("layers",) + parts + (kind,), layer, False


def unrolled_param_path(hf_name: str) -> tuple[tuple[str, ...], int | tuple[int, ...] | None, bool] | None:
    """:func:`llama_param_path` for a model stored per layer (``ModelConfig.uniform_layers`` false: DeepSeek-V3's
    dense first layers): ``layers_{i}/...``, indexed by expert only."""
    placed = llama_param_path(hf_name)
    if placed is None or placed[0][0] != "layers":
        return placed
    path, index, transpose = placed
    layer, rest = (index, ()) if isinstance(index, int) else (index[0], tuple(index[1:]))
    return (f"layers_{layer}",) + path[1:], rest or None, transpose


# --- streaming a Llama checkpoint: one stacked parameter in memory at a time ---------------------------------
#
# The tensors are checked from the safetensors headers alone (names, shapes); then every parameter is built in
# turn (a stacked [L, ...] buffer filled layer by layer, each source tensor read on its own and cast into place),
# handed to the writer and dropped. Peak host memory: the largest parameter plus one source tensor.

_Source = tuple[tuple[int, ...], str, str, bool]  # (index on the stacked axes, file, tensor name, transpose?)


def _plan_llama(tensors: Iterable[tuple[str, str, tuple[int, ...]]], abstract_params: Any,
                ignore: Callable[[str], bool], path_of=llama_param_path) -> dict[tuple[str, ...], list[_Source]]:
    """(file, tensor name, shape) of every source tensor -> param path -> the source tensors that fill it, checked
    from the headers (no tensor data read). path_of: the name -> path map (:func:`llama_param_path`, or
    :func:`unrolled_param_path` for a model stored per layer)."""
    check = TensorCheck(abstract_params, path_of, ignore)
    plan: dict[tuple[str, ...], list[_Source]] = {}
    for file, name, shape in tensors:
        placed = check.place(name, shape)
        if placed is not None:
            path, index, transpose = placed
            plan.setdefault(path, []).append((stacked_index(index), file, name, transpose))
    check.raise_problems()
    return plan


def _stream_llama_leaves(plan: dict[tuple[str, ...], list[_Source]], abstract_params: Any, dtype,
                         on_tensor: Callable[[], None] = lambda: None,
                         read: Callable[..., np.ndarray] = read_tensor) -> Iterator[tuple[tuple[str, ...], np.ndarray]]:
    """Yields (param path, array) one parameter at a time; each array is built when drawn (see above). read:
    (file, name, out=None) -> the tensor (``read_tensor``, or a quantized checkpoint's dequantizing reader)."""
    np_dtype = np.dtype(dtype)
    for path, (shape, _) in expected_shapes(abstract_params).items():
        buffer = np.empty(shape, np_dtype)
        for index, file, name, transpose in plan[path]:
            target = buffer[index]
            if transpose:
                target[...] = read(file, name).T
            else:
                read(file, name, out=target)
            del target
            on_tensor()
        yield path, buffer
        del buffer  # before the next parameter is allocated


def ignore_tied_lm_head(config: ModelConfig) -> Callable[[str], bool]:
    """The ``ignore`` of a target whose lm_head is its embedding: a lm_head.weight the checkpoint carries anyway."""
    return lambda name: config.tie_word_embeddings and name == "lm_head.weight"


def convert_hf_llama(src: str, dst: str, dtype: str = "auto", overwrite: bool = False,
                     progress: bool = True, quantization: QuantizationConfig | None = None) -> str:
    """Converts a HF Llama-family checkpoint directory at ``src`` into a jspec directory at ``dst``.

    MTP modules in the checkpoint (config.json ``num_nextn_predict_layers``; models/checkpoint/mtp_layouts.py) are
    written into ``dst/mtp/``, a jspec directory of kind "mtp", in the same atomic write as the target."""
    from models.llama import param_shapes

    check_destination(dst, overwrite)
    hf_config = read_hf_config(src)
    with naming_config(src):
        config = from_hf_config(hf_config)
    dtype = resolve_dtype(dtype, hf_config)
    files = safetensors_files(src)
    abstract = param_shapes(config, DTYPES[dtype])
    headers = tensor_headers(files)
    mxfp4 = (hf_config.get("quantization_config") or {}).get("quant_method") == "mxfp4"
    if mxfp4 and config.model_type != "gpt_oss":
        raise ValueError(f"{src}: quantization_config.quant_method='mxfp4' is read for gpt_oss experts only, not "
                         f"{config.model_type}")
    quantized = None if mxfp4 else read_quantization(src, hf_config)  # MXFP4 experts: dequantized by the reader
    reader = DequantizingReader(headers, quantized.block_size) if quantized is not None else None
    if config.model_type == "gpt_oss":
        reader = GptOssReader(headers)
    if hf_config.get("model_type") == "gemma3":  # an image-text checkpoint: its language model
        reader = LanguageModelReader(headers)
    # the tensors as the importer reads them: a quantized weight at its logical shape, its scales left out
    tensors = list(reader.listing()) if reader is not None else [(f, n, s) for n, (f, s) in headers.items()]
    listed = {name: (file, shape) for file, name, shape in tensors}
    mtp_names = {name for name in listed
                 if not UNUSED_TENSOR.match(name) and split_mtp_name(name, config.num_layers) is not None}
    ignore_tied = ignore_tied_lm_head(config)
    plan = _plan_llama(tensors, abstract, lambda name: ignore_tied(name) or name in mtp_names,
                       llama_param_path if config.uniform_layers else unrolled_param_path)
    with naming_config(src):
        mtp = plan_mtp(listed, mtp_names, hf_config, config, DTYPES[dtype])
    with contextlib.ExitStack() as stack:
        on_tensor = lambda: None
        if progress:
            from tqdm import tqdm
            total = sum(map(len, plan.values())) + (sum(map(len, mtp.sources.values())) if mtp else 0)
            bar = stack.enter_context(tqdm(total=total, desc="converting", unit="tensor"))
            on_tensor = bar.update
        with atomic_directory(dst, overwrite) as out:
            leaves = _stream_llama_leaves(plan, abstract, DTYPES[dtype], on_tensor,
                                          read=reader.read if reader is not None else read_tensor)
            meta = None if quantized is None else {"quantization": quantized.meta()}
            if quantization is not None:  # stored quantized: the loaded model is quantized already
                if mtp is not None:
                    raise ValueError(f"{src}: storing a target with MTP modules quantized is not supported")
                leaves = stored_leaves(leaves, quantization)
                meta = {"quantization": {**dataclasses.asdict(quantization), "stored": True}}
            write_jspec_dir(out, hf_config, leaves, "llama", dtype, src, meta=meta)
            if mtp is not None:
                mtp_dir = os.path.join(out, MTP_DIR)
                os.makedirs(mtp_dir)
                write_jspec_dir(mtp_dir, mtp.hf_config, stream_mtp_leaves(
                    mtp, DTYPES[dtype], on_tensor, read=reader.read if reader is not None else None), "mtp",
                                dtype, None)
    return os.path.abspath(dst)
