"""GenerateSetup: everything static about a generate call (it fixes every shape in the program)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable

import jax
import numpy as np
from jax.sharding import Mesh

from jspec.attention import target_attention
from jspec.config import SpecConfig
from jspec.drafters.base import Drafter
from jspec.logprobs import check_logprobs_mode, check_num_logprobs
from models.attention import AttentionFn
from models.checkpoint import DTYPES
from models.config import ModelConfig
from models.llama import LlamaModel


@dataclasses.dataclass(frozen=True)
class GenerateSetup:
    """Static configuration of ``jspec.generate``; hashable, so it is the one static argument.

    target: the target model's config; max_seq_len: S, token slots per sequence (prompt + new tokens);
    dtype: activation/param dtype name; drafter: a static drafter object (jspec/drafters/base.py), None for
    plain decoding; attention_fn: the target's attention (None: ``jspec.attention.target_attention`` with
    the spec's ``kernels``); force_accept: accept exactly min(N, depth) drafts per
    step (benchmarks only); mesh: the ("data", "model") device mesh the program is split over
(``jspec.sharding``), None on one device. The drafter's ``max_seq_len`` is kept equal to the setup's (:meth:`with_max_seq_len`).
    capture_layers: target layers whose residual-stream states ``generate`` keeps for every token (prompt and
    generated) in ``FeatureState.hidden_states`` (:func:`check_capture_layers`); () keeps none.
    compiler_options: XLA options as ((name, value), ...) that every program of this setup compiles with; None
    (the default): chosen per backend and step kind by ``jspec.compile_options.program_options``.
    logprobs: None (none recorded), or K >= 0: every generated token's log-probability and the K most likely
    tokens at its position are kept in ``FeatureState.logprobs`` (``jspec.logprobs``); logprobs_mode: vLLM's
    "raw_logprobs" (the target's) or "processed_logprobs" (``jspec.logprobs.recorded_logits``).
    max_position: None (positions reach max_seq_len - 1), or the bound positions stay below in a program whose
    buffers run past its context (:meth:`with_view_len`); the model's limit is checked against it.
    logits_processors: the target's logits pass through ``jspec.logits_processors`` (penalties, logit_bias,
    min_tokens) with the per-row parameters in ``FeatureInputs.processors``.
    """

    target: ModelConfig
    max_seq_len: int
    dtype: str = "float32"
    drafter: Drafter | None = None
    attention_fn: AttentionFn | None = None
    force_accept: int | None = None
    mesh: Mesh | None = None
    capture_layers: tuple[int, ...] = ()
    compiler_options: tuple[tuple[str, str], ...] | None = None
    logprobs: int | None = None
    logprobs_mode: str = "raw_logprobs"
    logits_processors: bool = False
    max_position: int | None = None

    def __post_init__(self):
        if not isinstance(self.max_seq_len, int) or self.max_seq_len < 2:
            raise ValueError(f"max_seq_len={self.max_seq_len!r}: expected an integer >= 2")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: expected one of {sorted(DTYPES)}")
        self.target.check_max_seq_len(self.max_seq_len if self.max_position is None else self.max_position)
        if self.force_accept is not None and (not isinstance(self.force_accept, int) or self.force_accept < 0):
            raise ValueError(f"force_accept={self.force_accept!r}: expected an integer >= 0")
        if not isinstance(self.capture_layers, tuple):
            raise ValueError(f"capture_layers={self.capture_layers!r}: expected a tuple of layer indices")
        check_capture_layers(self.capture_layers, self.target.num_layers, name="capture_layers")
        check_num_logprobs(self.logprobs, self.target.vocab_size)
        check_logprobs_mode(self.logprobs_mode)
        options = self.compiler_options
        if options is not None and not (isinstance(options, tuple) and all(
                isinstance(o, tuple) and len(o) == 2 and all(isinstance(x, str) for x in o) for o in options)):
            raise ValueError(f"compiler_options={options!r}: expected None or a tuple of (name, value) string "
                             f"pairs")

    def with_max_seq_len(self, max_seq_len: int) -> "GenerateSetup":
        """The same setup with shorter buffers (the engine sizes them per request bucket)."""
        drafter = None if self.drafter is None else self.drafter.with_max_seq_len(max_seq_len)
        return dataclasses.replace(self, max_seq_len=max_seq_len, drafter=drafter)

    def with_view_len(self, view_len: int) -> "GenerateSetup":
        """The same setup over buffers of ``view_len`` slots whose positions stay below this setup's context (a
        cached prefill's view runs a prompt width past it): a context at the model's limit stays valid."""
        limit = self.max_seq_len if self.max_position is None else self.max_position
        return dataclasses.replace(self.with_max_seq_len(view_len), max_position=min(limit, view_len))

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
    def drafter_tap_layers(self) -> tuple[int, ...]:
        return () if self.drafter is None else tuple(self.drafter.tap_layers)

    @property
    def tap_layers(self) -> tuple[int, ...]:
        """The layers the target taps: the drafter's, in its order, then the capture layers it does not tap."""
        drafter = self.drafter_tap_layers
        return drafter + tuple(layer for layer in self.capture_layers if layer not in drafter)

    def drafter_taps(self, taps: jax.Array | None) -> jax.Array | None:
        """The target's taps [len(tap_layers), B, T, H] -> the drafter's own [len(drafter_tap_layers), B, T, H]
        (None when it reads none)."""
        count = len(self.drafter_tap_layers)
        return None if count == 0 else taps[:count]

    def captured_taps(self, taps: jax.Array) -> jax.Array:
        """The target's taps [len(tap_layers), B, T, H] -> the capture layers' [len(capture_layers), B, T, H]."""
        layers = self.tap_layers
        return taps[np.asarray([layers.index(layer) for layer in self.capture_layers])]

    @property
    def cache_slots(self) -> int:
        """S_cache: the T tree tokens of a step are written past the committed ones before commit."""
        return self.max_seq_len + (1 if self.spec is None else self.spec.tree_size)

    def target_model(self) -> LlamaModel:
        """The target, unrolled over per-layer params (``models.llama.unstack_layers``) and a per-layer cache."""
        attention_fn = self.attention_fn
        if attention_fn is None:
            attention_fn = functools.partial(target_attention, impl="auto" if self.spec is None else self.spec.kernels)
        return LlamaModel(self.target, self.jnp_dtype, attention_fn, scan_layers=False)


def check_capture_layers(layers: Iterable[int], num_layers: int, *,
                         name: str = "capture_hidden_states") -> tuple[int, ...]:
    """Validates hidden-state capture layers -> them as a tuple; ValueError naming the bad value otherwise.

    Indices are Hugging Face ``hidden_states`` indices: 0 the embeddings' output, i in 1..num_layers-1 the
    residual-stream input of layer i, and ``num_layers`` the last layer's output BEFORE the final norm (HF's
    ``hidden_states[-1]`` is that output after the norm). No duplicates. ``name``: the argument, for messages.
    """
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise ValueError(f"{name}={layers!r}: expected a sequence of layer indices")
    layers = tuple(layers)
    for layer in layers:
        if not isinstance(layer, (int, np.integer)) or isinstance(layer, bool) or not 0 <= layer <= num_layers:
            raise ValueError(f"{name} has {layer!r}: expected layer indices in 0..{num_layers} "
                             f"(0: the embeddings, i: the input of layer i, {num_layers}: the last layer's output "
                             f"before the final norm)")
    if len(set(layers)) != len(layers):
        raise ValueError(f"{name}={layers!r} repeats a layer: expected distinct indices")
    return tuple(int(layer) for layer in layers)
