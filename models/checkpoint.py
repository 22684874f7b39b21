"""Checkpoints: Hugging Face safetensors -> Flax params, and the orbax directory that jspec loads.

A converted directory holds::

    config.json        the Hugging Face config, verbatim (ModelConfig is rebuilt from it)
    jspec.json         {"format": 1, "kind": "llama", "dtype": "bfloat16"}
    params/            orbax checkpoint of the parameter pytree
    tokenizer.json ... tokenizer files copied from the source when present

Conversion writes everything into a temporary sibling directory and renames it into place at the end, so a
failed conversion leaves nothing at the destination.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from safetensors import safe_open

from models.config import ModelConfig, from_hf_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
FORMAT_VERSION = 1
# Tensors some HF checkpoints carry that hold nothing we need (rope tables are recomputed).
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


# --- reading safetensors -------------------------------------------------------------------------------------

def safetensors_files(src: str) -> list[str]:
    """The .safetensors files of a HF directory: from model.safetensors.index.json when sharded."""
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(src, s))]
        if missing:
            raise FileNotFoundError(f"model.safetensors.index.json in {src!r} names missing shards: {missing}")
        return [os.path.join(src, s) for s in shards]
    files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {src!r}")
    return [os.path.join(src, f) for f in files]


def iter_safetensors(files: list[str]) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (name, array) for every tensor; bf16 arrives as ml_dtypes bfloat16 numpy arrays."""
    for path in files:
        with safe_open(path, framework="flax") as f:
            for name in f.keys():
                yield name, np.asarray(f.get_tensor(name))


def count_tensors(files: list[str]) -> int:
    total = 0
    for path in files:
        with safe_open(path, framework="flax") as f:
            total += len(list(f.keys()))
    return total


# --- HF names -> param paths ---------------------------------------------------------------------------------

_LLAMA_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def llama_param_path(hf_name: str) -> tuple[tuple[str, ...], int | None, bool] | None:
    """HF tensor name -> (param path, layer index or None, transpose?); None if the name is not ours."""
    if hf_name == "model.embed_tokens.weight":
        return ("embed_tokens", "embedding"), None, False
    if hf_name == "model.norm.weight":
        return ("norm", "weight"), None, False
    if hf_name == "lm_head.weight":
        return ("lm_head", "kernel"), None, True
    match = _LLAMA_LAYER.match(hf_name)
    if not match:
        return None
    layer, module, kind = int(match.group(1)), match.group(2), match.group(3)
    parts = tuple(module.split("."))
    if parts[-1].endswith("_proj"):  # Linear: weight [out, in] -> kernel [in, out]
        return ("layers",) + parts + ("kernel" if kind == "weight" else "bias",), layer, kind == "weight"
    return ("layers",) + parts + (kind,), layer, False


def _expected_shapes(abstract_params: Any) -> dict[tuple[str, ...], tuple[tuple[int, ...], Any]]:
    flat = traverse_util.flatten_dict(abstract_params)
    return {path: (tuple(leaf.shape), leaf.dtype) for path, leaf in flat.items()}


def hf_to_params(tensors: Iterator[tuple[str, np.ndarray]], abstract_params: Any, dtype,
                 name_to_path: Callable[[str], tuple[tuple[str, ...], int | None, bool] | None],
                 ignore: Callable[[str], bool] = lambda name: False) -> dict:
    """Assembles HF tensors into the param pytree described by ``abstract_params`` (shapes only).

    Layer tensors are stacked on the leading axis. Raises ValueError listing every missing, unexpected and
    misshapen tensor at once.
    """
    expected = _expected_shapes(abstract_params)
    np_dtype = np.dtype(dtype)
    buffers: dict[tuple[str, ...], np.ndarray] = {}
    filled: dict[tuple[str, ...], set[int]] = {}
    unexpected, misshapen = [], []
    for name, array in tensors:
        if _IGNORED.match(name) or ignore(name):
            continue
        mapped = name_to_path(name)
        if mapped is None or mapped[0] not in expected:
            unexpected.append(name)
            continue
        path, layer, transpose = mapped
        shape, _ = expected[path]
        value = array.T if transpose else array
        want = shape[1:] if layer is not None else shape
        if tuple(value.shape) != want or (layer is not None and layer >= shape[0]):
            misshapen.append(f"{name}: got {tuple(array.shape)}, expected {want if not transpose else want[::-1]}"
                             + (f" (layer {layer} of {shape[0]})" if layer is not None else ""))
            continue
        if layer is None:
            buffers[path] = np.asarray(value, np_dtype)
            filled[path] = {0}
        else:
            if path not in buffers:
                buffers[path] = np.zeros(shape, np_dtype)
            buffers[path][layer] = value
            filled.setdefault(path, set()).add(layer)
    missing = []
    for path, (shape, _) in expected.items():
        layers_needed = set(range(shape[0])) if path[0] == "layers" else {0}
        absent = layers_needed - filled.get(path, set())
        if absent:
            missing.append("/".join(path) + (f" (layers {sorted(absent)})" if path[0] == "layers" else ""))
    if missing or unexpected or misshapen:
        problems = []
        if missing:
            problems.append(f"missing: {missing}")
        if unexpected:
            problems.append(f"unexpected: {unexpected}")
        if misshapen:
            problems.append(f"misshapen: {misshapen}")
        raise ValueError("checkpoint does not match the model config; " + "; ".join(problems))
    return traverse_util.unflatten_dict({p: jnp.asarray(a) for p, a in buffers.items()})


def _ignore_tied_lm_head(config: ModelConfig) -> Callable[[str], bool]:
    return lambda name: config.tie_word_embeddings and name == "lm_head.weight"


# --- the jspec directory -------------------------------------------------------------------------------------

def resolve_dtype(name: str, hf_config: dict) -> str:
    """'auto' -> the checkpoint's own dtype (torch_dtype / dtype in config.json), else float32."""
    if name == "auto":
        name = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32")
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r}: expected 'auto' or one of {sorted(DTYPES)}")
    return name


def save_params(directory: str, params: Any) -> None:
    """Writes the param pytree as an orbax checkpoint at ``directory`` (which must not exist)."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.abspath(directory), params)
        checkpointer.wait_until_finished()


def load_params(directory: str, abstract_params: Any) -> Any:
    """Restores an orbax param checkpoint into the structure/dtypes of ``abstract_params``."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(os.path.abspath(directory), abstract_params)


def check_destination(dst: str, overwrite: bool) -> None:
    if os.path.exists(dst) and not overwrite:
        raise FileExistsError(f"destination {os.path.abspath(dst)!r} already exists (pass overwrite/--overwrite "
                              f"to replace it)")


@contextlib.contextmanager
def atomic_directory(dst: str, overwrite: bool = False) -> Iterator[str]:
    """Yields a temp dir beside ``dst``; renames it to ``dst`` on success, deletes it on failure."""
    dst = os.path.abspath(dst)
    check_destination(dst, overwrite)
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.tmp-", dir=parent)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(dst):
        shutil.rmtree(dst)
    os.rename(tmp, dst)


def write_jspec_dir(out: str, hf_config: dict, params: Any, kind: str, dtype: str, src: str | None) -> None:
    """Writes config.json, jspec.json, params/ and tokenizer files into the (temporary) directory ``out``."""
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    with open(os.path.join(out, "jspec.json"), "w") as f:
        json.dump({"format": FORMAT_VERSION, "kind": kind, "dtype": dtype}, f, indent=2)
    save_params(os.path.join(out, "params"), params)
    if src is not None:
        for name in TOKENIZER_FILES:
            path = os.path.join(src, name)
            if os.path.isfile(path):
                shutil.copy2(path, os.path.join(out, name))


def read_hf_config(src: str) -> dict:
    if not os.path.isdir(src):
        raise FileNotFoundError(f"checkpoint directory {src!r} does not exist")
    path = os.path.join(src, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {src!r}")
    with open(path) as f:
        return json.load(f)


def convert_hf_llama(src: str, dst: str, dtype: str = "auto", overwrite: bool = False,
                     progress: bool = True) -> str:
    """Converts a HF Llama-family checkpoint directory at ``src`` into a jspec directory at ``dst``."""
    from models.llama import init_params

    check_destination(dst, overwrite)
    hf_config = read_hf_config(src)
    config = from_hf_config(hf_config)
    dtype = resolve_dtype(dtype, hf_config)
    files = safetensors_files(src)
    abstract = jax.eval_shape(lambda: init_params(config, jax.random.key(0), DTYPES[dtype]))
    tensors = iter_safetensors(files)
    if progress:
        from tqdm import tqdm
        tensors = tqdm(tensors, total=count_tensors(files), desc="converting", unit="tensor")
    params = hf_to_params(tensors, abstract, DTYPES[dtype], llama_param_path, _ignore_tied_lm_head(config))
    with atomic_directory(dst, overwrite) as out:
        write_jspec_dir(out, hf_config, params, "llama", dtype, src)
    return os.path.abspath(dst)


def read_jspec_meta(model_dir: str) -> dict:
    """jspec.json of a converted directory; FileNotFoundError naming the directory if it is not one."""
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory {model_dir!r} does not exist")
    path = os.path.join(model_dir, "jspec.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{model_dir!r} is not a converted jspec checkpoint (no jspec.json); convert a Hugging Face "
            f"directory first: python scripts/convert_checkpoint.py --src HF_DIR --dst {model_dir}")
    with open(path) as f:
        return json.load(f)


def load_llama(model_dir: str, dtype: str | None = None) -> tuple[ModelConfig, Any, str]:
    """Loads a converted Llama-family directory -> (config, params, dtype name). ``dtype`` casts if given."""
    from models.llama import init_params

    meta = read_jspec_meta(model_dir)
    if meta.get("kind") != "llama":
        raise ValueError(f"{model_dir!r} holds a {meta.get('kind')!r} checkpoint, expected 'llama'")
    config = from_hf_config(read_hf_config(model_dir))
    stored = meta["dtype"]
    abstract = jax.eval_shape(lambda: init_params(config, jax.random.key(0), DTYPES[stored]))
    params = load_params(os.path.join(model_dir, "params"), abstract)
    if dtype is not None and dtype != stored:
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}: expected one of {sorted(DTYPES)}")
        params = jax.tree.map(lambda a: a.astype(DTYPES[dtype]), params)
        stored = dtype
    return config, params, stored
