"""A tiny corpus (a few real stdlib modules) and a tiny trained target, for the few-step training tests."""

from __future__ import annotations

import os
import shutil

from jspec.train.corpus import stdlib_dir
from jspec.train.target import TrainConfig, llama_hf_config, train_target

# Small, stable stdlib modules: enough text for a 300-token BPE and a few dozen training windows.
MODULES = ("bisect.py", "colorsys.py", "keyword.py", "this.py", "sched.py", "reprlib.py", "glob.py",
           "fnmatch.py", "textwrap.py", "heapq.py")
HELD_OUT_FRACTION = 0.3  # puts at least one of MODULES in the held-out split
TINY_TARGET = llama_hf_config(vocab_size=300, hidden_size=32, num_layers=5, num_heads=4, num_kv_heads=2,
                              intermediate_size=64, max_position_embeddings=256)
FEW_STEPS = TrainConfig(steps=30, batch_size=4, seq_len=32, learning_rate=1e-2, warmup_steps=3,
                        checkpoint_every=10, eval_every=15, eval_batches=2)


def tiny_corpus(root: str) -> str:
    os.makedirs(root, exist_ok=True)
    for name in MODULES:
        shutil.copy(os.path.join(stdlib_dir(), name), os.path.join(root, name))
    return root


def train_tiny_target(tmp: str, train: TrainConfig = FEW_STEPS) -> tuple[str, dict, str]:
    """-> (HF dir, report, corpus root)."""
    corpus = tiny_corpus(os.path.join(tmp, "corpus"))
    out = os.path.join(tmp, "target_hf")
    report = train_target(out, os.path.join(tmp, "target_work"), TINY_TARGET, train, corpus_root=corpus,
                          held_out_fraction=HELD_OUT_FRACTION, progress=False, log=lambda line: None)
    return out, report, corpus


def loss_fell(losses: list[float], by: float) -> bool:
    """Mean of the last 5 losses is at least ``by`` below the mean of the first 3."""
    return sum(losses[-5:]) / 5 < sum(losses[:3]) / 3 - by
