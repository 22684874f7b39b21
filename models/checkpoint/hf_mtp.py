"""MTP modules inside a Hugging Face target checkpoint (layouts: models/checkpoint/mtp_layouts.py): checked from
the safetensors headers, then read one tensor at a time into ``mtp/`` beside the target (see ``convert_hf_llama``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np
from flax import traverse_util

from models.checkpoint.mtp_layouts import (DEEPSEEK_COPIES, abstract_module, module_hf_names, module_prefix,
                                          split_mtp_name)
from models.checkpoint.safetensors_io import read_tensor
from models.config import ModelConfig


class MtpPlan(NamedTuple):
    """What ``plan_mtp`` checked, to be written into ``mtp/`` by ``stream_mtp_leaves``."""

    hf_config: dict  # the target's config.json + "jspec_mtp": {num_modules, layout, own_lm_head}
    # param path -> [(expert or None, file, tensor name, transpose?)]: one tensor, or one per expert of a stack
    sources: dict[tuple[str, ...], list[tuple[int | None, str, str, bool]]]
    shapes: dict[tuple[str, ...], tuple[int, ...]]  # param path -> its shape


def _num_mtp_modules(hf_config: dict) -> int:
    value = hf_config.get("num_nextn_predict_layers")
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"config.json num_nextn_predict_layers={value!r}: expected an integer >= 0 (the number "
                         f"of MTP modules)")
    return value


def plan_mtp(headers: dict[str, tuple[str, tuple[int, ...]]], mtp_names: set[str], hf_config: dict,
             config: ModelConfig, dtype) -> MtpPlan | None:
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
    # HF name -> (path, HF shape, transpose?, expert or None)
    expected: dict[str, tuple[tuple[str, ...], tuple[int, ...], bool, int | None]] = {}
    shapes: dict[tuple[str, ...], tuple[int, ...]] = {}
    for index in range(num_modules):
        module = abstract_module(mtp_config.layer, dtype, own_lm_head[index])
        for name, (path, shape, transpose, expert) in module_hf_names(layout, index, config.num_layers,
                                                                       module).items():
            expected[name] = (("modules", str(index)) + path, shape, transpose, expert)
        shapes.update({("modules", str(index)) + path: tuple(leaf.shape)
                       for path, leaf in traverse_util.flatten_dict(module).items()})
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
    sources: dict[tuple[str, ...], list[tuple[int | None, str, str, bool]]] = {}
    for name, (path, _, transpose, expert) in expected.items():
        sources.setdefault(path, []).append((expert, headers[name][0], name, transpose))
    return MtpPlan(mtp_hf_config, sources, shapes)


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
            cache[source] = read_tensor(headers[source][0], source)
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
            equal = np.array_equal(read_tensor(headers[name][0], name), reference)
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


def stream_mtp_leaves(plan: MtpPlan, dtype, on_tensor: Callable[[], None] = lambda: None,
                      read: Callable[..., np.ndarray] | None = None) -> Iterator[tuple[tuple[str, ...], np.ndarray]]:
    """Yields (param path, array) for every module parameter, one tensor read (and cast) at a time. read: (file,
    name) -> the tensor (None: ``read_tensor``; a quantized checkpoint's dequantizing reader)."""
    np_dtype = np.dtype(dtype)
    read = read or read_tensor
    for path, sources in plan.sources.items():
        array = np.empty(plan.shapes[path], np_dtype)
        for expert, file, name, transpose in sources:
            tensor = read(file, name)
            array[() if expert is None else expert] = tensor.T if transpose else tensor
            on_tensor()
        yield path, array
        del array
