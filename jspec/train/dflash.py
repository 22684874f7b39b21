"""Training a DFlash drafter on a frozen target, SpecForge's DFlash recipe, through the drafter's own inference code.

Per window of text (by default the target's own greedy continuations), the target runs once: the outputs of
``target_layer_ids`` (the drafter's context) and its next-token distributions. ``num_anchors`` random anchor
positions a per window each make a block ``[x[a], mask, ..., mask]`` at positions a .. a + block_size - 1 that
attends the context strictly before a (the anchor's own features do not exist yet at inference: the verify pass
makes them) and, bidirectionally, itself only: blocks never see each other. Each block is one row over a copy of
the window's context cache with ``cache_len = a``, so training runs exactly ``DFlashDraft.context`` and the block
forward that drafting runs. Block slot k (1 .. block_size - 1) predicts the token at a + k; its cross-entropy
against the target's distribution there (soft labels, as our EAGLE-3 distillation; SpecForge uses the data token,
which on greedy regenerated text is the target's top-1) is weighted ``exp(-(k - 1) / gamma)`` (SpecForge's
``loss_decay_gamma``, 7 in every shipped recipe) and normalized by the weights' sum.

DSpark (DeepSpec's recipe): every block slot k predicts the token at a + k + 1, its Markov bias teacher-forced by
the text (slot k's previous token is the text's at a + k), weighted ``exp(-k / gamma)`` (4 in DeepSpec's configs);
the loss is 0.1 cross-entropy against the text's token + 0.9 L1 (= 2 TV) against the target's distribution + 1.0
binary cross-entropy of the confidence head against 1 - TV, each normalized by the weights' sum.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jspec.drafters.dflash import target_logits
from models.attention import KVCache
from models.config import ModelConfig
from models.dflash import DFlashConfig, DFlashDraft, init_dflash_params
from models.llama import LlamaModel


DSPARK_LOSS_WEIGHTS = (0.1, 0.9, 1.0)  # DeepSpec's shipped alphas: cross-entropy, L1 (= 2 TV), confidence BCE


class BlockMetrics(NamedTuple):
    loss: jax.Array      # f32[] the weighted cross-entropy
    accuracy: jax.Array  # f32[block_size - 1] top-1 agreement with the target per block position
    accepted: jax.Array  # f32[] greedy drafts a block would get accepted: the mean run of leading agreements


def dflash_hf_config(target_hf: dict, num_layers: int, block_size: int, mask_token_id: int,
                     target_layer_ids: tuple[int, ...], markov_rank: int | None = None) -> dict:
    """z-lab's config.json for a DFlash drafter of the target whose config.json is ``target_hf`` (its attention
    shapes; Qwen3 layers, so q/k norms); with ``markov_rank``, DeepSpec's for a DSpark drafter (its knobs at top
    level, a confidence head reading the Markov embedding)."""
    heads = target_hf["num_attention_heads"]
    if markov_rank is not None:
        zlab = dflash_hf_config(target_hf, num_layers, block_size, mask_token_id, target_layer_ids)
        del zlab["dflash_config"]
        return {**zlab, "architectures": ["Qwen3DSparkModel"], "mask_token_id": mask_token_id,
                "target_layer_ids": list(target_layer_ids), "markov_rank": markov_rank,
                "markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True}
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": target_hf["hidden_size"], "intermediate_size": target_hf["intermediate_size"],
            "num_hidden_layers": num_layers, "num_attention_heads": heads,
            "num_key_value_heads": target_hf.get("num_key_value_heads", heads),
            "head_dim": target_hf.get("head_dim") or target_hf["hidden_size"] // heads,
            "vocab_size": target_hf["vocab_size"], "rms_norm_eps": target_hf.get("rms_norm_eps", 1e-6),
            "rope_theta": target_hf.get("rope_theta", 1e4), "attention_bias": False,
            "max_position_embeddings": target_hf.get("max_position_embeddings", 2048),
            "tie_word_embeddings": False, "layer_types": ["full_attention"] * num_layers,
            "block_size": block_size, "num_target_layers": target_hf["num_hidden_layers"],
            "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
            "torch_dtype": "float32"}


def resolve_mask_token_id(tokenizer: Any, vocab_size: int) -> int:
    """SpecForge's order, but for the last resort: the tokenizer's mask token, else the first embedding row past
    the tokenizer's vocabulary, else ``<unk>`` (a byte-level tokenizer never emits it, so its row is as unused as
    a fresh one), else ``</s>``."""
    for name in ("<mask>", "<|MASK|>", "[MASK]"):
        token = tokenizer.token_to_id(name)
        if token is not None:
            return token
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size < vocab_size:
        return size
    for name in ("<unk>", "</s>"):
        token = tokenizer.token_to_id(name)
        if token is not None:
            return token
    raise ValueError("no mask token: the tokenizer has no <mask>, <unk> or </s> and no unused embedding row; pass "
                     "mask_token_id")


def init_from_target(config: DFlashConfig, params_t: Any, key: jax.Array) -> Any:
    """Random layers and fc; the final norm starts as the target's (its output meets the target's lm_head)."""
    params = init_dflash_params(config, key)
    params["norm"]["weight"] = jnp.asarray(params_t["norm"]["weight"], jnp.float32)
    return params


@functools.partial(jax.jit, static_argnames=("target", "taps"))
def target_pass(params_t: Any, tokens: jax.Array, *, target: ModelConfig,
                taps: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """tokens: i32[B, N] -> (the drafter's context features f32[B, N, n_ctx * H], the target's logits
    f32[B, N, V]) from one causal target pass."""
    batch, width = tokens.shape
    cache = KVCache.zeros(target.num_layers, batch, width, target.num_kv_heads, target.head_dim, jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
    out = LlamaModel(target).apply({"params": params_t}, tokens, positions, cache, jnp.zeros((batch,), jnp.int32),
                                   tap_layers=taps)
    return jnp.concatenate(list(out.taps), axis=-1), out.logits


def sample_anchors(windows: jax.Array, num_anchors: int) -> jax.Array:
    """i32[B, num_anchors]: distinct anchors per window in [1, N - 2] (a context before, a label after), drawn with
    a key derived from the window's tokens (a batch's anchors are then a function of the batch: resumable)."""
    batch, width = windows.shape
    candidates = width - 2
    if num_anchors > candidates:
        raise ValueError(f"num_anchors={num_anchors}: expected at most {candidates} for windows of {width} tokens")
    mix = jnp.asarray(np.arange(width, dtype=np.uint64) * 2654435761 % 2 ** 32 + 1, jnp.uint32)
    seeds = jnp.sum(windows.astype(jnp.uint32) * mix[None], axis=1)
    pick = jax.vmap(lambda seed: jax.random.choice(jax.random.key(seed), candidates, (num_anchors,), replace=False))
    return (pick(seeds) + 1).astype(jnp.int32)


def block_metrics(params_d: Any, windows: jax.Array, *, params_t: Any, target: ModelConfig, config: DFlashConfig,
                  num_anchors: int, gamma: float, loss_weights: tuple[float, float, float] = DSPARK_LOSS_WEIGHTS
                  ) -> BlockMetrics:
    """The recipe's loss over ``windows`` i32[B, N] of text (module docstring), with per-position accuracy. Draft i
    of a block (z-lab's slot i + 1, DSpark's slot i) is the token at anchor + 1 + i, weighted exp(-i / gamma).
    DSpark: its Markov bias teacher-forced by the text's tokens, and DeepSpec's loss ``loss_weights`` (CE against
    the text's token, L1 = 2 TV against the target's distribution, BCE of the confidence against 1 - TV)."""
    batch, width = windows.shape
    size, layer = config.block_size, config.layer
    features, logits_t = target_pass(params_t, windows, target=target, taps=config.tap_layers(target))
    probs_t = jax.lax.stop_gradient(jax.nn.softmax(logits_t, axis=-1))  # [B, N, V]: the token at p + 1
    model = DFlashDraft(config)
    cache = KVCache.zeros(layer.num_layers, batch, width + size, layer.num_kv_heads, layer.head_dim, jnp.float32,
                          per_layer=True)
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    cache = model.apply({"params": params_d}, jax.lax.stop_gradient(features), positions, cache,
                        jnp.zeros((batch,), jnp.int32), method=DFlashDraft.context)
    anchors = sample_anchors(windows, num_anchors)                               # [B, A]
    rows = jax.tree.map(lambda c: jnp.repeat(c, num_anchors, axis=0), cache)     # [B * A, N + bs, ...]
    anchor = anchors.reshape(-1)
    first = jnp.take_along_axis(windows, anchors, axis=1).reshape(-1)
    tokens = jnp.concatenate([first[:, None], jnp.full((batch * num_anchors, size - 1), config.mask_token_id,
                                                       jnp.int32)], axis=1)
    embeds = jnp.take(params_t["embed_tokens"]["embedding"], tokens, axis=0)
    block_positions = anchor[:, None] + jnp.arange(size, dtype=jnp.int32)[None]
    normed, _ = model.apply({"params": params_d}, embeds, block_positions, rows, anchor)
    normed = normed[:, config.first_draft_slot:]                                 # [B * A, D, H]
    drafts = config.num_drafts
    at = anchor[:, None] + jnp.arange(drafts, dtype=jnp.int32)[None]             # draft i: the token at + 1
    valid = at + 1 <= width - 1
    owner = jnp.repeat(jnp.arange(batch), num_anchors)[:, None]
    labels = probs_t[owner, jnp.minimum(at, width - 1)]                          # [B * A, D, V]
    previous = windows[owner, jnp.minimum(at, width - 1)]                        # the token before draft i
    logits = target_logits(params_t, target, normed)
    if config.markov_rank:
        logits = logits + model.apply({"params": params_d}, previous, method=DFlashDraft.markov_bias)
    weight = jnp.asarray(np.exp(-np.arange(drafts) / gamma), jnp.float32)[None] * valid
    total = jnp.maximum(jnp.sum(weight), 1e-9)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    if config.layout == "dspark":
        ce_weight, l1_weight, confidence_weight = loss_weights
        data = windows[owner, jnp.minimum(at + 1, width - 1)]
        cross_entropy = -jnp.take_along_axis(log_probs, data[..., None], axis=-1)[..., 0]
        distance = jnp.sum(jnp.abs(jnp.exp(log_probs) - labels), axis=-1)     # L1 = 2 TV
        loss = (ce_weight * jnp.sum(weight * cross_entropy) + l1_weight * jnp.sum(weight * distance)) / total
        if config.confidence_head:
            confidence = model.apply({"params": params_d}, normed, previous, method=DFlashDraft.confidence)
            accept = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * distance, 0.0, 1.0))
            bce = optax.sigmoid_binary_cross_entropy(confidence, accept)
            loss = loss + confidence_weight * jnp.sum(weight * bce) / total
    else:
        cross_entropy = -jnp.sum(labels * log_probs, axis=-1)
        loss = jnp.sum(weight * cross_entropy) / total
    agree = (jnp.argmax(logits, axis=-1) == jnp.argmax(labels, axis=-1)) & valid
    accuracy = jnp.sum(agree, axis=0) / jnp.maximum(jnp.sum(valid, axis=0), 1)
    accepted = jnp.mean(jnp.sum(jnp.cumprod(agree, axis=1), axis=1))
    return BlockMetrics(loss, accuracy, accepted)


def export_dflash(out_dir: str, hf_config: dict, params: Any, params_t: Any = None,
                  target: ModelConfig | None = None) -> None:
    """z-lab's (or DeepSpec's) layout at ``out_dir``: config.json and model.safetensors (float32), written
    atomically; with ``params_t``, DeepSpec's frozen copies of the target's embedding and lm_head too."""
    import json
    import os

    from safetensors.numpy import save_file

    from models.checkpoint.hf_dflash import as_hf_tensors
    from models.checkpoint.store import atomic_directory

    with atomic_directory(out_dir, overwrite=True) as out:
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2)
        tensors = {name: np.ascontiguousarray(a, np.float32) for name, a in as_hf_tensors(params).items()}
        if params_t is not None:
            embedding = np.asarray(params_t["embed_tokens"]["embedding"], np.float32)
            head = embedding if target.tie_word_embeddings else np.asarray(params_t["lm_head"]["kernel"]).T
            tensors["embed_tokens.weight"] = embedding
            tensors["lm_head.weight"] = np.ascontiguousarray(head, np.float32)
        save_file(tensors, os.path.join(out, "model.safetensors"))


def train_dflash(out_dir: str, target_dir: str, work_dir: str, train, num_layers: int = 1, block_size: int = 8,
                 num_anchors: int = 16, gamma: float = 7.0, target_layer_ids: tuple[int, ...] | None = None,
                 mask_token_id: int | None = None, corpus_root: str | None = None, progress: bool = True,
                 log=print, num_generated: int = 0, data_parallel_size: int = 1,
                 markov_rank: int | None = None, generated_fraction: float = 1.0) -> dict:
    """Trains a DFlash drafter for the HF target at ``target_dir`` and writes it in z-lab's layout to ``out_dir``
    (module docstring); with ``markov_rank``, a DSpark drafter (a Markov head of that rank and a confidence head,
    DeepSpec's loss and layout). ``train``: a jspec.train.target.TrainConfig; ``target_layer_ids``: None for
    z-lab's rule (one per draft layer, ``models.dflash.default_target_layer_ids``); ``mask_token_id``: None
    resolves it (:func:`resolve_mask_token_id`); ``num_generated`` > 0: train on that many of the target's greedy
    continuations of corpus windows (cached in ``work_dir``), ``generated_fraction`` of the training text (the rest
    the corpus's train split, as ``train_eagle3``). Resumable (orbax, ``work_dir/checkpoints``); data
    parallel over ``data_parallel_size`` devices. Returns the report (also ``out_dir/train_report.json``)."""
    import dataclasses
    import json
    import os
    import time

    from jspec.train.target import (corpus_for, data_mesh, heldout_mean, load_hf_llama, mix_with_generated,
                                    replicate, self_generated_tokens, train_loop)
    from models.dflash import default_target_layer_ids, dflash_config_from_hf

    if gamma <= 0:
        raise ValueError(f"gamma={gamma}: expected a positive loss decay")
    if not 0.0 < generated_fraction <= 1.0:
        raise ValueError(f"generated_fraction={generated_fraction}: expected a number in (0, 1]")
    if num_anchors < 1:
        raise ValueError(f"num_anchors={num_anchors}: expected >= 1")
    if num_anchors > train.seq_len - 1:
        raise ValueError(f"num_anchors={num_anchors}: expected at most seq_len - 1 = {train.seq_len - 1}")
    started = time.perf_counter()
    mesh = data_mesh(data_parallel_size, train.batch_size)
    target, params_t, target_hf = load_hf_llama(target_dir)
    tokenizer, splits = corpus_for(target_dir, work_dir, corpus_root)
    if mask_token_id is None:
        mask_token_id = resolve_mask_token_id(tokenizer, target.vocab_size)
    ids = target_layer_ids or default_target_layer_ids(target.num_layers, num_layers)
    hf_config = dflash_hf_config(target_hf, num_layers, block_size, mask_token_id, tuple(ids), markov_rank)
    config = dflash_config_from_hf(hf_config)
    config.check_target(target)  # before any data is made
    tokens = splits["train"]
    if num_generated:
        generated = self_generated_tokens(target, params_t, tokens, work_dir, num_generated, seed=train.seed, log=log)
        tokens = (generated if generated_fraction == 1.0
                  else mix_with_generated(tokens, generated, train.seed, generated_fraction))
    params_t = replicate(params_t, mesh)
    metrics = functools.partial(block_metrics, params_t=params_t, target=target, config=config,
                                num_anchors=num_anchors, gamma=gamma)
    heldout = heldout_mean(metrics, splits["heldout"], train, mesh)

    def shown(params, windows):
        out = metrics(params, windows)
        return {"loss": out.loss, "acc": out.accuracy, "accept": out.accepted}

    params = init_from_target(config, params_t, jax.random.key(train.seed))
    params, report = train_loop(params, lambda p, w: metrics(p, w).loss, train, tokens, work_dir,
                                lambda p: float(heldout(p).loss), progress, log, desc=config.layout,
                                metrics_fn=shown, mesh=mesh)
    final = heldout(params)
    export_dflash(out_dir, hf_config, jax.tree.map(np.asarray, params),
                  *((params_t, target) if config.layout == "dspark" else ()))
    summary = {"train_config": dataclasses.asdict(train), "layout": config.layout, "markov_rank": markov_rank,
               "num_layers": num_layers, "block_size": block_size,
               "num_anchors": num_anchors, "gamma": gamma, "target_layer_ids": list(ids),
               "mask_token_id": mask_token_id, "num_generated": num_generated,
               "data_parallel_size": data_parallel_size,
               "heldout_accuracy": np.asarray(final.accuracy).tolist(),
               "heldout_accepted": float(final.accepted), "heldout_loss": report["heldout"][-1][1],
               "heldout_curve": report["heldout"], "first_losses": report["losses"][:5],
               "last_losses": report["losses"][-5:], "wall_seconds": time.perf_counter() - started}
    with open(os.path.join(out_dir, "train_report.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary
