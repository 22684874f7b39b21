"""GenerateSetup: everything static about a generate call (it fixes every shape in the program)."""

from __future__ import annotations

import dataclasses

from jax.sharding import Mesh

from jspec.attention import target_attention
from jspec.config import SpecConfig
from jspec.drafters.base import Drafter
from models.attention import AttentionFn
from models.checkpoint import DTYPES
from models.config import ModelConfig
from models.llama import LlamaModel


@dataclasses.dataclass(frozen=True)
class GenerateSetup:
    """Static configuration of ``jspec.generate``; hashable, so it is the one static argument.

    target: the target model's config; max_seq_len: S, token slots per sequence (prompt + new tokens);
    dtype: activation/param dtype name; drafter: a static drafter object (jspec/drafters/base.py), None for
    plain decoding; attention_fn: the target's attention; force_accept: accept exactly min(N, depth) drafts per
    step (benchmarks only); mesh: the ("data", "model") device mesh the program is split over
(``jspec.sharding``), None on one device. The drafter's ``max_seq_len`` is kept equal to the setup's (:meth:`with_max_seq_len`).
    """

    target: ModelConfig
    max_seq_len: int
    dtype: str = "float32"
    drafter: Drafter | None = None
    attention_fn: AttentionFn = target_attention
    force_accept: int | None = None
    mesh: Mesh | None = None

    def __post_init__(self):
        if not isinstance(self.max_seq_len, int) or self.max_seq_len < 2:
            raise ValueError(f"max_seq_len={self.max_seq_len!r}: expected an integer >= 2")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: expected one of {sorted(DTYPES)}")
        self.target.check_max_seq_len(self.max_seq_len)
        if self.force_accept is not None and (not isinstance(self.force_accept, int) or self.force_accept < 0):
            raise ValueError(f"force_accept={self.force_accept!r}: expected an integer >= 0")

    def with_max_seq_len(self, max_seq_len: int) -> "GenerateSetup":
        """The same setup with shorter buffers (the engine sizes them per request bucket)."""
        drafter = None if self.drafter is None else self.drafter.with_max_seq_len(max_seq_len)
        return dataclasses.replace(self, max_seq_len=max_seq_len, drafter=drafter)

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]

    @property
    def spec(self) -> SpecConfig | None:
        return None if self.drafter is None else self.drafter.spec

    @property
    def tokens_per_step(self) -> int:
        """Most tokens one step commits: max draft depth + the bonus token (1 for plain decoding)."""
        return 1 if self.spec is None else self.spec.max_depth + 1

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return () if self.drafter is None else tuple(self.drafter.tap_layers)

    @property
    def cache_slots(self) -> int:
        """S_cache: the T tree tokens of a step are written past the committed ones before commit."""
        return self.max_seq_len + (1 if self.spec is None else self.spec.tree_size)

    def target_model(self) -> LlamaModel:
        """The target, unrolled over per-layer params (``models.llama.unstack_layers``) and a per-layer cache."""
        return LlamaModel(self.target, self.jnp_dtype, self.attention_fn, scan_layers=False)
