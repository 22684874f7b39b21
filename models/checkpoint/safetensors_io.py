"""Reading safetensors: the files of a HF directory (one, or the shards a ``*.index.json`` names), their tensor
names and shapes from the headers alone, and one tensor at a time straight into its array.

A file that is not safetensors (truncated, corrupt) raises ValueError naming it; a missing shard raises
FileNotFoundError naming it.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open


def safetensors_files(src: str) -> list[str]:
    """The .safetensors files of a HF directory: from model.safetensors.index.json when sharded."""
    shards = indexed_shards(src, "model.safetensors.index.json")
    if shards is not None:
        return shards
    files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {src!r}")
    return [os.path.join(src, f) for f in files]


def indexed_shards(src: str, index_name: str) -> list[str] | None:
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
def open_safetensors(path: str) -> Iterator[Any]:
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
        with open_safetensors(path) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def tensor_names(files: list[str]) -> list[str]:
    """The tensor names of the files (headers only, no data read)."""
    names = []
    for path in files:
        with open_safetensors(path) as f:
            names.extend(f.keys())
    return names


def count_tensors(files: list[str]) -> int:
    return len(tensor_names(files))


def tensor_headers(files: list[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """tensor name -> (file, shape), from the safetensors headers alone."""
    headers = {}
    for file in files:
        with open_safetensors(file) as f:
            for name in f.keys():
                headers[name] = (file, tuple(f.get_slice(name).get_shape()))
    return headers


# safetensors dtype -> numpy (ml_dtypes for bf16 and fp8, which numpy lacks); others are read through safe_open.
_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
                       "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
                       "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
                       "BOOL": np.bool_}


def read_tensor(file: str, name: str, out: np.ndarray | None = None) -> np.ndarray:
    """One tensor of a (checked, see ``hf_llama``) safetensors file, read straight from the file into its
    array: one copy in memory (safe_open's get_tensor holds two at its peak, and maps the file). ``out``: the
    array to fill, cast to its dtype; a contiguous ``out`` of the stored dtype is read into without a copy."""
    with open(file, "rb") as f:
        header_size = int.from_bytes(f.read(8), "little")
        info = json.loads(f.read(header_size))[name]
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:  # float8 and such: safetensors knows them
            with open_safetensors(file) as tensors:
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
