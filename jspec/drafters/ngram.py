"""N-gram (prompt lookup) drafter on device: propose what followed the last time the recent tokens occurred.

No parameters, no model: the draft is the continuation of the most recent earlier occurrence of the sequence's
last n tokens (n from ``max_ngram`` down to ``min_ngram``), looked up in everything so far (prompt + generated),
as in prompt lookup decoding (Saxena 2023; vLLM's and HF's ``prompt_lookup_num_tokens``). All on device with
static shapes: for each n, one [B, S] comparison per suffix token finds every match at once; the most recent
match wins. Per sequence (L = cache_len + 1 tokens known, the last one the root)::

    tokens:  ... a b c x y ... a b c | (L)            suffix "a b c" (n = 3) matched at i, continuation c = i + n
    draft:   x y ...                                   tokens[c + m], m = 0 .. depth - 1

A continuation running into the end of the sequence repeats with period L - c (what a match that close
implies): draft[m] = tokens[c + m mod (L - c)]. With no match there is nothing to propose
(``DraftTree.drafted`` False; the nodes hold the root as placeholders): when no running sequence of the batch has
a match, the step skips the T-token verify pass and decodes the root alone, as vLLM's n-gram proposer does. Output
stays exactly the target's whatever is proposed: verification rejects what is wrong.

Trees: branch j is the continuation of the most recent match (longest n first) whose first token differs from
those of branches 0 .. j-1 (the top-k distinct continuations). ``tree="chain"`` drafts one branch;
``tree="static"`` takes choices of the form (j,), (j, 0), (j, 0, 0), ... (branch j to some depth); ``"dynamic"``
drafts branch 0 to num_steps tokens and fills the remaining num_draft_tokens - 1 - num_steps nodes with
branches 1 .. topk - 1, shallowest first. Drafts are a function of the prefix, so sampling verifies them as
deterministic drafts (``DraftTree.draft_probs`` is None).

The drafter keeps its own copy of the token buffer (the protocol hands a drafter only the committed tokens).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config import SpecConfig, static_choices
from jspec.drafters.base import CommitContext, DraftTree, DrafterSource, PrefillContext
from jspec.drafters.common import DrafterBase
from jspec.drafters.tree_search import static_draft_tree
from jspec.trees import StaticTree, build_static_tree
from jspec.state_layout import PerPosition, PerRow


class NgramState(NamedTuple):
    tokens: jax.Array  # i32[B, S] prompt + generated tokens (slot = position); slots >= length are padding
    length: jax.Array  # i32[B] tokens known (the target's seq_len: the root is the last)


def branch_choices(spec: SpecConfig) -> tuple[tuple[int, ...], ...]:
    """The tree of continuations ``spec`` asks for, as static choices (paths (j,) + (0,) * m)."""
    choices = static_choices(spec)
    if choices is not None:
        bad = [path for path in choices if any(path[1:])]
        if bad:
            raise ValueError(f"the n-gram drafter drafts branches of continuations: tree_choices paths must be "
                             f"(j,), (j, 0), (j, 0, 0), ...; got {bad[:3]}")
        return choices
    paths = [(0,) * d for d in range(1, spec.num_steps + 1)]  # branch 0 to full depth, then the others
    paths += [(j,) + (0,) * (d - 1) for d in range(1, spec.num_steps + 1) for j in range(1, spec.topk)]
    return tuple(paths[:spec.num_draft_tokens - 1])


def find_continuations(tokens: jax.Array, length: jax.Array, *, max_ngram: int, min_ngram: int,
                       num_branches: int, depth: int) -> tuple[jax.Array, jax.Array]:
    """tokens: i32[B, S]; length: i32[B] -> (drafts i32[B, num_branches, depth], found bool[B, num_branches]).

    Branch j continues the most recent match of the longest suffix (n = max_ngram .. min_ngram) whose
    continuation's first token differs from branches 0 .. j-1's. Rows without a match are 0.
    """
    batch, size = tokens.shape
    start = jnp.arange(size, dtype=jnp.int32)[None]                             # [1, S] match start i
    padded = jnp.concatenate([tokens, jnp.full((batch, max_ngram), -1, jnp.int32)], axis=1)
    matches, firsts, ns = [], [], []
    for n in range(max_ngram, min_ngram - 1, -1):
        tail = jnp.take_along_axis(tokens, jnp.clip(length[:, None] - n + jnp.arange(n)[None], 0, size - 1), axis=1)
        match = start + n < length[:, None]                                   # continuation starts before L
        for j in range(n):
            match &= padded[:, j:j + size] == tail[:, j:j + 1]
        matches.append(match)
        firsts.append(padded[:, n:n + size])                                   # token at continuation start
        ns.append(n)
    offsets = jnp.arange(depth, dtype=jnp.int32)[None]
    used = jnp.full((batch, num_branches), -1, jnp.int32)
    drafts, found = [], []
    for branch in range(num_branches):
        cont = jnp.full((batch,), -1, jnp.int32)
        for n, match, first in zip(ns, matches, firsts):
            fresh = match & ~jnp.any(first[:, :, None] == used[:, None, :], axis=-1)
            latest = jnp.max(jnp.where(fresh, start, -1), axis=1)                 # most recent match start
            cont = jnp.where((cont < 0) & (latest >= 0), latest + n, cont)
        hit = cont >= 0
        period = jnp.maximum(length - cont, 1)[:, None]
        index = jnp.clip(cont[:, None] + offsets % period, 0, size - 1)
        draft = jnp.where(hit[:, None], jnp.take_along_axis(tokens, index, axis=1), 0)
        used = used.at[:, branch].set(jnp.where(hit, draft[:, 0], -1))
        drafts.append(draft)
        found.append(hit)
    return jnp.stack(drafts, axis=1), jnp.stack(found, axis=1)


@dataclasses.dataclass(frozen=True)
class NgramDrafter(DrafterBase):
    """Static description of the drafter; params_d is ``{}`` (nothing to learn)."""

    spec: SpecConfig
    max_seq_len: int
    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self):
        for name in ("max_ngram", "min_ngram"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"NgramDrafter.{name}={value!r}: expected a positive integer")
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram={self.min_ngram} exceeds max_ngram={self.max_ngram}")
        branch_choices(self.spec)  # validates the tree shape

    @property
    def tree(self) -> StaticTree:
        return build_static_tree(branch_choices(self.spec))

    def _node_sources(self) -> tuple[np.ndarray, np.ndarray]:
        """(branch, depth) of every non-root node: numpy i32[T - 1] each (trace-time constants)."""
        tree = self.tree
        branch = np.zeros(tree.num_nodes, np.int32)
        for i in range(1, tree.num_nodes):
            branch[i] = tree.rank[i] if tree.depth[i] == 1 else branch[tree.parents[i]]
        return branch[1:], tree.depth[1:]

    # --- the protocol ------------------------------------------------------------------------------------------

    def state_layout(self, state: NgramState) -> NgramState:
        """The token buffer paged (slot = position); its length per row."""
        del state
        return NgramState(PerPosition("n-gram tokens", self.max_seq_len), PerRow())

    def prefill(self, params_t: Any, params_d: Any, ctx: PrefillContext) -> NgramState:
        del params_t, params_d
        batch, width = ctx.prompt_ids.shape
        tokens = jnp.zeros((batch, self.max_seq_len), jnp.int32).at[:, :width].set(ctx.prompt_ids)
        tokens = tokens.at[jnp.arange(batch), ctx.prompt_lens].set(ctx.first_token, mode="drop")
        return NgramState(tokens, ctx.prompt_lens + 1)

    def propose(self, params_t: Any, params_d: Any, state: NgramState, root: jax.Array, cache_len: jax.Array,
                *, sampling: Any = None, key: jax.Array | None = None) -> tuple[NgramState, DraftTree]:
        del params_t, params_d, sampling, key  # drafts are a function of the prefix
        tree = self.tree
        branch, depth = self._node_sources()
        drafts, found = find_continuations(state.tokens, cache_len + 1, max_ngram=self.max_ngram,
                                           min_ngram=self.min_ngram, num_branches=int(branch.max()) + 1,
                                           depth=tree.max_depth)
        nodes = jnp.where(found[:, branch], drafts[:, branch, depth - 1], root[:, None])  # no match: the root
        tokens = jnp.concatenate([root[:, None], nodes], axis=1)
        # Branch 0 is found whenever any branch is: without it there is nothing to propose.
        return state, static_draft_tree(tree, tokens, cache_len)._replace(drafted=found[:, 0])

    def commit(self, params_t: Any, params_d: Any, state: NgramState, ctx: CommitContext) -> NgramState:
        del params_t, params_d
        batch, width = ctx.new_tokens.shape
        index = jnp.arange(width)[None]
        slot = jnp.where(index < ctx.num_committed[:, None], state.length[:, None] + index, self.max_seq_len)
        tokens = state.tokens.at[jnp.arange(batch)[:, None], slot].set(ctx.new_tokens, mode="drop")
        return NgramState(tokens, state.length + ctx.num_committed)


def load(source: DrafterSource) -> tuple[NgramDrafter, Any]:
    """Prompt lookup has no weights: (drafter, {})."""
    return NgramDrafter(source.spec, source.max_seq_len), {}
