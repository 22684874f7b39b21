"""Hugging Face checkpoints in: config.json + *.safetensors (one file or an index of shards) -> Flax params.

``convert_hf_checkpoint`` picks the converter from the source: a Llama-family target (``convert_hf_llama``, which
also writes the MTP modules a target ships into ``mtp/``) or an EAGLE-3 head (``convert_hf_eagle3``; see
``checkpoint_kind``), and writes a jspec directory (see ``store``).
Everything is read and checked before anything is written; a bad source raises ValueError (or
FileNotFoundError) naming the file, and nothing is left at the destination.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import traverse_util
from safetensors import SafetensorError, safe_open

from models.checkpoint.eagle3_layouts import IGNORED_TENSORS, canonical_tensor_name, resolve_layout
from models.checkpoint.mtp_layouts import (DEEPSEEK_COPIES, MTP_DIR, abstract_module, module_hf_names, module_prefix,
                                          split_mtp_name)
from models.checkpoint.store import (DTYPES, _abstract_eagle3_head, atomic_directory, check_destination,
                                     read_hf_config, write_jspec_dir)
from models.config import ModelConfig, from_hf_config

# Tensors some HF checkpoints carry that hold nothing we need (rope tables are recomputed).
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


# --- reading safetensors -------------------------------------------------------------------------------------

def safetensors_files(src: str) -> list[str]:
    """The .safetensors files of a HF directory: from model.safetensors.index.json when sharded."""
    shards = _indexed_shards(src, "model.safetensors.index.json")
    if shards is not None:
        return shards
    files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {src!r}")
    return [os.path.join(src, f) for f in files]


def _indexed_shards(src: str, index_name: str) -> list[str] | None:
    """The shard files ``src/index_name`` names (sorted, each once), None without that index;
    FileNotFoundError naming the shards that are missing."""
    index = os.path.join(src, index_name)
    if not os.path.isfile(index):
        return None
    shards = sorted(set(_weight_map(index).values()))
    missing = [s for s in shards if not os.path.isfile(os.path.join(src, s))]
    if missing:
        raise FileNotFoundError(f"{index_name} in {src!r} names missing shards: {missing}")
    return [os.path.join(src, s) for s in shards]


def _weight_map(index: str) -> dict:
    """The weight_map of a model.safetensors.index.json; ValueError naming the file if it has none."""
    with open(index) as f:
        try:
            content = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"{index}: not valid JSON ({error})") from None
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: no 'weight_map' object (tensor name -> shard file)")
    return weight_map


@contextlib.contextmanager
def _open_safetensors(path: str) -> Iterator[Any]:
    """safe_open(path); a file that is not safetensors (truncated, corrupt) raises ValueError naming it."""
    with contextlib.ExitStack() as stack:
        try:
            f = stack.enter_context(safe_open(path, framework="numpy"))
        except SafetensorError as error:
            reason = str(error).removeprefix("Error while deserializing header: ")
            raise ValueError(f"{path}: not a readable safetensors file ({reason}); truncated or corrupt?") from error
        yield f


def iter_safetensors(files: list[str]) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (name, array) for every tensor; bf16 arrives as ml_dtypes bfloat16 numpy arrays."""
    for path in files:
        with _open_safetensors(path) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def tensor_names(files: list[str]) -> list[str]:
    """The tensor names of the files (headers only, no data read)."""
    names = []
    for path in files:
        with _open_safetensors(path) as f:
            names.extend(f.keys())
    return names


def count_tensors(files: list[str]) -> int:
    return len(tensor_names(files))


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


class _TensorCheck:
    """Matches HF tensors (name, shape) to the param paths of ``abstract_params`` and collects every missing,
    unexpected and misshapen tensor, to be raised at once by ``raise_problems``."""

    def __init__(self, abstract_params: Any,
                 name_to_path: Callable[[str], tuple[tuple[str, ...], int | None, bool] | None],
                 ignore: Callable[[str], bool] = lambda name: False):
        self.expected = _expected_shapes(abstract_params)
        self.name_to_path, self.ignore = name_to_path, ignore
        self.filled: dict[tuple[str, ...], set[int]] = {}
        self.unexpected: list[str] = []
        self.misshapen: list[str] = []

    def place(self, name: str, shape: tuple[int, ...]) -> tuple[tuple[str, ...], int | None, bool] | None:
        """(param path, layer or None, transpose?) for a tensor that fits; None for one ignored or reported."""
        if _IGNORED.match(name) or self.ignore(name):
            return None
        mapped = self.name_to_path(name)
        if mapped is None or mapped[0] not in self.expected:
            self.unexpected.append(name)
            return None
        path, layer, transpose = mapped
        want_shape, _ = self.expected[path]
        want = want_shape[1:] if layer is not None else want_shape
        got = tuple(shape)[::-1] if transpose else tuple(shape)
        self.filled.setdefault(path, set()).add(layer if layer is not None else 0)  # misshapen: reported once
        if got != want or (layer is not None and layer >= want_shape[0]):
            self.misshapen.append(f"{name}: got {tuple(shape)}, expected {want if not transpose else want[::-1]}"
                                  + (f" (layer {layer} of {want_shape[0]})" if layer is not None else ""))
            return None
        return mapped

    def raise_problems(self) -> None:
        missing = []
        for path, (shape, _) in self.expected.items():
            layers_needed = set(range(shape[0])) if path[0] == "layers" else {0}
            absent = layers_needed - self.filled.get(path, set())
            if absent:
                missing.append("/".join(path) + (f" (layers {sorted(absent)})" if path[0] == "layers" else ""))
        problems = []
        if missing:
            problems.append(f"missing: {missing}")
        if self.unexpected:
            problems.append(f"unexpected: {self.unexpected}")
        if self.misshapen:
            problems.append(f"misshapen: {self.misshapen}")
        if problems:
            raise ValueError("checkpoint does not match the model config; " + "; ".join(problems))


def hf_to_params(tensors: Iterator[tuple[str, np.ndarray]], abstract_params: Any, dtype,
                 name_to_path: Callable[[str], tuple[tuple[str, ...], int | None, bool] | None],
                 ignore: Callable[[str], bool] = lambda name: False) -> dict:
    """Assembles HF tensors into the param pytree described by ``abstract_params`` (shapes only), in memory.

    Layer tensors are stacked on the leading axis. Raises ValueError listing every missing, unexpected and
    misshapen tensor at once. (``convert_hf_llama`` streams instead: ``_stream_llama_leaves``.)
    """
    check = _TensorCheck(abstract_params, name_to_path, ignore)
    np_dtype = np.dtype(dtype)
    buffers: dict[tuple[str, ...], np.ndarray] = {}
    for name, array in tensors:
        placed = check.place(name, array.shape)
        if placed is None:
            continue
        path, layer, transpose = placed
        if path not in buffers:
            buffers[path] = np.empty(check.expected[path][0], np_dtype)
        (buffers[path] if layer is None else buffers[path][layer])[...] = array.T if transpose else array
    check.raise_problems()
    return traverse_util.unflatten_dict({p: jnp.asarray(a) for p, a in buffers.items()})


# --- streaming a Llama checkpoint: one stacked parameter in memory at a time ---------------------------------
#
# The tensors are checked from the safetensors headers alone (names, shapes); then every parameter is built in
# turn (a stacked [L, ...] buffer filled layer by layer, each source tensor read on its own and cast into place),
# handed to the writer and dropped. Peak host memory: the largest parameter plus one source tensor.

_Source = tuple[int | None, str, str, bool]  # (layer or None, file, tensor name, transpose?)


def _plan_llama(files: list[str], abstract_params: Any,
                ignore: Callable[[str], bool]) -> dict[tuple[str, ...], list[_Source]]:
    """param path -> the source tensors that fill it, checked from the headers (no tensor data read)."""
    check = _TensorCheck(abstract_params, llama_param_path, ignore)
    plan: dict[tuple[str, ...], list[_Source]] = {}
    for file in files:
        with _open_safetensors(file) as f:
            for name in f.keys():
                placed = check.place(name, tuple(f.get_slice(name).get_shape()))
                if placed is not None:
                    path, layer, transpose = placed
                    plan.setdefault(path, []).append((layer, file, name, transpose))
    check.raise_problems()
    return plan


# safetensors dtype -> numpy; others (float8 ...) are read through safe_open.
_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
                       "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
                       "BOOL": np.bool_}


def _read_tensor(file: str, name: str, out: np.ndarray | None = None) -> np.ndarray:
    """One tensor of a (checked, see ``_plan_llama``) safetensors file, read straight from the file into its
    array: one copy in memory (safe_open's get_tensor holds two at its peak, and maps the file). ``out``: the
    array to fill, cast to its dtype; a contiguous ``out`` of the stored dtype is read into without a copy."""
    with open(file, "rb") as f:
        header_size = int.from_bytes(f.read(8), "little")
        info = json.loads(f.read(header_size))[name]
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:  # float8 and such: safetensors knows them
            with _open_safetensors(file) as tensors:
                array = tensors.get_tensor(name)
        else:
            begin, end = info["data_offsets"]
            f.seek(8 + header_size + begin)
            direct = out is not None and out.dtype == np.dtype(dtype) and out.flags.c_contiguous
            array = out if direct else np.empty(info["shape"], dtype)
            if f.readinto(memoryview(array.reshape(-1).view(np.uint8))) != end - begin:
                raise ValueError(f"{file}: tensor {name} is cut short; truncated?")
            if direct:
                return out
    if out is None:
        return array
    out[...] = array
    return out


def _stream_llama_leaves(plan: dict[tuple[str, ...], list[_Source]], abstract_params: Any, dtype,
                         on_tensor: Callable[[], None] = lambda: None) -> Iterator[tuple[tuple[str, ...], np.ndarray]]:
    """Yields (param path, array) one parameter at a time; each array is built when drawn (see above)."""
    np_dtype = np.dtype(dtype)
    for path, (shape, _) in _expected_shapes(abstract_params).items():
        buffer = np.empty(shape, np_dtype)
        for layer, file, name, transpose in plan[path]:
            target = buffer if layer is None else buffer[layer]
            if transpose:
                target[...] = _read_tensor(file, name).T
            else:
                _read_tensor(file, name, out=target)
            del target
            on_tensor()
        yield path, buffer
        del buffer  # before the next parameter is allocated


def _ignore_tied_lm_head(config: ModelConfig) -> Callable[[str], bool]:
    return lambda name: config.tie_word_embeddings and name == "lm_head.weight"


@contextlib.contextmanager
def _naming_config(src: str) -> Iterator[None]:
    """Adds the path of ``src``/config.json to a ValueError raised inside (a missing or bad field); a KeyError
    (a field read without a check) becomes a ValueError naming the field and the file."""
    path = os.path.join(src, "config.json")
    try:
        yield
    except KeyError as error:
        raise ValueError(f"{path}: no {error.args[0]!r} field") from error
    except ValueError as error:
        raise ValueError(f"{error} (in {path})") from error


def resolve_dtype(name: str, hf_config: dict) -> str:
    """'auto' -> the checkpoint's own dtype (torch_dtype / dtype in config.json), else float32."""
    if name == "auto":
        name = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32")
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r}: expected 'auto' or one of {sorted(DTYPES)}")
    return name


def convert_hf_llama(src: str, dst: str, dtype: str = "auto", overwrite: bool = False,
                     progress: bool = True) -> str:
    """Converts a HF Llama-family checkpoint directory at ``src`` into a jspec directory at ``dst``.

    MTP modules in the checkpoint (config.json ``num_nextn_predict_layers``; models/checkpoint/mtp_layouts.py) are
    written into ``dst/mtp/``, a jspec directory of kind "mtp", in the same atomic write as the target."""
    from models.llama import init_params

    check_destination(dst, overwrite)
    hf_config = read_hf_config(src)
    with _naming_config(src):
        config = from_hf_config(hf_config)
    dtype = resolve_dtype(dtype, hf_config)
    files = safetensors_files(src)
    abstract = jax.eval_shape(lambda: init_params(config, jax.random.key(0), DTYPES[dtype]))
    headers = _headers(files)
    mtp_names = {name for name in headers
                 if not _IGNORED.match(name) and split_mtp_name(name, config.num_layers) is not None}
    ignore_tied = _ignore_tied_lm_head(config)
    plan = _plan_llama(files, abstract, lambda name: ignore_tied(name) or name in mtp_names)
    with _naming_config(src):
        mtp = _plan_mtp(headers, mtp_names, hf_config, config, DTYPES[dtype])
    with contextlib.ExitStack() as stack:
        on_tensor = lambda: None
        if progress:
            from tqdm import tqdm
            total = sum(map(len, plan.values())) + (len(mtp.sources) if mtp else 0)
            bar = stack.enter_context(tqdm(total=total, desc="converting", unit="tensor"))
            on_tensor = bar.update
        with atomic_directory(dst, overwrite) as out:
            write_jspec_dir(out, hf_config, _stream_llama_leaves(plan, abstract, DTYPES[dtype], on_tensor), "llama",
                            dtype, src)
            if mtp is not None:
                mtp_dir = os.path.join(out, MTP_DIR)
                os.makedirs(mtp_dir)
                write_jspec_dir(mtp_dir, mtp.hf_config, _stream_mtp_leaves(mtp, DTYPES[dtype], on_tensor), "mtp",
                                dtype, None)
    return os.path.abspath(dst)


# --- MTP modules inside a target checkpoint (models/checkpoint/mtp_layouts.py) -------------------------------

def _headers(files: list[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """tensor name -> (file, shape), from the safetensors headers alone."""
    headers = {}
    for file in files:
        with _open_safetensors(file) as f:
            for name in f.keys():
                headers[name] = (file, tuple(f.get_slice(name).get_shape()))
    return headers


class _MtpPlan(NamedTuple):
    hf_config: dict  # the target's config.json + "jspec_mtp": {num_modules, layout, own_lm_head}
    sources: dict[tuple[str, ...], tuple[str, str, bool]]  # param path -> (file, tensor name, transpose?)


def _num_mtp_modules(hf_config: dict) -> int:
    value = hf_config.get("num_nextn_predict_layers")
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"config.json num_nextn_predict_layers={value!r}: expected an integer >= 0 (the number "
                         f"of MTP modules)")
    return value


def _plan_mtp(headers: dict[str, tuple[str, tuple[int, ...]]], mtp_names: set[str], hf_config: dict,
              config: ModelConfig, dtype) -> _MtpPlan | None:
    """Checks the MTP modules' tensors from the headers (and DeepSeek's embedding/lm_head copies against the
    target's, read in full) -> what to write, or None when the checkpoint has none. ValueError naming every
    missing, unexpected and misshapen tensor, a config.json that disagrees with the tensors, or a module with an
    embedding of its own."""
    from models.mtp import MtpConfig

    num_modules = _num_mtp_modules(hf_config)
    if not mtp_names:
        return None  # num_nextn_predict_layers > 0 without the tensors (a stripped copy): the target alone
    found = sorted(mtp_names)
    if num_modules == 0:
        raise ValueError(f"the checkpoint holds MTP-module tensors ({found[:3]}{' ...' if len(found) > 3 else ''}) "
                         f"but config.json num_nextn_predict_layers={hf_config.get('num_nextn_predict_layers')!r}; "
                         f"expected the number of modules")
    layouts = sorted({split_mtp_name(name, config.num_layers)[0] for name in found})
    if len(layouts) != 1:
        raise ValueError(f"the checkpoint mixes MTP layouts {layouts} (model.mtp_layers.* and model.layers."
                         f"{config.num_layers}+.*); expected one")
    layout = layouts[0]
    mtp_config = MtpConfig.for_target(config, num_modules, layout)
    own_lm_head, dropped = _deepseek_copies(headers, mtp_names, config, num_modules) if layout == "deepseek" \
        else ([False] * num_modules, set())
    expected: dict[str, tuple[tuple[str, ...], tuple[int, ...], bool]] = {}  # HF name -> (path, HF shape, transpose?)
    for index in range(num_modules):
        module = abstract_module(mtp_config.layer, dtype, own_lm_head[index])
        for name, (path, shape, transpose) in module_hf_names(layout, index, config.num_layers, module).items():
            expected[name] = (("modules", str(index)) + path, shape, transpose)
    missing = [name for name in expected if name not in mtp_names]
    unexpected = [name for name in found if name not in expected and name not in dropped]
    misshapen = [f"{name}: got {headers[name][1]}, expected {expected[name][1]}" for name in found
                 if name in expected and headers[name][1] != expected[name][1]]
    problems = [f"{what}: {names}" for what, names in
                (("missing", missing), ("unexpected", unexpected), ("misshapen", misshapen)) if names]
    if problems:
        raise ValueError(f"the MTP modules do not match config.json (num_nextn_predict_layers={num_modules}, "
                         f"{layout} layout); " + "; ".join(problems))
    mtp_hf_config = dict(hf_config, jspec_mtp={"num_modules": num_modules, "layout": layout,
                                               "own_lm_head": own_lm_head})
    sources = {path: (headers[name][0], name, transpose) for name, (path, _, transpose) in expected.items()}
    return _MtpPlan(mtp_hf_config, sources)


def _deepseek_copies(headers: dict[str, tuple[str, tuple[int, ...]]], mtp_names: set[str], config: ModelConfig,
                     num_modules: int) -> tuple[list[bool], set[str]]:
    """DeepSeek modules' ``embed_tokens`` / ``shared_head.head`` against the target's embedding / lm_head ->
    (per module: keeps its own lm_head?, the copies to drop). An absent copy means the target's; a differing
    embedding is a ValueError; a misshapen shared_head.head is kept, to be reported with the module's tensors."""
    target = {"model.embed_tokens.weight": "model.embed_tokens.weight",
              "lm_head.weight": "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"}
    cache: dict[str, np.ndarray] = {}

    def target_tensor(name: str) -> np.ndarray | None:
        source = target[name]
        if source not in cache and source in headers:
            cache.clear()  # one target tensor in memory at a time
            cache[source] = _read_tensor(headers[source][0], source)
        return cache.get(source)

    own_lm_head, dropped = [], set()
    for index in range(num_modules):
        prefix = module_prefix("deepseek", index, config.num_layers)
        own = False
        for suffix, copied in DEEPSEEK_COPIES.items():
            name = prefix + suffix
            if name not in mtp_names:
                continue  # no copy: the target's tensor, as when the copy is equal
            reference = target_tensor(copied)
            if reference is None or headers[name][1] != reference.shape:
                if suffix == "shared_head.head.weight":
                    own = True  # its shape is checked with the module's other tensors
                    continue
                raise ValueError(f"MTP tensor {name}: got {headers[name][1]}, expected "
                                 f"{(config.vocab_size, config.hidden_size)} (a copy of the target's embedding)")
            equal = np.array_equal(_read_tensor(headers[name][0], name), reference)
            if suffix == "embed_tokens.weight" and not equal:
                raise ValueError(f"MTP tensor {name} differs from the target's {target[copied]}: modules with an "
                                 f"embedding of their own are not supported (jspec's MTP drafter embeds with the "
                                 f"target's table)")
            if equal:
                dropped.add(name)
            else:
                own = True
        own_lm_head.append(own)
    return own_lm_head, dropped


def _stream_mtp_leaves(plan: _MtpPlan, dtype, on_tensor: Callable[[], None] = lambda: None
                       ) -> Iterator[tuple[tuple[str, ...], np.ndarray]]:
    """Yields (param path, array) for every module parameter, one tensor read (and cast) at a time."""
    np_dtype = np.dtype(dtype)
    for path, (file, name, transpose) in plan.sources.items():
        array = _read_tensor(file, name)
        array = np.ascontiguousarray(array.T if transpose else array, dtype=np_dtype)
        on_tensor()
        yield path, array
        del array


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
    shards = _indexed_shards(src, "pytorch_model.bin.index.json")
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


def _eagle3_tensor_files(src: str) -> tuple[list[str], Callable[[list[str]], Iterator[tuple[str, np.ndarray]]]]:
    """(files, reader): safetensors when the directory has any, else EAGLE's pytorch_model.bin."""
    if any(f.endswith(".safetensors") for f in os.listdir(src)) \
            or os.path.isfile(os.path.join(src, "model.safetensors.index.json")):
        return safetensors_files(src), iter_safetensors
    return torch_bin_files(src), iter_torch_bin


def looks_like_eagle3(names: list[str]) -> bool:
    """Whether HF tensor names are an EAGLE-3 head's: fc.weight plus a midlayer./layers.0. decoder layer."""
    stripped = {canonical_tensor_name(n) for n in names}
    return "fc.weight" in stripped and any(n.startswith("midlayer.") for n in stripped)


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
    files, reader = _eagle3_tensor_files(src)
    if reader is iter_torch_bin:  # EAGLE's own heads say LlamaForCausalLM and ship a pickle
        return "eagle3" if looks_like_eagle3([name for name, _ in reader(files)]) else "llama"
    return "eagle3" if looks_like_eagle3(tensor_names(files)) else "llama"


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


def _check_eagle3_layers(hf_config: dict) -> None:
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
    with _naming_config(src):
        _, flat_config = resolve_layout(hf_config, src)
        _check_eagle3_layers(flat_config)
        config = eagle3_config_from_hf(flat_config)
    dtype = resolve_dtype(dtype, flat_config)
    files, reader = _eagle3_tensor_files(src)
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
    head = hf_to_params(head_tensors(tensors), _abstract_eagle3_head(config, dtype), DTYPES[dtype],
                        eagle3_param_path)
    d2t = _eagle3_d2t(found.get("d2t"), config.draft_vocab_size, config.target_vocab_size)
    with atomic_directory(dst, overwrite) as out:
        write_jspec_dir(out, flat_config, {"head": head, "d2t": jnp.asarray(d2t)}, "eagle3", dtype, src)
    return os.path.abspath(dst)


