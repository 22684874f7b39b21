"""GenerateSetup: everything static about a generate call (it fixes every shape in the program)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jspec.config import SpecConfig
from models.attention import AttentionFn, dense_attention
from models.checkpoint import DTYPES
from models.config import ModelConfig
from models.llama import LlamaModel


@dataclasses.dataclass(frozen=True)
class GenerateSetup:
    """Static configuration of ``jspec.generate``; hashable, so it is the one static argument.

    target: the target model's config; max_seq_len: S, token slots per sequence (prompt + new tokens);
    dtype: activation/param dtype name; spec: None for plain decoding; attention_fn: the target's attention.
    """

    target: ModelConfig
    max_seq_len: int
    dtype: str = "float32"
    spec: SpecConfig | None = None
    attention_fn: AttentionFn = dense_attention

    def __post_init__(self):
        if not isinstance(self.max_seq_len, int) or self.max_seq_len < 2:
            raise ValueError(f"max_seq_len={self.max_seq_len!r}: expected an integer >= 2")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: expected one of {sorted(DTYPES)}")
        self.target.check_max_seq_len(self.max_seq_len)

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]

    @property
    def tokens_per_step(self) -> int:
        """Most tokens one step commits: max draft depth + the bonus token (1 for plain decoding)."""
        return 1 if self.spec is None else self.spec.max_depth + 1

    @property
    def cache_slots(self) -> int:
        """S_cache: the T tree tokens of a step are written past the committed ones before commit."""
        return self.max_seq_len + (1 if self.spec is None else self.spec.tree_size)

    def target_model(self) -> LlamaModel:
        return LlamaModel(self.target, self.jnp_dtype, self.attention_fn)
