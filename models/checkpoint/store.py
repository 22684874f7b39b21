"""The jspec checkpoint directory: what ``convert_hf_checkpoint`` writes and ``load_llama``/``load_eagle3``/
``load_mtp``/``load_dflash`` read.

A converted directory holds::

    config.json        the Hugging Face config (verbatim for targets; for EAGLE-3 heads the flat Llama-style config
                       plus "jspec_eagle3": layout, resolved tap layers, suggested num_steps)
    jspec.json         {"format": 3, "kind": "llama" | "eagle3" | "mtp" | "dflash", "dtype": "bfloat16"}
    params/            the parameter pytree (eagle3: {"head": head params, "d2t": i32[V_draft]}) as orbax
                       checkpoints of consecutive groups of leaves, see below
    tokenizer.json ... tokenizer files copied from the source when present
    mtp/               a target's MTP modules, when its checkpoint ships them: a jspec directory of kind "mtp"
                       (config.json: the target's plus "jspec_mtp": {num_modules, layout, own_lm_head}; params:
                       {"modules": {"0": module tree, ...}}, see models/mtp.py)

params/ (format 3)::

    leaves.json        {"leaves": [[key, ...], ...], "groups": [[leaf index, ...], ...]}: every leaf's path, in the
                       order written, and the leaves of each group (consecutive indices)
    group-<g>/         one orbax checkpoint of group g's leaves, as the tree {a: {b: {c: array}}, ...} of their paths

A group closes once its arrays reach ``GROUP_BYTES``; a leaf that would take the open group past it starts a new
one, so a leaf bigger than the budget is a group of its own. Converting needs host memory for the open group (under
the budget) plus the leaf being built, not the model; a small model is one checkpoint. Older layouts still load:
format 2 (leaves.json without "groups", params/<a.b.c>/ one orbax checkpoint of the leaf at path (a, b, c)) and
format 1 (no leaves.json, params/ one orbax checkpoint of the whole tree).

Directories are written into a temporary sibling and renamed into place at the end (``atomic_directory``), so a
failed write leaves nothing at the destination.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from models.checkpoint.mtp_layouts import MTP_DIR, abstract_module
from models.config import ModelConfig, from_hf_config
from models.quantization import QuantizationConfig, as_stored, from_stored, is_quantized, quantize_params

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
FORMAT_VERSION = 3
LEAVES_FILE = "leaves.json"  # in params/ of formats 2 and 3 (see the module doc)
# A group of leaves closes at this many bytes. Past some tens of MB an orbax save's fixed cost (12-20 ms: directories,
# OCDBT merge, metadata) is small beside the write itself, and a larger budget only adds to converting's host memory.
GROUP_BYTES = 64 << 20


def save_params(directory: str, params: Any) -> None:
    """Writes params at ``directory`` (which must not exist) as orbax checkpoints of consecutive groups of leaves,
    each closed at ``GROUP_BYTES`` (see the module doc).

    params: a nested dict of arrays, or an iterable of (path, array) pairs, path a tuple of keys. An iterator's
    arrays are held until their group is written and dropped then, so a generator that builds each leaf on demand
    bounds the host memory by about ``GROUP_BYTES`` plus one leaf.
    """
    import orbax.checkpoint as ocp

    leaves = traverse_util.flatten_dict(params).items() if isinstance(params, Mapping) else params
    directory = os.path.abspath(directory)
    os.makedirs(directory)
    paths: list[tuple[str, ...]] = []  # every leaf's, in the order drawn
    groups: list[list[int]] = []  # each written group's leaves, as indices into paths
    group: dict[tuple[str, ...], Any] = {}  # the open group (the last len(group) paths) -> their arrays
    with _numpy_saved_in_place(), ocp.StandardCheckpointer() as checkpointer:
        def write_group() -> None:
            checkpointer.save(os.path.join(directory, _group_dir(len(groups))), traverse_util.unflatten_dict(group))
            checkpointer.wait_until_finished()
            groups.append(list(range(len(paths) - len(group), len(paths))))
            group.clear()  # before the iterator builds the next leaf
            _return_freed_memory()

        for path, array in leaves:
            path = _checked_path(path)
            if path in paths:
                raise ValueError(f"param {'/'.join(path)} given twice")
            if group and _nbytes(group) + array.nbytes > GROUP_BYTES:
                write_group()
            paths.append(path)
            group[path] = array
            del array  # the open group holds it now, and drops it once written
            if _nbytes(group) >= GROUP_BYTES:
                write_group()
        if group:
            write_group()
    with open(os.path.join(directory, LEAVES_FILE), "w") as f:
        json.dump({"leaves": [list(path) for path in paths], "groups": groups}, f, indent=1)


def _nbytes(group: dict[tuple[str, ...], Any]) -> int:
    return sum(array.nbytes for array in group.values())


@contextlib.contextmanager
def _numpy_saved_in_place() -> Iterator[None]:
    """Orbax saves numpy arrays from the arrays themselves, not from a copy, while inside.

    Orbax's numpy handler deep-copies every host array before its asynchronous write, so that the caller may
    change it meanwhile; ``save_params`` waits for each write instead, and the copy would double the memory a
    leaf needs. The handler registered for np.ndarray is swapped for the duration and put back after.
    """
    from orbax.checkpoint import type_handlers

    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)  # orbax warns on every override of a registered handler
    default = type_handlers.get_type_handler(np.ndarray)
    type_handlers.register_type_handler(np.ndarray, type_handlers.NumpyHandler(deepcopy_host_arrays=False),
                                        override=True)
    try:
        yield
    finally:
        type_handlers.register_type_handler(np.ndarray, default, override=True)
        absl_logger.setLevel(level)


def _return_freed_memory() -> None:
    """Hands the heap memory freed since the last call back to the OS (glibc's malloc_trim; elsewhere nothing).

    The buffers tensorstore allocates while writing a leaf are freed into malloc's arenas, which keep them; left
    there, they add a few hundred MB to the next leaf's peak."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _checked_path(path: Iterable[str]) -> tuple[str, ...]:
    path = tuple(path)
    if any("." in key or "/" in key for key in path):
        raise ValueError(f"param path {path}: keys must not contain '.' or '/'")
    return path


def _group_dir(index: int) -> str:
    """params/'s subdirectory holding group ``index`` (format 3)."""
    return f"group-{index}"


def _leaf_dir(path: tuple[str, ...]) -> str:
    """params/'s subdirectory holding the leaf at ``path`` (format 2)."""
    return ".".join(_checked_path(path))


def load_params(directory: str, abstract_params: Any, shardings: Callable[[Any], Any] | None = None) -> Any:
    """Restores an orbax param checkpoint into the structure/dtypes of ``abstract_params``.

    shardings: abstract params -> a tree of ``jax.sharding.Sharding`` (one per leaf): orbax reads each parameter
    straight into its sharding, every device only its own shard (no whole copy on one device or host). None: every
    array lands on this process's first device, whatever device the checkpoint was written from (orbax otherwise
    restores the saved sharding and refuses a CPU-written checkpoint on a GPU).
    """
    import orbax.checkpoint as ocp

    if shardings is None:
        single = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        placement = jax.tree.map(lambda _: single, abstract_params)
    else:
        placement = shardings(abstract_params)
    placed = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_params,
                          placement)
    directory = os.path.abspath(directory)
    leaves_file = os.path.join(directory, LEAVES_FILE)
    with ocp.StandardCheckpointer() as checkpointer:
        if not os.path.isfile(leaves_file):  # format 1: one checkpoint of the whole tree
            return checkpointer.restore(directory, placed)
        with open(leaves_file) as f:
            listing = json.load(f)
        stored = [tuple(path) for path in listing["leaves"]]
        wanted = traverse_util.flatten_dict(placed)
        if set(stored) != set(wanted):
            missing = sorted("/".join(p) for p in set(wanted) - set(stored))
            unexpected = sorted("/".join(p) for p in set(stored) - set(wanted))
            raise ValueError(f"{leaves_file}: the stored params do not match the model; missing: {missing}, "
                             f"unexpected: {unexpected}")
        if "groups" in listing:  # format 3: a checkpoint per group of leaves
            parts = [(_group_dir(index), [stored[leaf] for leaf in leaves])
                     for index, leaves in enumerate(listing["groups"])]
        else:  # format 2: a checkpoint per leaf
            parts = [(_leaf_dir(path), [path]) for path in stored]
        restored = {}
        for name, paths in parts:
            tree = checkpointer.restore(os.path.join(directory, name),
                                        traverse_util.unflatten_dict({path: wanted[path] for path in paths}))
            restored.update(traverse_util.flatten_dict(tree))
    return traverse_util.unflatten_dict({path: restored[path] for path in wanted})


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


def write_jspec_dir(out: str, hf_config: dict, params: Any | Iterable[tuple[tuple[str, ...], Any]], kind: str,
                    dtype: str, src: str | None, meta: dict | None = None) -> None:
    """Writes config.json, jspec.json, params/ and tokenizer files into the (temporary) directory ``out``.

    params: a param pytree, or (path, array) pairs drawn one at a time (see ``save_params``); meta: more jspec.json
    entries ("quantization": the scheme a quantized source was read from, ``models.checkpoint.hf_quantized``)."""
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    with open(os.path.join(out, "jspec.json"), "w") as f:
        json.dump({"format": FORMAT_VERSION, "kind": kind, "dtype": dtype, **(meta or {})}, f, indent=2)
    save_params(os.path.join(out, "params"), params)
    if src is not None:
        for name in TOKENIZER_FILES:
            path = os.path.join(src, name)
            if os.path.isfile(path):
                shutil.copy2(path, os.path.join(out, name))


def read_hf_config(src: str) -> dict:
    """config.json of a HF (or converted) directory; ValueError naming the file if it is not a JSON object."""
    if not os.path.isdir(src):
        raise FileNotFoundError(f"checkpoint directory {src!r} does not exist")
    path = os.path.join(src, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {src!r}")
    with open(path) as f:
        try:
            hf_config = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(hf_config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(hf_config).__name__}")
    return hf_config


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


def load_llama(model_dir: str, dtype: str | None = None,
               shardings: Callable[[ModelConfig, Any], Any] | None = None) -> tuple[ModelConfig, Any, str]:
    """Loads a converted Llama-family directory -> (config, params, dtype name). ``dtype`` casts if given;
    shardings: (config, abstract params) -> a Sharding per leaf, to restore each parameter into its sharding."""
    from models.llama import param_shapes

    meta = _read_kind(model_dir, "llama")
    config = from_hf_config(read_hf_config(model_dir))
    stored = meta["dtype"]
    quantization = stored_quantization(meta)
    abstract = jax.eval_shape(lambda params: quantize_params(params, quantization),
                              param_shapes(config, DTYPES[stored]))
    placement = None if shardings is None else lambda tree: as_stored(shardings(config, abstract))
    params = load_params(os.path.join(model_dir, "params"), as_stored(abstract), placement)
    return (config,) + _cast_params(from_stored(params, abstract), stored, dtype)


def stored_quantization(meta: dict) -> QuantizationConfig | None:
    """The scheme a converted directory's params are stored quantized in (jspec convert --quantization), from its
    jspec.json; None for float params (also those read from a quantized source, which only name a scheme)."""
    entry = meta.get("quantization") or {}
    if not entry.get("stored"):
        return None
    return QuantizationConfig(**{k: v for k, v in entry.items() if k != "stored"})


def _cast_params(params: Any, stored: str, dtype: str | None) -> tuple[Any, str]:
    """(params cast to ``dtype``, its name); unchanged when ``dtype`` is None or already the stored one."""
    if dtype is None or dtype == stored:
        return params, stored
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {sorted(DTYPES)}")
    return _cast_tree(params, dtype=dtype), dtype


@functools.partial(jax.jit, static_argnames=("dtype",))
def _cast_tree(params: Any, *, dtype: str) -> Any:
    """Every leaf cast to ``dtype`` in one program (one compilation, cached, instead of one per leaf shape); a
    quantized kernel's scale only (``QArray.astype``), its integers kept."""
    return jax.tree.map(lambda a: a.astype(DTYPES[dtype]), params, is_leaf=is_quantized)


def _read_kind(model_dir: str, kind: str) -> dict:
    meta = read_jspec_meta(model_dir)
    if meta.get("kind") != kind:
        raise ValueError(f"{model_dir!r} holds a {meta.get('kind')!r} checkpoint, expected {kind!r}")
    if meta.get("dtype") not in DTYPES:
        raise ValueError(f"{os.path.join(model_dir, 'jspec.json')}: dtype={meta.get('dtype')!r}, expected one of "
                         f"{sorted(DTYPES)}")
    return meta


def abstract_eagle3_head(config, dtype: str) -> Any:
    """The Eagle3Head param tree of ``config`` as jax.ShapeDtypeStruct leaves in dtype ``dtype`` (no memory)."""
    from models.eagle3 import eagle3_param_shapes

    return eagle3_param_shapes(config, DTYPES[dtype])


def load_eagle3(model_dir: str, dtype: str | None = None) -> tuple[Any, Any, jax.Array, str]:
    """Loads a converted EAGLE-3 directory -> (Eagle3Config, head params, d2t i32[V_draft], dtype name).

    ``dtype`` casts the head parameters if given (d2t stays int32).
    """
    from models.eagle3 import eagle3_config_from_hf

    meta = _read_kind(model_dir, "eagle3")
    config = eagle3_config_from_hf(read_hf_config(model_dir))
    stored = meta["dtype"]
    abstract = {"head": abstract_eagle3_head(config, stored),
                "d2t": jax.ShapeDtypeStruct((config.draft_vocab_size,), jnp.int32)}
    restored = load_params(os.path.join(model_dir, "params"), abstract)
    head, dtype_name = _cast_params(restored["head"], stored, dtype)
    return config, head, restored["d2t"], dtype_name



def abstract_dflash(config: Any, dtype: str) -> Any:
    """The DFlashDraft param tree of ``config`` as jax.ShapeDtypeStruct leaves in ``dtype`` (no memory)."""
    from models.dflash import dflash_param_shapes

    return dflash_param_shapes(config, DTYPES[dtype])


def load_dflash(model_dir: str, dtype: str | None = None) -> tuple[Any, Any, str]:
    """Loads a converted DFlash directory -> (DFlashConfig, params, dtype name); ``dtype`` casts if given."""
    from models.dflash import dflash_config_from_hf

    meta = _read_kind(model_dir, "dflash")
    config = dflash_config_from_hf(read_hf_config(model_dir))
    stored = meta["dtype"]
    params = load_params(os.path.join(model_dir, "params"), abstract_dflash(config, stored))
    return (config,) + _cast_params(params, stored, dtype)



def has_mtp(target_dir: str) -> bool:
    """Whether the converted target at ``target_dir`` carries MTP modules (``target_dir/mtp/``, kind "mtp")."""
    path = os.path.join(target_dir, MTP_DIR, "jspec.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        return json.load(f).get("kind") == "mtp"


def load_mtp(target_dir: str, dtype: str | None = None) -> tuple[Any, dict]:
    """Loads the MTP modules of a converted target -> (MtpConfig, {"modules": (module params, ...)}), each module
    the tree of models/mtp.py. ``dtype`` casts if given. FileNotFoundError when the target has none."""
    from models.mtp import MtpConfig

    mtp_dir = os.path.join(target_dir, MTP_DIR)
    if not has_mtp(target_dir):
        raise FileNotFoundError(f"{target_dir!r} has no MTP modules (no {MTP_DIR}/ of kind 'mtp'): they come from a "
                                f"checkpoint whose config.json has num_nextn_predict_layers > 0 and which ships their "
                                f"tensors (docs/checkpoints.md)")
    meta = _read_kind(mtp_dir, "mtp")
    hf_config = read_hf_config(mtp_dir)
    info = hf_config.get("jspec_mtp")
    if not isinstance(info, dict) or not isinstance(info.get("own_lm_head"), list):
        raise ValueError(f"{os.path.join(mtp_dir, 'config.json')}: jspec_mtp={info!r}, expected "
                         f"{{num_modules, layout, own_lm_head: [bool per module]}}")
    config = MtpConfig.for_target(from_hf_config(hf_config), info.get("num_modules"), info.get("layout"))
    if len(info["own_lm_head"]) != config.num_modules:
        raise ValueError(f"{os.path.join(mtp_dir, 'config.json')}: jspec_mtp.own_lm_head has "
                         f"{len(info['own_lm_head'])} entries, expected num_modules={config.num_modules}")
    stored = meta["dtype"]
    abstract = {"modules": {str(index): abstract_module(config.layer, DTYPES[stored], bool(own))
                            for index, own in enumerate(info["own_lm_head"])}}
    restored = load_params(os.path.join(mtp_dir, "params"), abstract)
    modules, _ = _cast_params(restored["modules"], stored, dtype)
    return config, {"modules": tuple(modules[str(index)] for index in range(config.num_modules))}
