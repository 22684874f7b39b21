"""User-facing configuration: how to speculate (SpecConfig) and how to sample (SamplingParams).

Both are frozen and validated in ``__post_init__``, before anything is traced: a bad value raises ValueError
naming it. SpecConfig is static under jit (it fixes every buffer's shape); SamplingParams become per-sequence
arrays, so changing them never recompiles. :func:`check_seed` and :func:`check_token_ids` are the one check of a
seed and of token ids against the vocabulary, for the engine, the batcher and the server alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Sequence

import numpy as np

from pallas_kernels.impl import resolve_impl

TreeKind = Literal["chain", "static", "dynamic"]
TREE_KINDS = ("chain", "static", "dynamic")
SELECTIONS = ("eagle2", "top1_chain")
SEED_RANGE = 2 ** 32  # a seed of its own key is an integer in [0, SEED_RANGE)


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Shape of the draft each step proposes.

    tree: "chain" (num_steps tokens in a row), "static" (the paths in ``tree_choices``) or "dynamic"
      (EAGLE-2: per depth keep the ``topk`` best frontier nodes by cumulative log-prob, expand each by ``topk``,
      keep the ``num_draft_tokens - 1`` best candidates).
    num_steps: drafter forwards per step (the tree's maximum depth).
    topk: children per expanded node (dynamic trees).
    num_draft_tokens: T, tree nodes per sequence including the root (dynamic/static trees).
    tree_choices: static trees: paths of child ranks, e.g. ((0,), (1,), (0, 0)); every prefix must be present.
    selection: dynamic trees: "eagle2" keeps the ``num_draft_tokens - 1`` best candidates by cumulative log-prob;
      "top1_chain" always keeps the drafter's top-1 chain to full depth (``num_steps`` nodes) and fills the rest
      by cumulative log-prob, so a long greedy run is never cut short when the drafter is unsure early on.
    kernels: the lowering of the tree kernels every step runs (tree build, tree verify, the target's tree
      attention, dense or paged): "auto" (Pallas on a GPU, Mosaic on a TPU, jnp elsewhere), "pallas", "interpret",
      "tpu", "tpu_interpret" or "reference" (``pallas_kernels.impl``; the interpreters are for tests on a CPU).
    """

    tree: TreeKind = "dynamic"
    num_steps: int = 5
    topk: int = 4
    num_draft_tokens: int = 16
    tree_choices: tuple[tuple[int, ...], ...] | None = None
    selection: str = "eagle2"
    kernels: str = "auto"

    def __post_init__(self):
        resolve_impl(self.kernels)  # a ValueError naming the value and the choices
        if self.tree not in TREE_KINDS:
            raise ValueError(f"tree={self.tree!r}: expected one of {TREE_KINDS}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection={self.selection!r}: expected one of {SELECTIONS}")
        if self.selection != "eagle2" and self.tree != "dynamic":
            raise ValueError(f"selection={self.selection!r} applies to dynamic trees, not tree={self.tree!r}")
        if self.selection == "top1_chain" and self.num_draft_tokens - 1 < self.num_steps:
            raise ValueError(f"selection='top1_chain' keeps a chain of num_steps={self.num_steps} nodes, but "
                             f"num_draft_tokens={self.num_draft_tokens} leaves room for "
                             f"{self.num_draft_tokens - 1}")
        for name in ("num_steps", "topk", "num_draft_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SpecConfig.{name}={value!r}: expected a positive integer")
        if self.tree == "dynamic":
            pool = self.topk + (self.num_steps - 1) * self.topk ** 2
            if self.num_draft_tokens - 1 > pool:
                raise ValueError(f"num_draft_tokens={self.num_draft_tokens} exceeds the candidate pool of "
                                 f"topk={self.topk} x num_steps={self.num_steps} ({pool} candidates + root)")
        if self.tree == "static":
            if not self.tree_choices:
                raise ValueError("tree='static' needs tree_choices, e.g. ((0,), (1,), (0, 0))")
            object.__setattr__(self, "tree_choices", _validated_choices(self.tree_choices))
        elif self.tree_choices is not None:
            raise ValueError(f"tree_choices is only used with tree='static', not tree={self.tree!r}")

    @property
    def tree_size(self) -> int:
        """T: tree nodes per sequence, root included."""
        if self.tree == "chain":
            return self.num_steps + 1
        if self.tree == "static":
            return len(self.tree_choices) + 1
        return self.num_draft_tokens

    @property
    def max_depth(self) -> int:
        """Deepest draft node; a step commits at most max_depth + 1 tokens."""
        if self.tree == "static":
            return max(len(path) for path in self.tree_choices)
        return self.num_steps


def _validated_choices(choices: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    paths = tuple(tuple(int(c) for c in path) for path in choices)
    seen = set(paths)
    if len(seen) != len(paths):
        raise ValueError(f"tree_choices has duplicate paths: {sorted(p for p in seen if paths.count(p) > 1)}")
    for path in paths:
        if not path or any(c < 0 for c in path):
            raise ValueError(f"tree_choices path {path}: expected a non-empty tuple of child ranks >= 0")
        if len(path) > 1 and path[:-1] not in seen:
            raise ValueError(f"tree_choices path {path} has no parent path {path[:-1]} in the tree")
    return paths


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn from the target. temperature 0 = greedy; top_k 0 and top_p 1.0 disable those.

    seed: one integer for the call (prompt b draws with ``fold_in(key(seed), b)``), or one per prompt, each in
    [0, 2**32) (prompt b draws with ``fold_in(key(seed[b]), 0)``: its tokens then depend only on its prompt, its
    parameters and its seed, not on the prompts beside it; a one-prompt call with seed s draws as seed=[s]).

    Logits processors (vLLM's names, ``jspec.logits_processors``): presence_penalty, frequency_penalty (0: off),
    repetition_penalty (1: off; > 0), logit_bias ((token id, bias), ...) added to the logits, banned_token_ids
    never generated, min_tokens (stop ids, EOS included, banned before that many new tokens), ignore_eos (EOS does
    not stop the sequence).

    num_speculative_tokens: at most this many drafts accepted a step for this sequence (vLLM's server-wide
    ``num_speculative_tokens``, per request): its tree is cut below that depth before verification, so it commits
    what a drafter of that length would, greedy and sampled alike; 0: one token a step, as plain decoding; None:
    the drafter's own. Output is unchanged either way (speculation is lossless); only the speed is."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | tuple[int, ...] = 0
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    banned_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    num_speculative_tokens: int | None = None

    @property
    def processes_logits(self) -> bool:
        """Whether any logits processor is on (the program then carries their arrays)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.banned_token_ids or self.min_tokens)

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r}: expected an integer >= 1")
        cap = self.num_speculative_tokens
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
            raise ValueError(f"num_speculative_tokens={cap!r}: expected an integer >= 0 (0: one token a step) or "
                             f"None (the drafter's own)")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature={self.temperature!r}: expected a number >= 0 (0 = greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}: expected an integer >= 0 (0 = disabled)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r}: expected a number in (0, 1] (1 = disabled)")
        if isinstance(self.seed, (list, tuple)):
            try:
                seeds = tuple(check_seed(seed) for seed in self.seed)
            except ValueError:
                seeds = ()
            if not seeds:
                raise ValueError(f"seed={self.seed!r}: expected an integer, or one integer in [0, 2**32) per prompt")
            object.__setattr__(self, "seed", seeds)
        elif not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r}: expected an integer, or one integer per prompt")
        stop = tuple(self.stop_token_ids or ())
        if any(not isinstance(t, int) or t < 0 for t in stop):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r}: expected non-negative integers")
        object.__setattr__(self, "stop_token_ids", stop)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name}={value!r}: expected a number in [-2, 2] (0 = off)")
        penalty = self.repetition_penalty
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not 0.0 < penalty <= 100.0:
            raise ValueError(f"repetition_penalty={penalty!r}: expected a number in (0, 100] (1 = off)")
        bias = tuple(self.logit_bias.items()) if isinstance(self.logit_bias, dict) else tuple(self.logit_bias)
        if not all(isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], int)
                   and not isinstance(pair[0], bool) and pair[0] >= 0 and isinstance(pair[1], (int, float))
                   and not isinstance(pair[1], bool) and -100.0 <= pair[1] <= 100.0 for pair in bias):
            raise ValueError(f"logit_bias={self.logit_bias!r}: expected {{token id: bias in [-100, 100]}}")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        banned = tuple(self.banned_token_ids or ())
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in banned):
            raise ValueError(f"banned_token_ids={self.banned_token_ids!r}: expected non-negative integers")
        object.__setattr__(self, "banned_token_ids", banned)
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens={self.min_tokens!r}: expected an integer >= 0")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r}: expected True or False")


def check_seed(seed: Any) -> int:
    """``seed`` when it is an integer in [0, 2**32) (the seed of one prompt's or one request's own key); else
    ValueError naming it."""
    if not isinstance(seed, int) or not 0 <= seed < SEED_RANGE:
        raise ValueError(f"seed={seed!r}: expected an integer in [0, 2**32)")
    return seed


def check_token_ids(ids: Sequence[int], vocab_size: int, what: str) -> None:
    """Raises ValueError unless every one of ``ids`` is an integer token id in [0, vocab_size); the message says
    ``what`` holds them (e.g. "prompt 0") and names the first bad id."""
    array = np.asarray(ids)
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{what} holds {array.dtype} values: expected integer token ids")
    bad = array[(array < 0) | (array >= vocab_size)]
    if bad.size:
        raise ValueError(f"{what} has token id {int(bad[0])}, outside the vocabulary [0, {vocab_size})")


def check_processor_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Raises ValueError unless every token id ``params``' logits processors name (logit_bias's keys,
    banned_token_ids) is in the vocabulary [0, vocab_size) (:func:`check_token_ids`): the offline engine and the
    server check a request's parameters the same way."""
    for what, ids in (("logit_bias", [token for token, _ in params.logit_bias]),
                      ("banned_token_ids", params.banned_token_ids)):
        check_token_ids(list(ids), vocab_size, what)


def static_choices(spec: SpecConfig) -> tuple[tuple[int, ...], ...] | None:
    """The static tree a spec drafts (a chain is the static tree ((0,), (0, 0), ...)); None for dynamic trees."""
    if spec.tree == "chain":
        return tuple((0,) * depth for depth in range(1, spec.num_steps + 1))
    if spec.tree == "static":
        return spec.tree_choices
    return None
