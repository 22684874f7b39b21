"""Distilling an EAGLE-3 head from a frozen target, with EAGLE-3's training-time test.

Data: token sequences (ideally the target's own generations). The target runs once per batch, giving the
features (residual-stream inputs of layers 2, L//2, L-3) and its next-token distributions. The head is trained
to reproduce, at position p, the target's distribution for position p + 2 given (token p + 1, feature p) —
the pairing the drafter uses (jspec/drafters/eagle3.py). Training-time test: the head is unrolled
``unroll`` times; unroll step j replaces the feature at p by the head's own pre-norm output at p - 1 from step
j - 1, as drafting does at depth j + 1, and its loss is weighted by ``decay ** j``. (Simplification: at step j
the head attends to the step-j inputs of earlier positions, where drafting would see true-feature pairs
further back.)
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from models.attention import KVCache
from models.config import ModelConfig
from models.eagle3 import Eagle3Config, Eagle3Head
from models.llama import LlamaModel


class DistillBatch(NamedTuple):
    tokens: jax.Array        # i32[B, N]
    features: jax.Array      # f32[B, N, 3H] target features at each position
    target_probs: jax.Array  # f32[B, N, V_draft] the target's next-token distribution at each position
    valid: jax.Array         # bool[B, N] positions holding real tokens


@functools.partial(jax.jit, static_argnames=("target",))
def target_features(params_t: Any, tokens: jax.Array, *, target: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """tokens: i32[B, N] -> (features f32[B, N, 3H], logits f32[B, N, V]) from one causal target pass."""
    batch, width = tokens.shape
    cache = KVCache.zeros(target.num_layers, batch, width, target.num_kv_heads, target.head_dim, jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
    out = LlamaModel(target).apply({"params": params_t}, tokens, positions, cache, jnp.zeros((batch,), jnp.int32),
                                   tap_layers=Eagle3Config.tap_layers(target))
    return jnp.concatenate(list(out.taps), axis=-1), out.logits


def make_batch(params_t: Any, target: ModelConfig, tokens: np.ndarray, lengths: np.ndarray,
               t2d: np.ndarray | None = None) -> DistillBatch:
    """tokens: i32[B, N] right-padded, lengths: i32[B]; t2d: target ids kept in the draft vocab (None: all)."""
    features, logits = target_features(params_t, jnp.asarray(tokens), target=target)
    if t2d is not None:
        logits = logits[..., np.nonzero(t2d)[0]]
    valid = np.arange(tokens.shape[1])[None] < np.asarray(lengths)[:, None]
    return DistillBatch(jnp.asarray(tokens), features, jax.nn.softmax(logits, axis=-1), jnp.asarray(valid))


def distill_loss(head_params: Any, embedding: jax.Array, batch: DistillBatch, *, config: Eagle3Config,
                 unroll: int, decay: float) -> jax.Array:
    """Weighted cross-entropy (target distribution vs head) summed over the unrolled steps."""
    head = Eagle3Head(config)
    b, n = batch.tokens.shape
    tokens_next = jnp.concatenate([batch.tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)  # token p + 1
    targets = jnp.concatenate([batch.target_probs[:, 1:], jnp.zeros_like(batch.target_probs[:, :1])], axis=1)
    embeds = jnp.take(embedding, tokens_next, axis=0)
    positions = jnp.broadcast_to(jnp.arange(n), (b, n))
    cache = KVCache.zeros(1, b, n, config.layer.num_kv_heads, config.layer.head_dim, jnp.float32)
    hidden, total, weight_sum = batch.features, 0.0, 0.0
    for step in range(unroll):
        out = head.apply({"params": head_params}, embeds, hidden, positions, cache, jnp.zeros((b,), jnp.int32))
        # position p predicts p + 2 at step 0; step j's position p stands for depth j + 1 of a draft from p - j
        valid = batch.valid & (jnp.arange(n)[None] + 2 < batch.valid.sum(axis=1, keepdims=True))
        valid = valid & (jnp.arange(n)[None] >= step)
        ce = -jnp.sum(targets * jax.nn.log_softmax(out.logits), axis=-1)
        total += decay ** step * jnp.sum(jnp.where(valid, ce, 0.0)) / jnp.maximum(valid.sum(), 1)
        weight_sum += decay ** step
        hidden = jnp.concatenate([jnp.zeros_like(out.hidden[:, :1]), out.hidden[:, :-1]], axis=1)
    return total / weight_sum


def distill_eagle3_head(head_params: Any, params_t: Any, batch: DistillBatch, *, config: Eagle3Config,
                        steps: int, learning_rate: float = 3e-3, unroll: int = 3, decay: float = 0.8,
                        progress: bool = False) -> tuple[Any, list[float]]:
    """Full-batch AdamW (warmup + cosine) on ``batch`` -> (trained head params, loss per step)."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, max(1, steps // 10), steps)
    optimizer = optax.adamw(schedule, weight_decay=0.0)
    embedding = params_t["embed_tokens"]["embedding"]
    loss_fn = functools.partial(distill_loss, config=config, unroll=unroll, decay=decay)

    @jax.jit
    def update(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params, embedding, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = optimizer.init(head_params)
    losses = []
    iterator = range(steps)
    if progress:
        from tqdm import tqdm
        iterator = tqdm(iterator, desc="eagle3 head", unit="step")
    for _ in iterator:
        head_params, opt_state, loss = update(head_params, opt_state)
        losses.append(float(loss))
    return head_params, losses


# --- training on a corpus (scripts/train_drafter.py --kind eagle3) --------------------------------------------

def draft_vocab_maps(tokens: np.ndarray, target_vocab_size: int,
                     draft_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t i32[V_draft], t2d bool[V_target]): the ``draft_vocab_size`` most frequent target ids in ``tokens``
    (ties: lower id first), kept in ascending id order; draft id d stands for target id d + d2t[d]."""
    if not 0 < draft_vocab_size <= target_vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size}: expected 1..{target_vocab_size}")
    counts = np.bincount(np.asarray(tokens, np.int64), minlength=target_vocab_size)[:target_vocab_size]
    keep = np.sort(np.argsort(-counts, kind="stable")[:draft_vocab_size])
    t2d = np.zeros(target_vocab_size, bool)
    t2d[keep] = True
    return (keep - np.arange(draft_vocab_size)).astype(np.int32), t2d


def eagle3_hf_config(target_hf: dict, draft_vocab_size: int, intermediate_size: int | None = None) -> dict:
    """config.json of an EAGLE-3 head for the target whose config.json is ``target_hf`` (its attention shapes)."""
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": target_hf["hidden_size"], "target_hidden_size": target_hf["hidden_size"],
            "intermediate_size": intermediate_size or target_hf["intermediate_size"],
            "num_attention_heads": target_hf["num_attention_heads"],
            "num_key_value_heads": target_hf.get("num_key_value_heads", target_hf["num_attention_heads"]),
            "head_dim": target_hf.get("head_dim") or target_hf["hidden_size"] // target_hf["num_attention_heads"],
            "num_hidden_layers": 1, "vocab_size": target_hf["vocab_size"], "draft_vocab_size": draft_vocab_size,
            "rms_norm_eps": target_hf.get("rms_norm_eps", 1e-6), "rope_theta": target_hf.get("rope_theta", 1e4),
            "max_position_embeddings": target_hf.get("max_position_embeddings", 2048),
            "bos_token_id": target_hf.get("bos_token_id"), "eos_token_id": target_hf.get("eos_token_id"),
            "torch_dtype": "float32"}


def init_head_from_target(config: Eagle3Config, params_t: Any, target: ModelConfig, d2t: np.ndarray,
                          key: jax.Array) -> Any:
    """Random head, except lm_head and norm start as the target's output layer restricted to the draft vocab
    (the head then begins by reading its pre-norm output the way the target reads its last hidden state)."""
    from models.eagle3 import init_eagle3_params

    head = init_eagle3_params(config, key)
    keep = np.arange(config.draft_vocab_size) + np.asarray(d2t)
    out = params_t["embed_tokens"]["embedding"].T if target.tie_word_embeddings else params_t["lm_head"]["kernel"]
    head["lm_head"]["kernel"] = jnp.asarray(out)[:, keep].astype(jnp.float32)
    head["norm"]["weight"] = jnp.asarray(params_t["norm"]["weight"], jnp.float32)
    return head


def windows_loss(head_params: Any, windows: jax.Array, *, params_t: Any, target: ModelConfig,
                 config: Eagle3Config, keep_ids: np.ndarray, unroll: int, decay: float) -> jax.Array:
    """distill_loss on windows: i32[B, N] of real text, features and labels from the frozen target (traced)."""
    features, logits = target_features(params_t, windows, target=target)
    logits = logits if len(keep_ids) == target.vocab_size else logits[..., jnp.asarray(keep_ids)]
    batch = DistillBatch(windows, jax.lax.stop_gradient(features),
                         jax.lax.stop_gradient(jax.nn.softmax(logits, axis=-1)), jnp.ones(windows.shape, bool))
    return distill_loss(head_params, params_t["embed_tokens"]["embedding"], batch, config=config, unroll=unroll,
                        decay=decay)


def train_eagle3(out_dir: str, target_dir: str, work_dir: str, train, draft_vocab_size: int | None = None,
                 unroll: int = 3, decay: float = 0.8, corpus_root: str | None = None, progress: bool = True,
                 log=print, num_generated: int = 0) -> dict:
    """Trains an EAGLE-3 head for the HF target at ``target_dir`` on the stdlib corpus (train split) and writes
    it in HF EAGLE-3 layout to ``out_dir``. ``train``: a jspec.train.target.TrainConfig. ``num_generated``:
    when > 0, half the training text is the target's own greedy continuations of that many corpus windows.
    Resumable (orbax, in ``work_dir/checkpoints``). Returns the report (also ``out_dir/train_report.json``)."""
    import dataclasses
    import json
    import os
    import time

    from jspec.train.target import (corpus_for, heldout_windows, load_hf_llama, mix_with_generated,
                                    self_generated_tokens, train_loop)
    from models.checkpoint import write_hf_eagle3
    from models.eagle3 import eagle3_config_from_hf

    started = time.perf_counter()
    target, params_t, target_hf = load_hf_llama(target_dir)
    _, splits = corpus_for(target_dir, work_dir, corpus_root)
    d2t, t2d = draft_vocab_maps(splits["train"], target.vocab_size, draft_vocab_size or target.vocab_size)
    keep_ids = np.flatnonzero(t2d)
    hf_config = eagle3_hf_config(target_hf, len(d2t))
    config = eagle3_config_from_hf(hf_config)
    loss = functools.partial(windows_loss, params_t=params_t, target=target, config=config, keep_ids=keep_ids,
                             unroll=unroll, decay=decay)
    held = jnp.asarray(heldout_windows(splits["heldout"], train.eval_batches * train.batch_size,
                                       train.seq_len + 1))
    eval_fn = jax.jit(lambda head: jnp.mean(jnp.stack([
        loss(head, held[i:i + train.batch_size]) for i in range(0, len(held), train.batch_size)])))
    head = init_head_from_target(config, params_t, target, d2t, jax.random.key(train.seed))
    tokens = splits["train"]
    if num_generated:
        tokens = mix_with_generated(tokens, self_generated_tokens(target, params_t, tokens, work_dir, num_generated,
                                                                  seed=train.seed, log=log), train.seed)
    head, report = train_loop(head, loss, train, tokens, work_dir, lambda h: float(eval_fn(h)),
                              progress, log, desc="eagle3")
    write_hf_eagle3(out_dir, hf_config, jax.tree.map(np.asarray, head), d2t, overwrite=True)
    np.save(os.path.join(out_dir, "t2d.npy"), t2d)
    summary = {"train_config": dataclasses.asdict(train), "unroll": unroll, "decay": decay,
               "num_generated": num_generated,
               "draft_vocab_size": int(len(d2t)), "heldout_loss": report["heldout"][-1][1],
               "heldout_curve": report["heldout"], "first_losses": report["losses"][:5],
               "last_losses": report["losses"][-5:], "wall_seconds": time.perf_counter() - started}
    with open(os.path.join(out_dir, "train_report.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary
