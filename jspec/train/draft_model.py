"""Distilling a small Llama draft model (1-2 layers) from a frozen target, on the stdlib corpus.

Loss: cross-entropy of the draft's next-token distribution against the target's (soft labels, the target's own
softmax at every position of a window of real text). The draft starts from the target's embedding, final norm
(and lm_head when untied) and its first ``num_layers`` layers, so it begins as a truncated target and learns to
make up for the missing depth. Same loop, checkpoints and HF export as the target (``jspec/train/target.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jspec.train.target import (TrainConfig, causal_lm_logits, corpus_for, export_hf, heldout_windows,
                                load_hf_llama, train_loop)
from models.config import ModelConfig, from_hf_config


def draft_hf_config(target_hf: dict, num_layers: int) -> dict:
    """The target's config.json with ``num_layers`` layers."""
    return dict(target_hf, num_hidden_layers=num_layers, torch_dtype="float32")


def init_draft_from_target(params_t: Any, num_layers: int) -> Any:
    """The target's params with only the first ``num_layers`` (stacked) layers kept."""
    return {name: (jax.tree.map(lambda a: jnp.asarray(a[:num_layers]), value) if name == "layers"
                   else jax.tree.map(jnp.asarray, value))
            for name, value in params_t.items()}


def distill_loss(params_d: Any, windows: jax.Array, *, params_t: Any, target: ModelConfig,
                 draft: ModelConfig) -> jax.Array:
    """Mean over positions of CE(target softmax, draft softmax) on windows: i32[B, T + 1] (last token unused)."""
    tokens = windows[:, :-1]
    teacher = jax.nn.softmax(jax.lax.stop_gradient(causal_lm_logits(params_t, tokens, target)), axis=-1)
    student = jax.nn.log_softmax(causal_lm_logits(params_d, tokens, draft), axis=-1)
    return -jnp.sum(teacher * student, axis=-1).mean()


def train_draft_model(out_dir: str, target_dir: str, work_dir: str, train: TrainConfig, num_layers: int = 2,
                      corpus_root: str | None = None, progress: bool = True,
                      log: Callable[[str], None] = print) -> dict:
    """Distills a ``num_layers``-layer draft model from the HF target at ``target_dir``; writes it (HF layout,
    with the target's tokenizer) to ``out_dir``. Resumable (orbax, ``work_dir/checkpoints``)."""
    started = time.perf_counter()
    target, params_t, target_hf = load_hf_llama(target_dir)
    if not 1 <= num_layers <= target.num_layers:
        raise ValueError(f"num_layers={num_layers}: expected 1..{target.num_layers} (the target's depth)")
    tokenizer, splits = corpus_for(target_dir, work_dir, corpus_root)
    hf_config = draft_hf_config(target_hf, num_layers)
    draft = from_hf_config(hf_config)
    loss = functools.partial(distill_loss, params_t=params_t, target=target, draft=draft)
    held = jnp.asarray(heldout_windows(splits["heldout"], train.eval_batches * train.batch_size,
                                       train.seq_len + 1))
    eval_fn = jax.jit(lambda params: jnp.mean(jnp.stack([
        loss(params, held[i:i + train.batch_size]) for i in range(0, len(held), train.batch_size)])))
    params, report = train_loop(init_draft_from_target(params_t, num_layers), loss, train, splits["train"],
                                work_dir, lambda p: float(eval_fn(p)), progress, log, desc="draft")
    export_hf(out_dir, hf_config, params, tokenizer)
    summary = {"train_config": dataclasses.asdict(train), "num_layers": num_layers,
               "heldout_distill_loss": report["heldout"][-1][1], "heldout_curve": report["heldout"],
               "first_losses": report["losses"][:5], "last_losses": report["losses"][-5:],
               "wall_seconds": time.perf_counter() - started}
    with open(os.path.join(out_dir, "train_report.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary
