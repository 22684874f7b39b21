"""SpecEngine: the Python API. Load, tokenize, validate, pad, call ``jspec.generate``, unpad, report.

Everything a user can get wrong is checked here, before anything is compiled. Compiled programs are cached per
(batch bucket, prompt bucket, stop-list bucket), so a second call with same-bucket prompts compiles nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec.batching import PaddedBatch, pad_batch, unpad_outputs, validate_prompts
from jspec.config import SamplingParams, SpecConfig
from jspec.generate import GenerateResult, generate
from jspec.generate_setup import GenerateSetup
from jspec.sampling import SamplingArrays
from models.checkpoint import load_llama
from models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class GenerateStats:
    """acceptance_length: mean tokens committed per target verify step (>= 1; prefill's token excluded).
    accepted_per_position[i]: fraction of verify steps that accepted at least i + 1 draft tokens.
    tokens_per_second: new tokens of real prompts / run seconds (compilation excluded)."""

    acceptance_length: float
    tokens_per_second: float
    num_verify_steps: int
    accepted_per_position: list[float]
    num_generated_tokens: int
    run_seconds: float
    compile_seconds: float


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    token_ids: list[list[int]]
    texts: list[str] | None
    stats: GenerateStats


def _load_tokenizer(model_dir: str):
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(path)


def _generation_eos(model_dir: str) -> tuple[int, ...]:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return ()
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return ()
    return (eos,) if isinstance(eos, int) else tuple(eos)


class SpecEngine:
    """Speculative (or, with drafter=None, plain) generation over one target model."""

    def __init__(self, target_config: ModelConfig, target_params: Any, *, tokenizer=None,
                 spec: SpecConfig | None = None, drafter: Any = None, max_batch_size: int = 8,
                 max_seq_len: int = 2048, dtype: str = "float32", eos_token_ids: Sequence[int] = ()):
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size!r}: expected an integer >= 1")
        if drafter is not None:
            raise ValueError(f"drafter={drafter!r}: only drafter=None (plain decoding) is available so far")
        if spec is not None and not isinstance(spec, SpecConfig):
            raise ValueError(f"spec={spec!r}: expected a jspec.SpecConfig or None")
        self.config = target_config
        self.params = target_params
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.setup = GenerateSetup(target=target_config, max_seq_len=max_seq_len, dtype=dtype, spec=None)
        self.eos_token_ids = tuple(sorted(set(target_config.eos_token_ids) | set(eos_token_ids)))
        self._compiled: dict[tuple, Any] = {}

    @classmethod
    def from_pretrained(cls, target_dir: str | os.PathLike, drafter: Any = None, spec: SpecConfig | None = None,
                        max_batch_size: int = 8, max_seq_len: int = 2048, dtype: str | None = None) -> "SpecEngine":
        """Loads a converted checkpoint directory (see scripts/convert_checkpoint.py)."""
        target_dir = os.fspath(target_dir)
        if drafter is not None:
            raise ValueError(f"drafter={drafter!r}: only drafter=None (plain decoding) is available so far")
        config, params, stored_dtype = load_llama(target_dir, dtype)
        return cls(config, params, tokenizer=_load_tokenizer(target_dir), spec=spec, drafter=drafter,
                   max_batch_size=max_batch_size, max_seq_len=max_seq_len, dtype=stored_dtype,
                   eos_token_ids=_generation_eos(target_dir))

    # --- the call ----------------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], max_new_tokens: int = 128,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 stop_token_ids: Sequence[int] | None = None) -> GenerateOutput:
        """Generates for a batch of prompts (strings need a tokenizer; or lists of token ids)."""
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=float(temperature), top_k=top_k,
                                top_p=float(top_p), seed=seed, stop_token_ids=tuple(stop_token_ids or ()))
        ids = self._encode(prompts)
        validate_prompts(ids, vocab_size=self.config.vocab_size, max_batch_size=self.max_batch_size,
                         max_seq_len=self.setup.max_seq_len, max_new_tokens=params.max_new_tokens)
        batch = pad_batch(ids, max_new_tokens=params.max_new_tokens,
                          stop_ids=self.eos_token_ids + params.stop_token_ids,
                          max_batch_size=self.max_batch_size, max_seq_len=self.setup.max_seq_len)
        result, run_seconds, compile_seconds = self._run(batch, params)
        token_ids = unpad_outputs(np.asarray(result.tokens), batch.prompt_lens, np.asarray(result.num_generated),
                                  batch.batch_size)
        texts = None
        if self.tokenizer is not None:
            texts = [self.tokenizer.decode(t, skip_special_tokens=True) for t in token_ids]
        stats = self._stats(result, batch.batch_size, run_seconds, compile_seconds)
        return GenerateOutput(token_ids, texts, stats)

    def _encode(self, prompts) -> list[list[int]]:
        if isinstance(prompts, (str, bytes)):
            raise ValueError("prompts must be a list of prompts, got a single string; wrap it in a list")
        prompts = list(prompts)
        if prompts and all(isinstance(p, str) for p in prompts):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer, and this checkpoint has no tokenizer.json; "
                                 "pass token ids instead")
            return [self.tokenizer.encode(p).ids for p in prompts]
        if any(isinstance(p, str) for p in prompts):
            raise ValueError("prompts mixes strings and token-id lists; pass one kind")
        return [list(p) for p in prompts]

    def _arguments(self, batch: PaddedBatch, params: SamplingParams) -> tuple:
        rows = batch.prompt_ids.shape[0]
        sampling = SamplingArrays(jnp.full((rows,), params.temperature, jnp.float32),
                                  jnp.full((rows,), params.top_k, jnp.int32),
                                  jnp.full((rows,), params.top_p, jnp.float32))
        return (self.params, None, jnp.asarray(batch.prompt_ids), jnp.asarray(batch.prompt_lens),
                jax.random.key(params.seed), jnp.asarray(batch.max_new_tokens), jnp.asarray(batch.stop_ids),
                sampling)

    def _run(self, batch: PaddedBatch, params: SamplingParams) -> tuple[GenerateResult, float, float]:
        args = self._arguments(batch, params)
        bucket = (batch.prompt_ids.shape, batch.stop_ids.shape)
        compile_seconds = 0.0
        if bucket not in self._compiled:
            start = time.perf_counter()
            self._compiled[bucket] = generate.lower(*args, setup=self.setup).compile()
            compile_seconds = time.perf_counter() - start
        start = time.perf_counter()
        result = jax.block_until_ready(self._compiled[bucket](*args))
        return result, time.perf_counter() - start, compile_seconds

    @property
    def num_compiled(self) -> int:
        """Programs compiled so far (one per bucket seen)."""
        return len(self._compiled)

    def _stats(self, result: GenerateResult, batch_size: int, run_seconds: float,
               compile_seconds: float) -> GenerateStats:
        num_generated = np.asarray(result.num_generated)[:batch_size]
        num_steps = np.asarray(result.num_steps)[:batch_size]
        hist = np.asarray(result.accepted_hist)[:batch_size].sum(axis=0)
        total_steps = int(num_steps.sum())
        from_steps = int(np.maximum(num_generated - 1, 0).sum())  # the prefill's token is not a step's
        acceptance = from_steps / total_steps if total_steps else 1.0
        per_position = [float(hist[i + 1:].sum() / total_steps) if total_steps else 0.0
                        for i in range(len(hist) - 1)]
        total_new = int(num_generated.sum())
        return GenerateStats(acceptance_length=acceptance,
                             tokens_per_second=total_new / run_seconds if run_seconds > 0 else 0.0,
                             num_verify_steps=total_steps, accepted_per_position=per_position,
                             num_generated_tokens=total_new, run_seconds=run_seconds,
                             compile_seconds=compile_seconds)
