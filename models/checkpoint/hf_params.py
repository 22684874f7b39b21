"""HF tensors -> a param tree: each tensor name mapped to its param path and checked against the shapes of the
abstract params (every missing, unexpected and misshapen tensor reported at once), and what every converter
shares (the dtype to write, config.json named in its errors).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from models.checkpoint.store import DTYPES

# Tensors some HF checkpoints carry that hold nothing we need (rope tables are recomputed).
UNUSED_TENSOR = re.compile(r".*rotary_emb\.inv_freq$")


def expected_shapes(abstract_params: Any) -> dict[tuple[str, ...], tuple[tuple[int, ...], Any]]:
    """Flat param path -> (shape, dtype) of every leaf of ``abstract_params`` (layers stacked: [L, ...])."""
    flat = traverse_util.flatten_dict(abstract_params)
    return {path: (tuple(leaf.shape), leaf.dtype) for path, leaf in flat.items()}


def stacked_index(index: int | tuple[int, ...] | None) -> tuple[int, ...]:
    """A tensor's place on its param's stacked axes: None (not stacked) -> (), a layer -> (layer,), a (layer, expert)
    as it is."""
    if index is None:
        return ()
    return (index,) if isinstance(index, int) else tuple(index)


class TensorCheck:
    """Matches HF tensors (name, shape) to the param paths of ``abstract_params`` and collects every missing,
    unexpected and misshapen tensor, to be raised at once by ``raise_problems``. ``name_to_path``: name -> (param
    path, index on its stacked axes: None, a layer, or (layer, expert); transpose?) or None."""

    def __init__(self, abstract_params: Any,
                 name_to_path: Callable[[str], tuple[tuple[str, ...], Any, bool] | None],
                 ignore: Callable[[str], bool] = lambda name: False):
        self.expected = expected_shapes(abstract_params)
        self.name_to_path, self.ignore = name_to_path, ignore
        self.filled: dict[tuple[str, ...], set[tuple[int, ...]]] = {}
        self.unexpected: list[str] = []
        self.misshapen: list[str] = []

    def place(self, name: str, shape: tuple[int, ...]) -> tuple[tuple[str, ...], Any, bool] | None:
        """(param path, index, transpose?) for a tensor that fits; None for one ignored or reported."""
        if UNUSED_TENSOR.match(name) or self.ignore(name):
            return None
        mapped = self.name_to_path(name)
        if mapped is None or mapped[0] not in self.expected:
            self.unexpected.append(name)
            return None
        path, index, transpose = mapped
        at = stacked_index(index)
        want_shape, _ = self.expected[path]
        want = want_shape[len(at):]
        got = tuple(shape)[::-1] if transpose else tuple(shape)
        self.filled.setdefault(path, set()).add(at)  # misshapen: reported once
        if got != want or any(i >= n for i, n in zip(at, want_shape)):
            self.misshapen.append(f"{name}: got {tuple(shape)}, expected {want if not transpose else want[::-1]}"
                                  + (f" (at {at} of {want_shape[:len(at)]})" if at else ""))
            return None
        return mapped

    def raise_problems(self) -> None:
        missing = []
        for path, (shape, _) in self.expected.items():
            filled = self.filled.get(path, set())
            arity = 0 if path[0] != "layers" else 2 if "experts" in path else 1
            if filled:  # as the checkpoint indexes it: gpt-oss stores a layer's experts in one tensor
                arity = len(next(iter(filled)))
            absent = sorted(set(itertools.product(*map(range, shape[:arity]))) - filled)
            if absent:
                where = ("" if not arity else f" (layers {[at[0] for at in absent]})" if arity == 1
                         else f" (layer, expert {absent[:8]}{' ...' if len(absent) > 8 else ''})")
                missing.append("/".join(path) + where)
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
    misshapen tensor at once. (``convert_hf_llama`` streams instead: ``hf_llama``.)
    """
    check = TensorCheck(abstract_params, name_to_path, ignore)
    np_dtype = np.dtype(dtype)
    buffers: dict[tuple[str, ...], np.ndarray] = {}
    for name, array in tensors:
        placed = check.place(name, array.shape)
        if placed is None:
            continue
        path, index, transpose = placed
        if path not in buffers:
            buffers[path] = np.empty(check.expected[path][0], np_dtype)
        buffers[path][stacked_index(index)] = array.T if transpose else array
    check.raise_problems()
    return traverse_util.unflatten_dict({p: jnp.asarray(a) for p, a in buffers.items()})


@contextlib.contextmanager
def naming_config(src: str) -> Iterator[None]:
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
