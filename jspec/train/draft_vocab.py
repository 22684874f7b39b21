"""Cutting a trained EAGLE-3 head's draft vocabulary down to its N most frequent tokens.

A head's draft vocabulary is a set of target ids (d2t: draft id d stands for target id d + d2t[d]); its lm_head has
one row per member. Keeping the N members most frequent in the training text keeps those rows as they are: for
every kept target id the head's logit is unchanged, so greedy drafting changes only where the head's top token
falls outside the kept set. This gives the acceptance-vs-draft-cost table over N (scripts/draft_vocab_table.py)
from one trained head instead of one training run per N. ``train-drafter --draft-vocab-size N`` trains a head
with N from the start.
"""

from __future__ import annotations

import json
import os

import numpy as np

__all__ = ["shrink_draft_vocab"]


def _kept_rows(target_ids: np.ndarray, tokens: np.ndarray, vocab_size: int, size: int) -> np.ndarray:
    """Rows (positions in the current draft vocabulary) of the ``size`` members most frequent in ``tokens``
    (ties: lower target id first), ascending."""
    counts = np.bincount(np.asarray(tokens, np.int64).ravel(), minlength=vocab_size)[:vocab_size]
    by_frequency = np.lexsort((target_ids, -counts[target_ids]))
    return np.sort(by_frequency[:size])


def shrink_draft_vocab(src: str, dst: str, size: int, tokens: np.ndarray, overwrite: bool = False) -> str:
    """Writes the HF EAGLE-3 head at ``src`` (config.json + model.safetensors with lm_head.weight and d2t, the
    layout SpecForge and ``train-drafter`` write) to ``dst`` with a draft vocabulary of ``size``: the members of
    src's most frequent in ``tokens`` (target ids, any shape), their lm_head rows unchanged, d2t and t2d
    recomputed, config.json's draft_vocab_size set. Every other tensor is copied. Nothing is left at ``dst`` on
    failure. Returns dst's absolute path."""
    from safetensors.numpy import load_file, save_file

    from models.checkpoint import atomic_directory

    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    for name in ("lm_head.weight", "d2t"):
        if name not in tensors:
            raise ValueError(f"{src}: no {name!r} tensor; expected an HF EAGLE-3 head with a draft vocabulary")
    current, vocab_size = tensors["lm_head.weight"].shape[0], int(config["vocab_size"])
    if tensors["d2t"].shape != (current,):
        raise ValueError(f"{src}: d2t has shape {tensors['d2t'].shape}, expected ({current},) like lm_head.weight")
    if not 0 < size <= current:
        raise ValueError(f"size={size}: expected 1..{current} (the head's draft vocabulary)")
    target_ids = np.arange(current) + tensors["d2t"].astype(np.int64)
    rows = _kept_rows(target_ids, tokens, vocab_size, size)
    kept = target_ids[rows]
    t2d = np.zeros(vocab_size, bool)
    t2d[kept] = True
    out = dict(tensors, **{"lm_head.weight": np.ascontiguousarray(tensors["lm_head.weight"][rows]),
                           "d2t": (kept - np.arange(size)).astype(tensors["d2t"].dtype), "t2d": t2d})
    with atomic_directory(dst, overwrite) as directory:
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(dict(config, draft_vocab_size=size), f, indent=2)
        save_file(out, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return os.path.abspath(dst)
