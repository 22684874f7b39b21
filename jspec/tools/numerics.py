"""bf16 numerics: where speculative greedy output leaves plain decoding's, and why (docs/numerics.md).

A T-token verify pass and a one-token decode step compute the same position's logits with different matmul
shapes (and, after the first speculative step, over K/V that earlier multi-token passes wrote), so in bf16 they
round differently. Greedy speculative output can leave plain decoding's only where the plain run's top two
logits are within twice the largest such difference. This module measures that difference and checks every
divergence against it:

- :func:`decode_logits`: the target's logits at every generated position, computed exactly as plain decoding
  computes them (the prefill, then one-token decode steps over the committed tokens, batched and padded as
  ``SpecEngine`` pads them);
- :func:`chunked_logits`: the same positions' logits from T-token passes (a causal ``local_mask`` over T new
  tokens: a chain verify pass whose drafts were all accepted, so its K/V stay in the cache as a speculative
  run's do);
- :func:`check_divergences`: plain vs speculative outputs -> one record per first differing token, with the
  plain run's top-2 gap there.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec.batching import pad_batch
from jspec.generate_setup import GenerateSetup
from models.attention import KVCache

# The largest |T-token pass logit - one-token decode logit| measured on the bundled target in bf16 over 48
# HumanEval prompts x 128 tokens, T in (4, 16) (docs/numerics.md): one bf16 spacing at its largest logits (16..32);
# the stated bound puts a safety factor of 2 over it. A greedy divergence needs the plain run's top-2 gap to be
# at most 2 x LOGIT_DIFF_BOUND: the verify pass must move plain's winner down and another token up.
MEASURED_MAX_LOGIT_DIFF = 0.125
SAFETY_FACTOR = 2.0
LOGIT_DIFF_BOUND = SAFETY_FACTOR * MEASURED_MAX_LOGIT_DIFF


def human_eval_prompts(start: int, stop: int) -> list[str]:
    from jspec.train.corpus import human_eval_prompts as all_prompts

    return [p["prompt"] for p in all_prompts()[start:stop]]


def load_engine(drafter: str | None, dtype: str, *, max_batch_size: int = 8, max_seq_len: int = 1024):
    return jspec.SpecEngine.from_pretrained(jspec.bundled_model(), drafter=drafter, dtype=dtype,
                                            max_batch_size=max_batch_size, max_seq_len=max_seq_len)


def _pad(rows: Sequence[Sequence[int]], width: int) -> np.ndarray:
    out = np.zeros((len(rows), width), np.int32)
    for b, row in enumerate(rows):
        out[b, :len(row)] = row
    return out


@functools.partial(jax.jit, static_argnames=("setup", "prompt_width", "chunk"))
def _logits(params_t, prompt_ids, prompt_lens, continuation, *, setup: GenerateSetup, prompt_width: int,
            chunk: int):
    """prompt_ids i32[B, P] right-padded, prompt_lens i32[B], continuation i32[B, N] (N % chunk == 0): the
    tokens committed after each prompt -> f32[B, N + 1, V]: row i holds the logits that predict continuation
    token i (row 0 from the prefill; row N after the last token). chunk=1: one-token decode steps, as
    ``jspec.step.decode_one``; chunk=T: T-token passes under a causal local_mask, as a chain verify pass."""
    cfg = setup.target
    batch, num = continuation.shape
    model = setup.target_model()
    cache = KVCache.for_model(cfg, batch, setup.cache_slots, setup.jnp_dtype, per_layer=True)
    positions = jnp.broadcast_to(jnp.arange(prompt_width, dtype=jnp.int32), (batch, prompt_width))
    out = model.apply({"params": params_t}, prompt_ids, positions, cache, jnp.zeros((batch,), jnp.int32),
                      logits_index=(prompt_lens - 1)[:, None])
    first = out.logits[:, 0]
    mask = None if chunk == 1 else jnp.broadcast_to(jnp.tril(jnp.ones((chunk, chunk), bool)), (batch, chunk, chunk))

    def step(cache, i):
        cache_len = prompt_lens + i * chunk
        tokens = jax.lax.dynamic_slice_in_dim(continuation, i * chunk, chunk, axis=1)
        pos = cache_len[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None]
        o = model.apply({"params": params_t}, tokens, pos, cache, cache_len, local_mask=mask)
        return o.cache, o.logits

    _, rest = jax.lax.scan(step, out.cache, jnp.arange(num // chunk))
    rest = jnp.moveaxis(rest, 0, 1).reshape(batch, num, -1)  # [B, N/chunk, chunk, V] -> [B, N, V]
    return jnp.concatenate([first[:, None], rest], axis=1)


def _run_logits(engine, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]], chunk: int,
                max_new_tokens: int) -> list[np.ndarray]:
    """Per prompt b, f32[len(continuations[b]) + 1, V] (see :func:`_logits`). The batch is padded as
    ``SpecEngine.generate`` pads it for ``max_new_tokens`` (rows, prompt width and cache buckets: these shapes can
    change rounding); continuations are padded with token 0 to a common multiple of ``chunk``."""
    batch = pad_batch(prompts, max_new_tokens=max_new_tokens, stop_ids=engine.eos_token_ids,
                      max_batch_size=engine.max_batch_size, max_seq_len=engine.setup.max_seq_len)
    rows, prompt_width = batch.prompt_ids.shape
    num = -(-max(len(c) for c in continuations) // chunk) * chunk
    setup = engine.setup.with_max_seq_len(max(batch.seq_len, prompt_width + num))
    padded = np.zeros((rows, num), np.int32)
    padded[:len(continuations)] = _pad(continuations, num)
    logits = _logits(engine.params, jnp.asarray(batch.prompt_ids), jnp.asarray(batch.prompt_lens),
                     jnp.asarray(padded), setup=setup, prompt_width=prompt_width, chunk=chunk)
    logits = np.asarray(logits)
    return [logits[b, :len(c) + 1] for b, c in enumerate(continuations)]


def decode_logits(engine, prompts, continuations, max_new_tokens: int) -> list[np.ndarray]:
    """The logits plain decoding (``engine``, drafter=None, called with ``max_new_tokens``) computed at every
    position of ``continuations`` (its output), and one past."""
    return _run_logits(engine, prompts, continuations, 1, max_new_tokens)


def chunked_logits(engine, prompts, continuations, chunk: int, max_new_tokens: int) -> list[np.ndarray]:
    """The same positions' logits from ``chunk``-token passes under a causal mask."""
    return _run_logits(engine, prompts, continuations, chunk, max_new_tokens)


def bf16_ulp(x: np.ndarray) -> np.ndarray:
    """The spacing of bf16 numbers at magnitude x (8 significant bits: 2^(floor(log2 x) - 7))."""
    return np.exp2(np.floor(np.log2(np.maximum(x, 1e-30))) - 7)


def top2_gap(logits: np.ndarray) -> float:
    top = np.sort(logits)[-2:]
    return float(top[1] - top[0])


@dataclasses.dataclass(frozen=True)
class Divergence:
    prompt: int          # index into the prompts
    position: int        # index of the first differing generated token
    plain_token: int
    spec_token: int
    top2_gap: float      # the plain run's top-2 logit gap at that position
    pick_gap: float      # plain logit of plain's token minus plain logit of the speculative token (>= top2_gap)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_divergences(plain_ids, spec_ids, plain_logits: list[np.ndarray]) -> list[Divergence]:
    """One Divergence per prompt whose speculative tokens leave the plain ones. ``plain_ids``/``spec_ids``:
    generated tokens (without the prompt); ``plain_logits[b][i]``: the plain logits that predict plain token i."""
    found = []
    for b, (plain, spec) in enumerate(zip(plain_ids, spec_ids)):
        i = first_divergence(plain, spec)
        if i is None or i >= len(plain) or i >= len(spec):
            continue
        row = plain_logits[b][i]
        found.append(Divergence(b, i, plain[i], spec[i], top2_gap(row), float(row[plain[i]] - row[spec[i]])))
    return found


def generated(engine, prompts, max_new_tokens: int) -> list[list[int]]:
    return engine.generate(prompts, max_new_tokens=max_new_tokens).token_ids


def measure(prompts: Sequence[str], *, max_new_tokens: int = 128, drafters=("eagle3", "ngram"),
            chunks=(4, 16), dtype: str = "bfloat16", batch_size: int = 8) -> dict:
    """Everything docs/numerics.md reports, over ``prompts`` in batches of ``batch_size``: tokens generated,
    whether the recomputed plain logits reproduce plain decoding's tokens, the largest |T-token pass - decode
    step| logit difference per T (absolute, and in bf16 spacings at each row's largest |logit|), and each
    drafter's divergences from plain decoding with the plain top-2 gap there."""
    engines = {name: load_engine(name, dtype, max_batch_size=batch_size) for name in (None, *drafters)}
    plain = engines[None]
    report = {"dtype": dtype, "prompts": len(prompts), "max_new_tokens": max_new_tokens, "tokens": 0,
              "recomputed_plain_matches": True, "max_abs_logit": 0.0, "logit_diff": {c: 0.0 for c in chunks},
              "logit_diff_spacings": {c: 0.0 for c in chunks}, "plain_exact_ties": 0, "plain_near_ties": 0,
              "divergences": {name: [] for name in drafters}}
    for start in range(0, len(prompts), batch_size):
        ids = plain.encode(prompts[start:start + batch_size])
        plain_ids = generated(plain, ids, max_new_tokens)
        dec = decode_logits(plain, ids, plain_ids, max_new_tokens)
        report["tokens"] += sum(len(p) for p in plain_ids)
        report["recomputed_plain_matches"] &= all(np.argmax(d[:len(p)], -1).tolist() == p
                                                  for d, p in zip(dec, plain_ids))
        gaps = np.concatenate([np.diff(np.sort(d[:len(p)], -1)[:, -2:], axis=-1)[:, 0] for d, p in zip(dec, plain_ids)])
        report["plain_exact_ties"] += int((gaps == 0).sum())
        report["plain_near_ties"] += int((gaps <= 2 * LOGIT_DIFF_BOUND).sum())  # positions a divergence could be at
        report["max_abs_logit"] = max(report["max_abs_logit"], float(max(np.abs(d).max() for d in dec)))
        for chunk in chunks:
            ch = chunked_logits(plain, ids, plain_ids, chunk, max_new_tokens)
            diff = [np.abs(c - d).max(-1) for c, d in zip(ch, dec)]
            report["logit_diff"][chunk] = max(report["logit_diff"][chunk], float(max(x.max() for x in diff)))
            spacings = max(float((x / bf16_ulp(np.abs(d).max(-1))).max()) for x, d in zip(diff, dec))
            report["logit_diff_spacings"][chunk] = max(report["logit_diff_spacings"][chunk], spacings)
        for name in drafters:
            spec_ids = generated(engines[name], ids, max_new_tokens)
            for d in check_divergences(plain_ids, spec_ids, dec):
                report["divergences"][name].append(dataclasses.asdict(dataclasses.replace(d, prompt=d.prompt + start)))
    return report
