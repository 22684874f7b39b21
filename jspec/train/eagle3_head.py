"""Distilling an EAGLE-3 head from a frozen target, with EAGLE-3's training-time test, as SpecForge trains them.

Data: token sequences, by default the target's own greedy continuations of the corpus (SpecForge regenerates
its data with the target). The target runs once per batch, giving the features (residual-stream inputs of
layers 2, L//2, L-3) and its next-token distributions over the draft vocabulary (the ``draft_vocab_size`` most
frequent target tokens of the training data: d2t/t2d). The head is unrolled ``unroll`` (default 7) steps: step j
at index p is the draft node at depth j + 1 of a chain rooted after slot p, attending the real context and its
own earlier steps through a mask, exactly as drafting does (jspec/train/ttt.py); step j's cross-entropy against
the target's distribution is weighted ``decay ** j`` (0.8). Data parallel over a ("data",) mesh with
``data_parallel_size`` > 1: batch rows split, head and target replicated, gradients all-reduced by XLA.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jspec.train.ttt import TttMetrics, ttt_loss
from models.attention import KVCache
from models.config import ModelConfig
from models.eagle3 import Eagle3Config
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
    """The training-time-test loss of ``batch`` (jspec/train/ttt.py): decay^j-weighted cross-entropy of the
    head's unroll steps against the target's distributions."""
    return distill_metrics(head_params, embedding, batch, config=config, unroll=unroll, decay=decay).loss


def distill_metrics(head_params: Any, embedding: jax.Array, batch: DistillBatch, *, config: Eagle3Config,
                    unroll: int, decay: float) -> TttMetrics:
    """distill_loss with the per-step cross-entropy and top-1 accuracy beside it."""
    return ttt_loss(head_params, config, embedding, batch.tokens, batch.features, batch.target_probs,
                    batch.valid.sum(axis=1), unroll=unroll, decay=decay)


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


def _read_head(head_dir: str, target_hf: dict, draft_vocab_size: int | None) -> tuple[Any, np.ndarray]:
    """An HF EAGLE-3 head (any layout our converter reads) -> (float32 params, d2t i32[V_draft]), checked against
    the head this target would get (same shapes; ``draft_vocab_size`` if given)."""
    import os
    import tempfile

    from models.checkpoint import convert_hf_checkpoint, load_eagle3
    from models.eagle3 import eagle3_config_from_hf, eagle3_param_shapes

    with tempfile.TemporaryDirectory() as tmp:
        config, params, d2t, _ = load_eagle3(convert_hf_checkpoint(head_dir, os.path.join(tmp, "head"),
                                                                   dtype="float32", progress=False))
    expected = eagle3_param_shapes(eagle3_config_from_hf(eagle3_hf_config(target_hf, config.draft_vocab_size)))
    shapes = lambda tree: jax.tree.map(lambda x: tuple(x.shape), tree)  # noqa: E731
    if shapes(params) != shapes(expected):
        raise ValueError(f"init_head={head_dir!r}: its weights {shapes(params)} are not the shapes of the head "
                         f"this target trains ({shapes(expected)})")
    if draft_vocab_size is not None and draft_vocab_size != config.draft_vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size}, but init_head={head_dir!r} has "
                         f"{config.draft_vocab_size}: leave it out to keep the head's")
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params), np.asarray(d2t, np.int64)


def windows_loss(head_params: Any, windows: jax.Array, *, params_t: Any, target: ModelConfig,
                 config: Eagle3Config, keep_ids: np.ndarray, unroll: int, decay: float) -> jax.Array:
    """distill_loss on windows: i32[B, N] of real text, features and labels from the frozen target (traced)."""
    return windows_metrics(head_params, windows, params_t=params_t, target=target, config=config,
                           keep_ids=keep_ids, unroll=unroll, decay=decay).loss


def windows_metrics(head_params: Any, windows: jax.Array, *, params_t: Any, target: ModelConfig,
                    config: Eagle3Config, keep_ids: np.ndarray, unroll: int, decay: float) -> TttMetrics:
    """windows_loss with the per-step cross-entropy and top-1 accuracy."""
    features, logits = target_features(params_t, windows, target=target)
    logits = logits if len(keep_ids) == target.vocab_size else logits[..., jnp.asarray(keep_ids)]
    batch = DistillBatch(windows, jax.lax.stop_gradient(features),
                         jax.lax.stop_gradient(jax.nn.softmax(logits, axis=-1)), jnp.ones(windows.shape, bool))
    embedding = params_t["embed_tokens"]["embedding"]
    if target.embedding_multiplier != 1.0:  # as the target's embed_tokens gives them (Gemma-3), and inference reads
        embedding = embedding * jnp.asarray(target.embedding_multiplier, embedding.dtype)
    return distill_metrics(head_params, embedding, batch, config=config, unroll=unroll, decay=decay)


def train_eagle3(out_dir: str, target_dir: str, work_dir: str, train, draft_vocab_size: int | None = None,
                 unroll: int = 7, decay: float = 0.8, corpus_root: str | None = None, progress: bool = True,
                 log=print, num_generated: int = 0, generated_fraction: float = 1.0,
                 data_parallel_size: int = 1, init_head: str | None = None) -> dict:
    """Trains an EAGLE-3 head for the HF target at ``target_dir`` and writes it in the HF EAGLE-3 layout
    SpecForge writes (model.safetensors with d2t and t2d) to ``out_dir``. ``train``: a
    jspec.train.target.TrainConfig. ``num_generated``: when > 0, the target's own greedy continuations of that many
    corpus windows make ``generated_fraction`` of the training text (1.0: only them, as SpecForge recommends; the
    rest is the stdlib corpus's train split); 0 trains on the corpus alone. The draft vocabulary is the
    ``draft_vocab_size`` most frequent tokens of that training text. Resumable (orbax, in
    ``work_dir/checkpoints``). Returns the report (also ``out_dir/train_report.json``), with the held-out loss and
    per-step top-1 accuracy of the head against the target. ``data_parallel_size``: batch rows split over that
    many devices (a ("data",) mesh; the head and the frozen target replicated; ``train.batch_size`` a multiple
    of it). ``init_head``: an HF EAGLE-3 head for this target to start from (its weights and draft vocabulary,
    a fresh optimizer): a second stage, e.g. the full unroll after a first stage of ``unroll=1``."""
    if not 0.0 < generated_fraction <= 1.0:
        raise ValueError(f"generated_fraction={generated_fraction}: expected a number in (0, 1]")
    if unroll < 1:
        raise ValueError(f"unroll={unroll}: expected >= 1")
    import dataclasses
    import json
    import os
    import time

    from jspec.train.target import (corpus_for, data_mesh, heldout_mean, load_hf_llama, mix_with_generated,
                                    replicate, self_generated_tokens, train_loop)
    from models.checkpoint import write_hf_eagle3
    from models.eagle3 import eagle3_config_from_hf

    started = time.perf_counter()
    mesh = data_mesh(data_parallel_size, train.batch_size)
    target, params_t, target_hf = load_hf_llama(target_dir)
    start = d2t = None  # checked before any data is made
    if init_head is not None:
        start, d2t = _read_head(init_head, target_hf, draft_vocab_size)
    _, splits = corpus_for(target_dir, work_dir, corpus_root)
    tokens = splits["train"]
    if num_generated:
        generated = self_generated_tokens(target, params_t, tokens, work_dir, num_generated, seed=train.seed,
                                          log=log)
        tokens = (generated if generated_fraction == 1.0
                  else mix_with_generated(tokens, generated, train.seed, generated_fraction))
    if start is not None:
        t2d = np.zeros(target.vocab_size, bool)
        t2d[np.arange(len(d2t)) + d2t] = True
    else:
        d2t, t2d = draft_vocab_maps(tokens, target.vocab_size, draft_vocab_size or target.vocab_size)
    keep_ids = np.flatnonzero(t2d)
    hf_config = eagle3_hf_config(target_hf, len(d2t))
    config = eagle3_config_from_hf(hf_config)
    params_t = replicate(params_t, mesh)  # after generation: the engine places its own params
    metrics = functools.partial(windows_metrics, params_t=params_t, target=target, config=config,
                                keep_ids=keep_ids, unroll=unroll, decay=decay)
    loss = lambda head, windows: metrics(head, windows).loss  # noqa: E731
    heldout = heldout_mean(metrics, splits["heldout"], train, mesh)

    def shown(head, windows):  # the progress bar: loss and top-1 accuracy per unroll step
        out = metrics(head, windows)
        return {"loss": out.loss, "acc": out.accuracy}

    head = start if start is not None else init_head_from_target(config, params_t, target, d2t,
                                                                   jax.random.key(train.seed))
    head, report = train_loop(head, loss, train, tokens, work_dir, lambda h: float(heldout(h).loss),
                              progress, log, desc="eagle3", metrics_fn=shown, mesh=mesh)
    final = heldout(head)
    write_hf_eagle3(out_dir, hf_config, jax.tree.map(np.asarray, head), d2t, overwrite=True)
    np.save(os.path.join(out_dir, "t2d.npy"), t2d)
    summary = {"train_config": dataclasses.asdict(train), "unroll": unroll, "decay": decay,
               "data_parallel_size": data_parallel_size, "init_head": init_head,
               "num_generated": num_generated, "generated_fraction": generated_fraction,
               "heldout_step_loss": np.asarray(final.step_loss).tolist(),
               "heldout_step_accuracy": np.asarray(final.accuracy).tolist(),
               "draft_vocab_size": int(len(d2t)), "heldout_loss": report["heldout"][-1][1],
               "heldout_curve": report["heldout"], "first_losses": report["losses"][:5],
               "last_losses": report["losses"][-5:], "wall_seconds": time.perf_counter() - started}
    with open(os.path.join(out_dir, "train_report.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary
