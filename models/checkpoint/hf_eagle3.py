"""A Hugging Face EAGLE-3 head in (any writer's layout, models/checkpoint/eagle3_layouts.py): its tensor names ->
param paths, EAGLE's own pytorch_model.bin read safely, d2t checked, and ``convert_hf_eagle3``.
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np

from models.checkpoint.eagle3_layouts import IGNORED_TENSORS, canonical_tensor_name, resolve_layout
from models.checkpoint.hf_params import hf_to_params, naming_config, resolve_dtype
from models.checkpoint.safetensors_io import indexed_shards, iter_safetensors, safetensors_files
from models.checkpoint.store import (DTYPES, abstract_eagle3_head, atomic_directory, check_destination,
                                     read_hf_config, write_jspec_dir)


# --- EAGLE-3 heads -------------------------------------------------------------------------------------------
#
# HF names (EAGLE's cnets.py, SGLang's llama_eagle3.py): fc.weight [H, 3H_target];
# midlayer.self_attn.{q,k,v}_proj.weight [heads*D, 2H], o_proj [H, heads*D]; midlayer.mlp.{gate,up,down}_proj;
# midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight; norm.weight; lm_head.weight
# [V_draft, H]; d2t i64[V_draft] (target id = d + d2t[d]); t2d bool[V_target]. Some writers name the layer
# "layers.0." or put "model." before every name.

_EAGLE3_LAYER = re.compile(r"^midlayer\.(.+)\.weight$")


def eagle3_param_path(hf_name: str) -> tuple[tuple[str, ...], None, bool] | None:
    """HF EAGLE-3 tensor name -> (param path in the Eagle3Head tree, None, transpose?); None if not ours."""
    name = canonical_tensor_name(hf_name)
    if name == "fc.weight":
        return ("fc", "kernel"), None, True
    if name == "norm.weight":
        return ("norm", "weight"), None, False
    if name == "lm_head.weight":
        return ("lm_head", "kernel"), None, True
    match = _EAGLE3_LAYER.match(name)
    if not match:
        return None
    parts = tuple(match.group(1).split("."))
    if parts[-1].endswith("_proj"):  # Linear: weight [out, in] -> kernel [in, out]
        return ("midlayer",) + parts + ("kernel",), None, True
    return ("midlayer",) + parts + ("weight",), None, False


# --- reading EAGLE's pytorch_model.bin -----------------------------------------------------------------------

def torch_bin_files(src: str) -> list[str]:
    """The pytorch_model*.bin files of a HF directory: from pytorch_model.bin.index.json when sharded."""
    shards = indexed_shards(src, "pytorch_model.bin.index.json")
    if shards is not None:
        return shards
    path = os.path.join(src, "pytorch_model.bin")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no pytorch_model.bin in {src!r}")
    return [path]


def _load_torch_bin(path: str) -> dict:
    """A pytorch_model.bin's tensors, read with ``weights_only=True``: a pickle that carries anything but tensors
    (which could run code when loaded) is refused with ValueError."""
    try:
        import torch
    except ImportError:
        raise ValueError(f"{path} is a PyTorch pickle; reading it needs torch: pip install torch "
                         f"(CPU wheels suffice)") from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as error:
        # UnpicklingError: a forbidden object (or not a pickle); RuntimeError/EOFError: a corrupt or truncated file
        lines = [line.split("WeightsUnpickler error:")[-1].strip() for line in str(error).splitlines()]
        lines = [line for line in lines if line and not line.startswith(("Weights only load failed", "Check the "))]
        reason = "; ".join(lines) or type(error).__name__
        raise ValueError(f"{path}: refused to load: torch.load(weights_only=True) rejected it ({type(error).__name__}: "
                         f"{reason}); only plain tensor state_dicts are read, never arbitrary pickled objects, "
                         f"which could run code") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path}: expected a dict of tensors (a state_dict), got {type(state).__name__}")
    return state


def iter_torch_bin(files: list[str]) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (name, array) for every tensor of the .bin files (bf16 through float32, exactly)."""
    for path in files:
        for name, tensor in _load_torch_bin(path).items():
            if str(tensor.dtype) == "torch.bfloat16":
                tensor = tensor.float()
            yield name, tensor.numpy()


def eagle3_tensor_files(src: str) -> tuple[list[str], Callable[[list[str]], Iterator[tuple[str, np.ndarray]]]]:
    """(files, reader): safetensors when the directory has any, else EAGLE's pytorch_model.bin."""
    if any(f.endswith(".safetensors") for f in os.listdir(src)) \
            or os.path.isfile(os.path.join(src, "model.safetensors.index.json")):
        return safetensors_files(src), iter_safetensors
    return torch_bin_files(src), iter_torch_bin


def looks_like_eagle3(names: list[str]) -> bool:
    """Whether HF tensor names are an EAGLE-3 head's: fc.weight plus a midlayer./layers.0. decoder layer."""
    stripped = {canonical_tensor_name(n) for n in names}
    return "fc.weight" in stripped and any(n.startswith("midlayer.") for n in stripped)


def eagle3_d2t(d2t: np.ndarray | None, draft_vocab_size: int, target_vocab_size: int) -> np.ndarray:
    """The checked draft->target offsets as i32[V_draft]; zeros when the checkpoint has none."""
    if d2t is None:
        if draft_vocab_size != target_vocab_size:
            raise ValueError(f"EAGLE-3 checkpoint has no d2t tensor, which needs the draft vocabulary to be the "
                             f"target's, but draft_vocab_size={draft_vocab_size} and vocab_size={target_vocab_size}")
        return np.zeros((draft_vocab_size,), np.int32)
    d2t = np.asarray(d2t)
    if d2t.shape != (draft_vocab_size,) or not np.issubdtype(d2t.dtype, np.integer):
        raise ValueError(f"d2t: got {d2t.dtype}{list(d2t.shape)}, expected an integer vector of "
                         f"draft_vocab_size={draft_vocab_size}")
    target_ids = np.arange(draft_vocab_size, dtype=np.int64) + d2t
    bad = np.flatnonzero((target_ids < 0) | (target_ids >= target_vocab_size))
    if bad.size:
        raise ValueError(f"d2t maps draft ids {bad[:5].tolist()} to target ids {target_ids[bad[:5]].tolist()}, "
                         f"outside the target vocabulary [0, {target_vocab_size})")
    return d2t.astype(np.int32)


def _check_eagle3_tensor(name: str, array: np.ndarray, config: Any) -> bool:
    """Whether a tensor is one the head does without (t2d; embed_tokens after its shape check). Any other tensor
    the head lacks (a bias such as fc.bias, an extra layer) is reported by name as unexpected by hf_to_params."""
    canonical = canonical_tensor_name(name)
    if canonical == "embed_tokens.weight":
        want = (config.target_vocab_size, config.layer.hidden_size)
        if tuple(array.shape) != want:
            raise ValueError(f"EAGLE-3 tensor {name}: got {tuple(array.shape)}, expected {want} (a copy of the "
                             f"target's embedding, which jspec shares instead; a head with its own embedding is "
                             f"not supported)")
        return True
    return canonical in IGNORED_TENSORS


def check_eagle3_layers(hf_config: dict) -> None:
    layers = hf_config.get("num_hidden_layers", 1)
    if layers != 1:
        raise ValueError(f"EAGLE-3 config.json num_hidden_layers={layers!r}: only one-layer heads are supported")


def convert_hf_eagle3(src: str, dst: str, dtype: str = "auto", overwrite: bool = False,
                      progress: bool = True) -> str:
    """Converts a HF EAGLE-3 head directory at ``src`` into a jspec directory at ``dst`` (kind "eagle3").

    Any writer's layout (models/checkpoint/eagle3_layouts.py: EAGLE's pytorch_model.bin, SpecForge/AngelSlim,
    speculators, ModelOpt); config.json is written flat, with the resolved taps in ``jspec_eagle3``. A field or
    tensor that changes the math and that jspec does not implement raises ValueError naming it.

    Raises ValueError listing every missing, unexpected and misshapen tensor; d2t is checked to map into the
    target vocabulary. Nothing is left at ``dst`` on failure.
    """
    from models.eagle3 import eagle3_config_from_hf

    check_destination(dst, overwrite)
    hf_config = read_hf_config(src)
    with naming_config(src):
        _, flat_config = resolve_layout(hf_config, src)
        check_eagle3_layers(flat_config)
        config = eagle3_config_from_hf(flat_config)
    dtype = resolve_dtype(dtype, flat_config)
    files, reader = eagle3_tensor_files(src)
    found: dict[str, np.ndarray] = {}

    def head_tensors(tensors):
        for name, array in tensors:
            if canonical_tensor_name(name) == "d2t":
                found["d2t"] = array
            elif not _check_eagle3_tensor(name, array, config):
                yield name, array

    tensors = reader(files)
    if progress:
        from tqdm import tqdm
        tensors = tqdm(tensors, desc="converting", unit="tensor")
    head = hf_to_params(head_tensors(tensors), abstract_eagle3_head(config, dtype), DTYPES[dtype],
                        eagle3_param_path)
    d2t = eagle3_d2t(found.get("d2t"), config.draft_vocab_size, config.target_vocab_size)
    with atomic_directory(dst, overwrite) as out:
        write_jspec_dir(out, flat_config, {"head": head, "d2t": jnp.asarray(d2t)}, "eagle3", dtype, src)
    return os.path.abspath(dst)
