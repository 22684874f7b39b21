"""Checkpoints: Hugging Face safetensors -> Flax params, and the orbax directory that jspec loads.

A converted directory holds::

    config.json        the Hugging Face config, verbatim (ModelConfig is rebuilt from it)
    jspec.json         {"format": 1, "kind": "llama" | "eagle3", "dtype": "bfloat16"}
    params/            orbax checkpoint of the parameter pytree (eagle3: {"head": head params, "d2t": i32[V_draft]})
    tokenizer.json ... tokenizer files copied from the source when present

``convert_hf_checkpoint`` picks the converter from the source: a Llama-family target or an EAGLE-3 head (see
``checkpoint_kind``). ``write_hf_eagle3`` goes the other way for heads, so that heads we train are ordinary HF
EAGLE-3 checkpoints.

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


def tensor_names(files: list[str]) -> list[str]:
    """The tensor names of the files (headers only, no data read)."""
    names = []
    for path in files:
        with safe_open(path, framework="flax") as f:
            names.extend(f.keys())
    return names


def count_tensors(files: list[str]) -> int:
    return len(tensor_names(files))


def _tensors_with_progress(files: list[str], progress: bool) -> Iterator[tuple[str, np.ndarray]]:
    tensors = iter_safetensors(files)
    if progress:
        from tqdm import tqdm
        tensors = tqdm(tensors, total=count_tensors(files), desc="converting", unit="tensor")
    return tensors


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
            filled.setdefault(path, set()).add(layer if layer is not None else 0)  # reported once, as misshapen
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
    """Restores an orbax param checkpoint into the structure/dtypes of ``abstract_params``.

    Every array lands on this process's default device, whatever device the checkpoint was written from
    (orbax otherwise restores the saved sharding and refuses a CPU-written checkpoint on a GPU).
    """
    import orbax.checkpoint as ocp

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    placed = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), abstract_params)
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(os.path.abspath(directory), placed)


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
    tensors = _tensors_with_progress(files, progress)
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

    meta = _read_kind(model_dir, "llama")
    config = from_hf_config(read_hf_config(model_dir))
    stored = meta["dtype"]
    abstract = jax.eval_shape(lambda: init_params(config, jax.random.key(0), DTYPES[stored]))
    params = load_params(os.path.join(model_dir, "params"), abstract)
    return (config,) + _cast_params(params, stored, dtype)


def _cast_params(params: Any, stored: str, dtype: str | None) -> tuple[Any, str]:
    """(params cast to ``dtype``, its name); unchanged when ``dtype`` is None or already the stored one."""
    if dtype is None or dtype == stored:
        return params, stored
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {sorted(DTYPES)}")
    return jax.tree.map(lambda a: a.astype(DTYPES[dtype]), params), dtype


def _read_kind(model_dir: str, kind: str) -> dict:
    meta = read_jspec_meta(model_dir)
    if meta.get("kind") != kind:
        raise ValueError(f"{model_dir!r} holds a {meta.get('kind')!r} checkpoint, expected {kind!r}")
    return meta


# --- EAGLE-3 heads -------------------------------------------------------------------------------------------
#
# HF names (EAGLE's cnets.py, SGLang's llama_eagle3.py): fc.weight [H, 3H_target];
# midlayer.self_attn.{q,k,v}_proj.weight [heads*D, 2H], o_proj [H, heads*D]; midlayer.mlp.{gate,up,down}_proj;
# midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight; norm.weight; lm_head.weight
# [V_draft, H]; d2t i64[V_draft] (target id = d + d2t[d]); t2d bool[V_target]. Some writers name the layer
# "layers.0." or put "model." before every name.

_EAGLE3_LAYER = re.compile(r"^(?:midlayer|layers\.0)\.(.+)\.weight$")
# t2d is the inverse of d2t (a membership mask over the target vocabulary): nothing we need. embed_tokens, when a
# writer includes it, is a copy of the target's embedding, which the head shares: the target's is used.
_EAGLE3_IGNORED = ("t2d", "embed_tokens.weight")


def _strip_model_prefix(hf_name: str) -> str:
    return hf_name[len("model."):] if hf_name.startswith("model.") else hf_name


def eagle3_param_path(hf_name: str) -> tuple[tuple[str, ...], None, bool] | None:
    """HF EAGLE-3 tensor name -> (param path in the Eagle3Head tree, None, transpose?); None if not ours."""
    name = _strip_model_prefix(hf_name)
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


def _eagle3_hf_name(path: tuple[str, ...]) -> tuple[str, bool]:
    """Inverse of eagle3_param_path, writing the ``midlayer.`` spelling: param path -> (HF name, transpose?)."""
    *module, leaf = path
    return ".".join(module) + ".weight", leaf == "kernel"


def looks_like_eagle3(names: list[str]) -> bool:
    """Whether HF tensor names are an EAGLE-3 head's: fc.weight plus a midlayer./layers.0. decoder layer."""
    stripped = {_strip_model_prefix(n) for n in names}
    return "fc.weight" in stripped and any(n.startswith(("midlayer.", "layers.0.")) for n in stripped)


def checkpoint_kind(src: str) -> str:
    """'eagle3' or 'llama' for the HF directory ``src``.

    EAGLE-3 when config.json's architectures names one of ``EAGLE3_ARCHITECTURES``, or when the tensors are an
    EAGLE-3 head's (``fc.weight`` + ``midlayer.*``/``layers.0.*``; some writers leave architectures out or copy
    the target's); Llama-family otherwise.
    """
    from models.eagle3 import EAGLE3_ARCHITECTURES

    architectures = read_hf_config(src).get("architectures") or []
    if any(arch in EAGLE3_ARCHITECTURES for arch in architectures):
        return "eagle3"
    return "eagle3" if looks_like_eagle3(tensor_names(safetensors_files(src))) else "llama"


def convert_hf_checkpoint(src: str, dst: str, dtype: str = "auto", overwrite: bool = False,
                          progress: bool = True) -> str:
    """Converts a HF directory (Llama-family target or EAGLE-3 head, see ``checkpoint_kind``) to ``dst``."""
    convert = convert_hf_eagle3 if checkpoint_kind(src) == "eagle3" else convert_hf_llama
    return convert(src, dst, dtype=dtype, overwrite=overwrite, progress=progress)


def _eagle3_d2t(d2t: np.ndarray | None, draft_vocab_size: int, target_vocab_size: int) -> np.ndarray:
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


def _abstract_eagle3_head(config, dtype: str) -> Any:
    from models.eagle3 import init_eagle3_params

    return jax.eval_shape(lambda: init_eagle3_params(config, jax.random.key(0), DTYPES[dtype]))


def _check_eagle3_layers(hf_config: dict) -> None:
    layers = hf_config.get("num_hidden_layers", 1)
    if layers != 1:
        raise ValueError(f"EAGLE-3 config.json num_hidden_layers={layers!r}: only one-layer heads are supported")


def convert_hf_eagle3(src: str, dst: str, dtype: str = "auto", overwrite: bool = False,
                      progress: bool = True) -> str:
    """Converts a HF EAGLE-3 head directory at ``src`` into a jspec directory at ``dst`` (kind "eagle3").

    Raises ValueError listing every missing, unexpected and misshapen tensor; d2t is checked to map into the
    target vocabulary. Nothing is left at ``dst`` on failure.
    """
    from models.eagle3 import eagle3_config_from_hf

    check_destination(dst, overwrite)
    hf_config = read_hf_config(src)
    _check_eagle3_layers(hf_config)
    config = eagle3_config_from_hf(hf_config)
    dtype = resolve_dtype(dtype, hf_config)
    found: dict[str, np.ndarray] = {}

    def without_d2t(tensors):
        for name, array in tensors:
            if _strip_model_prefix(name) == "d2t":
                found["d2t"] = array
            else:
                yield name, array

    head = hf_to_params(without_d2t(_tensors_with_progress(safetensors_files(src), progress)),
                        _abstract_eagle3_head(config, dtype), DTYPES[dtype], eagle3_param_path,
                        lambda name: _strip_model_prefix(name) in _EAGLE3_IGNORED)
    d2t = _eagle3_d2t(found.get("d2t"), config.draft_vocab_size, config.target_vocab_size)
    with atomic_directory(dst, overwrite) as out:
        write_jspec_dir(out, hf_config, {"head": head, "d2t": jnp.asarray(d2t)}, "eagle3", dtype, src)
    return os.path.abspath(dst)


def load_eagle3(model_dir: str, dtype: str | None = None) -> tuple[Any, Any, jax.Array, str]:
    """Loads a converted EAGLE-3 directory -> (Eagle3Config, head params, d2t i32[V_draft], dtype name).

    ``dtype`` casts the head parameters if given (d2t stays int32).
    """
    from models.eagle3 import eagle3_config_from_hf

    meta = _read_kind(model_dir, "eagle3")
    config = eagle3_config_from_hf(read_hf_config(model_dir))
    stored = meta["dtype"]
    abstract = {"head": _abstract_eagle3_head(config, stored),
                "d2t": jax.ShapeDtypeStruct((config.draft_vocab_size,), jnp.int32)}
    restored = load_params(os.path.join(model_dir, "params"), abstract)
    head, dtype_name = _cast_params(restored["head"], stored, dtype)
    return config, head, restored["d2t"], dtype_name


def _checked_params(params: Any, abstract_for_dtype: Callable[[str], Any], what: str) -> tuple[dict, str]:
    """Flattens ``params`` and checks one dtype and the exact shapes of ``abstract_for_dtype(dtype)``
    -> (flat params, dtype name); ValueError listing every mismatch."""
    flat = traverse_util.flatten_dict(params)
    dtypes = sorted({str(np.asarray(leaf).dtype) for leaf in flat.values()})
    if len(dtypes) != 1 or dtypes[0] not in DTYPES:
        raise ValueError(f"{what} have dtypes {dtypes}: expected one of {sorted(DTYPES)}")
    expected = {path: shape for path, (shape, _) in _expected_shapes(abstract_for_dtype(dtypes[0])).items()}
    got = {path: tuple(np.shape(leaf)) for path, leaf in flat.items()}
    if got != expected:
        wrong = sorted("/".join(p) + f": got {got.get(p)}, expected {expected.get(p)}"
                       for p in set(got) | set(expected) if got.get(p) != expected.get(p))
        raise ValueError(f"{what} do not match config.json: {wrong}")
    return flat, dtypes[0]


def write_hf_eagle3(directory: str, hf_config: dict, params: Any, d2t: Any, overwrite: bool = False) -> str:
    """Writes an HF-layout EAGLE-3 checkpoint (config.json + model.safetensors, ``midlayer.`` names) at
    ``directory`` from head ``params`` (the Eagle3Head tree) and ``d2t`` (int[V_draft]).

    config.json is ``hf_config`` with architectures ["LlamaForCausalLMEagle3"] and torch_dtype set to the
    params' dtype. Raises ValueError when the params or d2t do not fit the config.
    """
    from safetensors.numpy import save_file

    from models.eagle3 import eagle3_config_from_hf

    _check_eagle3_layers(hf_config)
    config = eagle3_config_from_hf(hf_config)
    flat, dtype = _checked_params(params, lambda dtype: _abstract_eagle3_head(config, dtype), "EAGLE-3 params")
    tensors = {}
    for path, leaf in flat.items():
        name, transpose = _eagle3_hf_name(path)
        array = np.asarray(leaf)
        tensors[name] = np.ascontiguousarray(array.T if transpose else array)
    d2t = _eagle3_d2t(np.asarray(d2t), config.draft_vocab_size, config.target_vocab_size)
    tensors["d2t"] = d2t.astype(np.int64)
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


def write_hf_llama(directory: str, hf_config: dict, params: Any, overwrite: bool = False) -> str:
    """Writes an HF-layout Llama-family checkpoint (config.json + model.safetensors) at ``directory`` from our
    ``params`` (layers stacked on axis 0 are unstacked into ``model.layers.{i}.``).

    config.json is ``hf_config`` with torch_dtype set to the params' dtype. Raises ValueError when the params do
    not match the config's shapes.
    """
    from safetensors.numpy import save_file

    from models.llama import init_params

    config = from_hf_config(hf_config)
    flat, dtype = _checked_params(
        params, lambda dtype: jax.eval_shape(lambda: init_params(config, jax.random.key(0), DTYPES[dtype])),
        "params")
    tensors = {}
    for path, leaf in flat.items():
        name, transpose = _llama_hf_name(path)
        array = np.asarray(leaf)
        slices = [(name.format(i), array[i]) for i in range(array.shape[0])] if path[0] == "layers" \
            else [(name, array)]
        for hf_name, value in slices:
            tensors[hf_name] = np.ascontiguousarray(value.T if transpose else value)
    hf_config = dict(hf_config, torch_dtype=dtype)
    with atomic_directory(directory, overwrite) as out:
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2)
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return os.path.abspath(directory)
