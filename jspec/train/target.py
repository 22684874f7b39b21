"""Training a Llama-family code model from scratch on the stdlib corpus: AdamW, warmup + cosine, resumable.

The loop is plain next-token cross-entropy over random windows of the tokenized train split
(``jspec/train/corpus.py``). Window ``i`` of step ``s`` comes from ``np.random.default_rng((seed, s))``, so a run
resumed from an orbax checkpoint sees exactly the batches it would have seen uninterrupted. Checkpoints (params,
optimizer state) go to ``work_dir/checkpoints`` through an orbax ``CheckpointManager`` every
``checkpoint_every`` steps and at the end; a killed run restarts from the latest one.

The result is exported in Hugging Face layout (config.json, model.safetensors, tokenizer.json,
generation_config.json) by :func:`export_hf`: transformers loads it as-is and ``models.checkpoint`` converts it.
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
import optax

from models.attention import KVCache
from models.config import ModelConfig, from_hf_config
from models.llama import LlamaModel, init_params, param_shapes


def llama_hf_config(vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                    intermediate_size: int, max_position_embeddings: int = 2048, tie_word_embeddings: bool = True,
                    bos_token_id: int = 1, eos_token_id: int = 2, rope_theta: float = 10000.0) -> dict:
    """A LlamaForCausalLM config.json dict."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
            "hidden_size": hidden_size, "intermediate_size": intermediate_size, "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
            "head_dim": hidden_size // num_heads, "max_position_embeddings": max_position_embeddings,
            "rms_norm_eps": 1e-5, "rope_theta": rope_theta, "tie_word_embeddings": tie_word_embeddings,
            "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32"}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """steps x batch_size windows of seq_len + 1 tokens; learning rate: linear warmup to ``learning_rate``, then
    cosine to ``learning_rate * final_lr_fraction``."""

    steps: int = 3000
    batch_size: int = 16
    seq_len: int = 256
    learning_rate: float = 2e-3
    warmup_steps: int = 150
    final_lr_fraction: float = 0.05
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 200
    eval_every: int = 500
    eval_batches: int = 8

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "checkpoint_every", "eval_every", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)}: expected >= 1")
        if self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be below steps={self.steps}")


def make_optimizer(train: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, train.learning_rate, train.warmup_steps, train.steps, train.learning_rate * train.final_lr_fraction)
    # No weight decay on norms (1-d params).
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2 and p.shape[-1] > 1, params)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(train.grad_clip),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=train.weight_decay, mask=decay_mask))


def causal_lm_logits(params: Any, tokens: jax.Array, config: ModelConfig) -> jax.Array:
    """tokens: i32[B, T] -> logits f32[B, T, V] of one causal pass from position 0."""
    batch, width = tokens.shape
    cache = KVCache.for_model(config, batch, width, jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
    return LlamaModel(config).apply({"params": params}, tokens, positions, cache,
                                    jnp.zeros((batch,), jnp.int32)).logits


def lm_loss(params: Any, windows: jax.Array, *, config: ModelConfig) -> jax.Array:
    """Mean next-token cross-entropy (nats) of windows: i32[B, T + 1]."""
    logits = causal_lm_logits(params, windows[:, :-1], config)
    return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()


def sample_windows(tokens: np.ndarray, batch_size: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """i32[batch_size, width] random windows of the flat token array."""
    starts = rng.integers(0, len(tokens) - width, batch_size)
    return np.stack([tokens[s:s + width] for s in starts]).astype(np.int32)


def heldout_windows(tokens: np.ndarray, num: int, width: int) -> np.ndarray:
    """i32[num, width]: evenly spaced, non-overlapping where possible, windows (deterministic)."""
    starts = np.linspace(0, len(tokens) - width, num).astype(np.int64)
    return np.stack([tokens[s:s + width] for s in starts]).astype(np.int32)


def heldout_mean(metrics: Callable[[Any, jax.Array], Any], tokens: np.ndarray, train: TrainConfig,
                 mesh: jax.sharding.Mesh | None = None) -> Callable[[Any], Any]:
    """A jitted ``params -> metrics`` averaged over ``train.eval_batches`` batches of held-out windows of
    ``tokens`` (``metrics(params, windows)`` returns a pytree of arrays; every leaf is averaged)."""
    held = replicate(jnp.asarray(heldout_windows(tokens, train.eval_batches * train.batch_size, train.seq_len + 1)),
                     mesh)

    @jax.jit
    def mean(params):
        parts = [metrics(params, held[i:i + train.batch_size]) for i in range(0, len(held), train.batch_size)]
        return jax.tree.map(lambda *xs: jnp.mean(jnp.stack(xs), axis=0), *parts)

    return mean


@functools.partial(jax.jit, static_argnames=("config",))
def eval_loss(params: Any, windows: jax.Array, *, config: ModelConfig) -> jax.Array:
    return lm_loss(params, windows, config=config)


def evaluate(params: Any, config: ModelConfig, tokens: np.ndarray, seq_len: int, batch_size: int,
             num_batches: int) -> float:
    """Mean held-out loss (nats/token) over ``num_batches`` x ``batch_size`` fixed windows."""
    windows = heldout_windows(tokens, num_batches * batch_size, seq_len + 1)
    losses = [float(eval_loss(params, jnp.asarray(windows[i:i + batch_size]), config=config))
              for i in range(0, len(windows), batch_size)]
    return float(np.mean(losses))


def data_mesh(data_parallel_size: int, batch_size: int) -> jax.sharding.Mesh | None:
    """A ("data",) mesh over the first ``data_parallel_size`` devices (None for 1: train on the default device).
    Batch rows are split over it, so ``batch_size`` must be a multiple of ``data_parallel_size``."""
    if data_parallel_size < 1 or data_parallel_size > jax.device_count():
        raise ValueError(f"data_parallel_size={data_parallel_size}: expected 1..{jax.device_count()} (the devices "
                         f"JAX sees)")
    if batch_size % data_parallel_size:
        raise ValueError(f"batch_size={batch_size} is not a multiple of data_parallel_size={data_parallel_size}")
    if data_parallel_size == 1:
        return None
    return jax.sharding.Mesh(np.asarray(jax.devices()[:data_parallel_size]), ("data",))


def replicate(tree: Any, mesh: jax.sharding.Mesh | None) -> Any:
    """``tree`` copied whole onto every device of ``mesh`` (unchanged when mesh is None)."""
    if mesh is None:
        return tree
    return jax.device_put(tree, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def _checkpoint_manager(directory: str):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=1)
    return ocp.CheckpointManager(os.path.abspath(directory), options=options)


def train_lm(hf_config: dict, train: TrainConfig, train_tokens: np.ndarray, heldout_tokens: np.ndarray | None,
             work_dir: str, progress: bool = True, log: Callable[[str], None] = print) -> tuple[Any, dict]:
    """Trains (or resumes) a Llama-family LM from random init -> (params f32, report dict)."""
    config = from_hf_config(hf_config)
    evaluate_fn = None
    if heldout_tokens is not None:
        evaluate_fn = lambda params: evaluate(params, config, heldout_tokens, train.seq_len,  # noqa: E731
                                              train.batch_size, train.eval_batches)
    return train_loop(init_params(config, jax.random.key(train.seed)),
                      functools.partial(lm_loss, config=config), train, train_tokens, work_dir, evaluate_fn,
                      progress, log, desc="target")


def train_loop(params: Any, loss_fn: Callable[[Any, jax.Array], jax.Array], train: TrainConfig,
               train_tokens: np.ndarray, work_dir: str, evaluate_fn: Callable[[Any], float] | None = None,
               progress: bool = True, log: Callable[[str], None] = print, desc: str = "train",
               metrics_fn: Callable[[Any, jax.Array], dict[str, jax.Array]] | None = None,
               mesh: jax.sharding.Mesh | None = None) -> tuple[Any, dict]:
    """AdamW on ``loss_fn(params, windows i32[B, seq_len + 1])`` over random windows of ``train_tokens``.

    ``mesh`` (from :func:`data_mesh`): data parallel. Each batch's rows are split over its "data" axis, params
    and optimizer state are replicated, and the update is one jitted program with those shardings: XLA
    partitions the loss (a mean over the whole batch) and all-reduces the gradients. Whatever ``loss_fn``
    closes over (a frozen target) must be replicated on the mesh too (:func:`replicate`).

    ``metrics_fn(params, windows)``, when given, replaces loss_fn: it returns {"loss": scalar, name: f32[K]...}
    and the progress bar shows each extra metric's running mean (e.g. per-step draft accuracy).

    Resumes from the latest orbax checkpoint in ``work_dir/checkpoints`` (state: params + optimizer state);
    ``evaluate_fn(params)`` (held-out loss) runs every ``eval_every`` steps and at the end. Returns
    (params, {"losses": [...], "heldout": [(step, loss), ...]}).
    """
    import orbax.checkpoint as ocp

    optimizer = make_optimizer(train)
    state = replicate({"params": params, "opt_state": optimizer.init(params)}, mesh)
    manager = _checkpoint_manager(os.path.join(work_dir, "checkpoints"))
    start = 0
    if manager.latest_step() is not None:
        start = manager.latest_step()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        state = manager.restore(start, args=ocp.args.StandardRestore(abstract))
        log(f"resumed from step {start} ({work_dir}/checkpoints)")

    def with_aux(params, windows):
        if metrics_fn is None:
            return loss_fn(params, windows), {}
        metrics = dict(metrics_fn(params, windows))
        return metrics.pop("loss"), metrics

    def step_fn(state, windows):
        (loss, metrics), grads = jax.value_and_grad(with_aux, has_aux=True)(state["params"], windows)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss, metrics

    place = jnp.asarray
    if mesh is None:
        update = jax.jit(step_fn)
    else:
        whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
        update = jax.jit(step_fn, in_shardings=(whole, rows), out_shardings=(whole, whole, whole))
        place = functools.partial(jax.device_put, device=rows)

    report: dict[str, Any] = {"losses": [], "heldout": []}
    num_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(state["params"]))
    log(f"{desc}: {num_params / 1e6:.2f}M trained params; {train.steps} steps x {train.batch_size} x "
        f"{train.seq_len} tokens = {train.steps * train.batch_size * train.seq_len / 1e6:.1f}M tokens; "
        f"train split {len(train_tokens) / 1e6:.2f}M tokens")
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=train.steps, initial=start, desc=desc, unit="step", mininterval=5.0)
    tokens_per_step = train.batch_size * train.seq_len
    window_start, ema, ema_metrics = time.perf_counter(), None, {}
    for step in range(start, train.steps):
        rng = np.random.default_rng((train.seed, step))
        windows = place(sample_windows(train_tokens, train.batch_size, train.seq_len + 1, rng))
        state, loss, metrics = update(state, windows)
        loss = float(loss)
        report["losses"].append(loss)
        ema = loss if ema is None else 0.98 * ema + 0.02 * loss
        for name, value in metrics.items():
            value = np.asarray(value)
            ema_metrics[name] = value if name not in ema_metrics else 0.98 * ema_metrics[name] + 0.02 * value
        done = step + 1
        if bar is not None:
            elapsed = time.perf_counter() - window_start
            bar.update(1)
            extra = {name: "/".join(f"{v:.2f}" for v in np.atleast_1d(value)) for name, value in ema_metrics.items()}
            bar.set_postfix(loss=f"{ema:.3f}", **extra, tok_s=f"{tokens_per_step / max(elapsed, 1e-9):.0f}",
                            refresh=False)
        window_start = time.perf_counter()
        if done % train.checkpoint_every == 0 or done == train.steps:
            manager.save(done, args=ocp.args.StandardSave(state))
        if evaluate_fn is not None and (done % train.eval_every == 0 or done == train.steps):
            held = evaluate_fn(state["params"])
            report["heldout"].append((done, held))
            log(f"step {done}: train loss (ema) {ema:.3f}, held-out loss {held:.3f}")
    manager.wait_until_finished()
    manager.close()
    if bar is not None:
        bar.close()
    if evaluate_fn is not None and not report["heldout"]:  # resumed at its last step: the run's result is still due
        report["heldout"].append((start, evaluate_fn(state["params"])))
    report["train_metrics"] = {name: np.asarray(value).tolist() for name, value in ema_metrics.items()}
    return state["params"], report


def export_hf(directory: str, hf_config: dict, params: Any, tokenizer=None, dtype: str = "float32",
              overwrite: bool = True) -> str:
    """HF directory: config.json + model.safetensors (``dtype``) + tokenizer files + generation_config.json."""
    from models.checkpoint import DTYPES, write_hf_llama

    params = jax.tree.map(lambda a: np.asarray(jnp.asarray(a, DTYPES[dtype])), params)
    write_hf_llama(directory, hf_config, params, overwrite=overwrite)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": hf_config.get("bos_token_id"), "eos_token_id": hf_config.get("eos_token_id")},
                  f, indent=2)
    if tokenizer is not None:
        from jspec.train.tokenizer import hf_tokenizer_files
        hf_tokenizer_files(tokenizer, directory, hf_config.get("max_position_embeddings", 2048))
    return directory


def prepare_data(work_dir: str, vocab_size: int, corpus_root: str | None = None,
                 held_out_fraction: float = 0.05) -> tuple[Any, dict[str, np.ndarray]]:
    """(tokenizer, {"train", "heldout"} token arrays): the tokenizer is trained on the train split once and kept
    at ``work_dir/tokenizer.json``; token arrays are cached under ``work_dir/tokens``."""
    from tokenizers import Tokenizer

    from jspec.train.corpus import cached_splits, stdlib_files
    from jspec.train.tokenizer import EOS_ID, train_bpe_tokenizer

    os.makedirs(work_dir, exist_ok=True)
    path = os.path.join(work_dir, "tokenizer.json")
    if os.path.isfile(path):
        tokenizer = Tokenizer.from_file(path)
    else:
        tokenizer = train_bpe_tokenizer(stdlib_files(corpus_root, held_out_fraction)["train"], vocab_size)
        tokenizer.save(path)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"{path} has vocab size {tokenizer.get_vocab_size()}, expected {vocab_size}; use a fresh "
                         f"work dir")
    return tokenizer, cached_splits(tokenizer, os.path.join(work_dir, "tokens"), EOS_ID, corpus_root,
                                    held_out_fraction)


def train_target(out_dir: str, work_dir: str, hf_config: dict, train: TrainConfig, corpus_root: str | None = None,
                 held_out_fraction: float = 0.05, progress: bool = True,
                 log: Callable[[str], None] = print) -> dict:
    """Tokenizer + corpus + training + HF export to ``out_dir``; returns the report (also written to
    ``out_dir/train_report.json``): final held-out loss, train loss curve summary, wall time."""
    started = time.perf_counter()
    tokenizer, splits = prepare_data(work_dir, hf_config["vocab_size"], corpus_root, held_out_fraction)
    params, report = train_lm(hf_config, train, splits["train"], splits["heldout"], work_dir, progress, log)
    export_hf(out_dir, hf_config, params, tokenizer)
    summary = {"train_config": dataclasses.asdict(train), "heldout_loss": report["heldout"][-1][1]
               if report["heldout"] else None, "heldout_curve": report["heldout"],
               "first_losses": report["losses"][:5], "last_losses": report["losses"][-5:],
               "train_tokens": int(len(splits["train"])), "heldout_tokens": int(len(splits["heldout"])),
               "wall_seconds": time.perf_counter() - started}
    with open(os.path.join(out_dir, "train_report.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def load_hf_llama(src: str, dtype: str = "float32") -> tuple[ModelConfig, Any, dict]:
    """(config, params, hf_config) of a HF Llama-family directory, read straight from its safetensors."""
    from models.checkpoint import (DTYPES, hf_to_params, ignore_tied_lm_head, iter_safetensors, llama_param_path,
                                   read_hf_config, safetensors_files)

    hf_config = read_hf_config(src)
    config = from_hf_config(hf_config)
    abstract = param_shapes(config, DTYPES[dtype])
    params = hf_to_params(iter_safetensors(safetensors_files(src)), abstract, DTYPES[dtype], llama_param_path,
                          ignore_tied_lm_head(config))
    return config, params, hf_config


def corpus_for(model_dir: str, work_dir: str, corpus_root: str | None = None,
               held_out_fraction: float = 0.05) -> tuple[Any, dict[str, np.ndarray]]:
    """(tokenizer, token splits) with the tokenizer.json of ``model_dir`` (a trained target), cached under
    ``work_dir/tokens``."""
    from tokenizers import Tokenizer

    from jspec.train.corpus import cached_splits
    from jspec.train.tokenizer import EOS_ID

    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    return tokenizer, cached_splits(tokenizer, os.path.join(work_dir, "tokens"), EOS_ID, corpus_root,
                                    held_out_fraction)


def self_generated_tokens(config: ModelConfig, params: Any, tokens: np.ndarray, work_dir: str, num_sequences: int,
                          prompt_len: int = 64, new_tokens: int = 192, batch_size: int = 32, seed: int = 0,
                          eos_id: int = 2, log: Callable[[str], None] = print) -> np.ndarray:
    """u16[N]: the target's own greedy continuations of ``num_sequences`` random ``prompt_len``-token windows
    of ``tokens`` (prompt + continuation + ``eos_id`` each), cached at ``work_dir/generated.npy``.

    Drafters trained on these see the text they will be asked to draft: the target's greedy output."""
    from jspec.engine import SpecEngine

    path = os.path.join(work_dir, "generated.npy")
    if os.path.isfile(path):
        return np.load(path)
    os.makedirs(work_dir, exist_ok=True)
    engine = SpecEngine(config, params, max_batch_size=batch_size, max_seq_len=prompt_len + new_tokens)
    rng = np.random.default_rng((seed, 2 ** 20))
    pieces, started = [], time.perf_counter()
    for _ in range(0, num_sequences, batch_size):
        prompts = sample_windows(tokens, batch_size, prompt_len, rng)
        out = engine.generate([p.tolist() for p in prompts], max_new_tokens=new_tokens)
        pieces += [np.concatenate([p, np.asarray(g, np.int64), [eos_id]]) for p, g in zip(prompts, out.token_ids)]
    generated = np.concatenate(pieces).astype(np.uint16)
    log(f"generated {len(pieces)} greedy continuations ({len(generated)} tokens) in "
        f"{time.perf_counter() - started:.0f}s")
    np.save(path + ".tmp.npy", generated)
    os.replace(path + ".tmp.npy", path)
    return generated


def mix_with_generated(corpus: np.ndarray, generated: np.ndarray, seed: int = 0,
                       generated_fraction: float = 0.5) -> np.ndarray:
    """The generated tokens followed by a random stretch of the corpus, so that the generated tokens are
    ``generated_fraction`` of the whole (0.5: half and half)."""
    if len(generated) == 0:
        return corpus
    size = min(int(round(len(generated) * (1.0 - generated_fraction) / generated_fraction)), len(corpus))
    start = int(np.random.default_rng(seed).integers(0, len(corpus) - size + 1))
    return np.concatenate([generated, corpus[start:start + size]])
