"""Training a PARD draft model (AMD's PARallel Draft): one causal LM that drafts K tokens in one forward.

At inference (``jspec/drafters/pard.py``) the draft reads ``[x_1 .. x_R, pard x (K - 1)]``; the real token at R
predicts x_{R+1} and the j-th ``pard_token`` (position R + j) predicts x_{R+j+1}. Training packs every such query
of a window into one forward of K copies (PARD's shifted mask copies): copy 0 is the window's real tokens, copy
k >= 1 is ``pard_token`` at every position, and the token (k, p) stands for "the k-th pard after the real token at
p - k". It sees what that pard sees at inference: the real tokens at <= p - k and, for q in (p - k, p], the
(q - p + k)-th pard at q. Each (k, p) predicts x_{p+1}, its label the frozen target's distribution there (soft
labels, as ``draft_model.py`` distils; AMD trains on the data's tokens). Copies are weighted equally; AMD's
conditional drop (a random share of copy k's tokens left out to save compute) is not done here: every copy runs
whole. The mask depends only on (K, window width): numpy at trace time.
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
import numpy as np

from jspec.train.dflash import resolve_mask_token_id
from jspec.train.draft_model import draft_hf_config, init_draft_from_target
from jspec.train.target import (TrainConfig, causal_lm_logits, corpus_for, export_hf, heldout_mean, load_hf_llama,
                                train_loop)
from models.attention import KVCache
from models.config import ModelConfig, from_hf_config
from models.llama import LlamaModel


@functools.cache
def copies_mask(num_copies: int, width: int) -> np.ndarray:
    """bool[K * W, K * W]: row (k, p) (index k * W + p) sees column (j, q) (module docstring). Rows k >= 1 with
    p < k stand for no inference query (no real token before them); they see themselves only and carry no loss."""
    k, p = np.divmod(np.arange(num_copies * width), width)
    j, q = k[None, :], p[None, :]
    k, p = k[:, None], p[:, None]
    real = (j == 0) & (q <= p - k)
    pards = (j >= 1) & (q > p - k) & (q <= p) & (j == q - p + k)
    return real | pards | (np.eye(num_copies * width, dtype=bool) & (p < k))


def copies_valid(num_copies: int, width: int) -> np.ndarray:
    """bool[K, W]: the (k, p) that stand for an inference query: a real token before the run of k pards (p >= k).
    Every one has a label: the window carries one token past its W inputs."""
    k, p = np.meshgrid(np.arange(num_copies), np.arange(width), indexing="ij")
    return p >= k


def pard_logits(params_d: Any, tokens: jax.Array, *, draft: ModelConfig, num_copies: int,
                pard_token: int) -> jax.Array:
    """tokens: i32[B, W] -> f32[B, K, W, V]: the draft's logits at every (copy, position) of one packed forward."""
    batch, width = tokens.shape
    ids = jnp.concatenate([tokens, jnp.full((batch, (num_copies - 1) * width), pard_token, jnp.int32)], axis=1)
    positions = jnp.broadcast_to(jnp.tile(jnp.arange(width, dtype=jnp.int32), num_copies), ids.shape)
    mask = jnp.broadcast_to(jnp.asarray(copies_mask(num_copies, width)), (batch,) + (num_copies * width,) * 2)
    cache = KVCache.zeros(draft.num_layers, batch, num_copies * width, draft.num_kv_heads, draft.head_dim,
                          jnp.float32)
    out = LlamaModel(draft).apply({"params": params_d}, ids, positions, cache, jnp.zeros((batch,), jnp.int32),
                                  local_mask=mask)
    return out.logits.reshape(batch, num_copies, width, -1)


def pard_metrics(params_d: Any, windows: jax.Array, *, params_t: Any, target: ModelConfig, draft: ModelConfig,
                 num_copies: int, pard_token: int) -> dict[str, jax.Array]:
    """windows: i32[B, W + 1] -> {"loss": mean CE(target softmax, draft) over every valid (copy, position),
    "accuracy": f32[K] top-1 agreement with the target per copy (copy k drafts token k + 1 of a chain)}."""
    tokens = windows[:, :-1]
    teacher = jax.nn.softmax(jax.lax.stop_gradient(causal_lm_logits(params_t, tokens, target)), axis=-1)
    logits = pard_logits(params_d, tokens, draft=draft, num_copies=num_copies, pard_token=pard_token)
    valid = jnp.asarray(copies_valid(num_copies, tokens.shape[1]))[None]          # [1, K, W]
    cross_entropy = -jnp.sum(teacher[:, None] * jax.nn.log_softmax(logits, axis=-1), axis=-1)
    loss = jnp.sum(cross_entropy * valid) / (jnp.sum(valid) * tokens.shape[0])
    agree = (jnp.argmax(logits, axis=-1) == jnp.argmax(teacher, axis=-1)[:, None]) & valid
    accuracy = jnp.sum(agree, axis=(0, 2)) / (jnp.sum(valid, axis=(0, 2)) * tokens.shape[0])
    return {"loss": loss, "accuracy": accuracy}


def train_pard(out_dir: str, target_dir: str, work_dir: str, train: TrainConfig, num_layers: int = 2,
               num_copies: int = 8, pard_token: int | None = None, corpus_root: str | None = None,
               progress: bool = True, log: Callable[[str], None] = print) -> dict:
    """Distils a ``num_layers``-layer PARD draft of ``num_copies`` (K) drafts per forward from the HF target at
    ``target_dir`` (starting as the truncated target, as ``draft_model``); writes it in AMD's layout (a Llama
    config.json with ``pard_token`` and ``spd_type`` "pard", the target's tokenizer) to ``out_dir``. Resumable
    (orbax, ``work_dir/checkpoints``)."""
    started = time.perf_counter()
    if isinstance(num_copies, bool) or not isinstance(num_copies, int) or num_copies < 2:
        raise ValueError(f"num_copies={num_copies!r}: expected an integer >= 2 (the drafts per forward)")
    target, params_t, target_hf = load_hf_llama(target_dir)
    if not 1 <= num_layers <= target.num_layers:
        raise ValueError(f"num_layers={num_layers}: expected 1..{target.num_layers} (the target's depth)")
    if pard_token is not None and not 0 <= pard_token < target.vocab_size:
        raise ValueError(f"pard_token={pard_token}: expected an id below the target's vocab_size={target.vocab_size}")
    tokenizer, splits = corpus_for(target_dir, work_dir, corpus_root)
    if pard_token is None:
        pard_token = resolve_mask_token_id(tokenizer, target.vocab_size)
    hf_config = dict(draft_hf_config(target_hf, num_layers), pard_token=pard_token, spd_type="pard")
    draft = from_hf_config(hf_config)
    metrics = functools.partial(pard_metrics, params_t=params_t, target=target, draft=draft, num_copies=num_copies,
                                pard_token=pard_token)
    held = heldout_mean(metrics, splits["heldout"], train)
    params, report = train_loop(init_draft_from_target(params_t, num_layers), lambda p, w: metrics(p, w)["loss"],
                                train, splits["train"], work_dir, lambda p: float(held(p)["loss"]), progress, log,
                                desc="pard", metrics_fn=metrics)
    accuracy = [round(float(a), 4) for a in held(params)["accuracy"]]
    export_hf(out_dir, hf_config, params, tokenizer)
    summary = {"train_config": dataclasses.asdict(train), "num_layers": num_layers, "num_copies": num_copies,
               "pard_token": pard_token, "heldout_loss": report["heldout"][-1][1], "heldout_accuracy": accuracy,
               "heldout_curve": report["heldout"], "first_losses": report["losses"][:5],
               "last_losses": report["losses"][-5:], "wall_seconds": time.perf_counter() - started}
    with open(os.path.join(out_dir, "train_report.json"), "w") as f:
        json.dump(summary, f, indent=2)
    log(f"held-out loss {summary['heldout_loss']:.3f}, top-1 agreement per draft {accuracy}; wrote {out_dir}")
    return summary
