"""PARD (AMD, "PARallel Draft"): a draft model that drafts K tokens in one forward, through the draft-model path.

A PARD draft is an ordinary causal LM (target-independent, its own embedding and lm_head) trained so that
``[..., x_R, pard, pard, ...]`` predicts, at the j-th ``pard_token``, the token j + 1 ahead of x_R. The state is
the draft model's (``draft_model.py``: slots 0 .. R committed, its prediction for the root's children in
``logits``), so draft 1 is that prediction, and one causal forward over ``pard_token x (K - 1)`` at positions
R + 1 .. R + K - 1 in the window gives drafts 2 .. K (AMD's ``pard_infer.py``). ``commit`` is the draft model's:
the committed tokens' K/V are computed from their real ids (the window's pard K/V are overwritten), as PARD rolls
its cache back and re-reads the accepted tokens.

A chain takes each position's top-1; a static tree takes at depth d the rank-r token of position d (the pard
positions do not read the drafts before them). Drafts are top-k (deterministic) for greedy and sampled rows alike,
verified as such.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config import SpecConfig
from jspec.drafters import draft_model
from jspec.drafters.base import DraftTree, DrafterSource
from jspec.drafters.draft_model import DraftModelDrafter, DraftModelState
from jspec.drafters.tree_search import static_draft_tree
from models.checkpoint import read_hf_config

DEFAULT_DRAFTS = 8  # the K of AMD's training examples (para_num)


def pard_token_of(hf_config: dict) -> int | None:
    """The ``pard_token`` of a draft model's config.json when it is a PARD draft (``spd_type`` "pard" or a
    ``pard_token``), else None; ValueError for a PARD config without a usable token."""
    if hf_config.get("spd_type") != "pard" and "pard_token" not in hf_config:
        return None
    token = hf_config.get("pard_token")
    if not isinstance(token, int) or isinstance(token, bool) or token < 0:
        raise ValueError(f"a PARD draft model's config.json pard_token={token!r}: expected a token id >= 0 (AMD's "
                         f"training writes the first of its unused_tokenids there)")
    return token


@dataclasses.dataclass(frozen=True)
class PardDrafter(DraftModelDrafter):
    """A draft model with ``pard_token``: K drafts in one forward (module docstring); chains and static trees."""

    pard_token: int = -1

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.pard_token < self.draft.vocab_size:
            raise ValueError(f"pard_token={self.pard_token}: expected an id below the draft's vocab_size="
                             f"{self.draft.vocab_size}")
        if self.spec.tree == "dynamic":
            raise ValueError(f"PARD drafts a chain or a static tree, not tree={self.spec.tree!r}: its positions are "
                             f"drafted in one forward, independently of the drafts before them")

    def propose(self, params_t: Any, params_d: Any, state: DraftModelState, root: jax.Array, cache_len: jax.Array,
                *, sampling: Any = None, key: jax.Array | None = None) -> tuple[DraftModelState, DraftTree]:
        del params_t, sampling, key  # top-k drafts: deterministic, verified as such
        tree = self.static_tree
        depth = tree.max_depth
        batch = root.shape[0]
        logits = state.logits[:, None]                                   # position R: draft 1
        cache = state.cache
        if depth > 1:
            pard = jnp.full((batch, depth - 1), self.pard_token, jnp.int32)
            positions = cache_len[:, None] + 1 + jnp.arange(depth - 1, dtype=jnp.int32)[None]
            out = self._model().apply(self._params(params_d), pard, positions, cache, cache_len + 1)
            logits = jnp.concatenate([logits, out.logits], axis=1)      # [B, depth, V]
            cache = out.cache
        top = jax.lax.top_k(logits, tree.topk)[1]
        nodes = top[:, np.asarray(tree.depth[1:] - 1), np.asarray(tree.rank[1:])]
        tokens = jnp.concatenate([root[:, None], nodes.astype(jnp.int32)], axis=1)
        return state._replace(cache=cache), static_draft_tree(tree, tokens, cache_len)


def load(source: DrafterSource) -> tuple[DraftModelDrafter, Any]:
    """A converted Llama-family draft directory: a PARD draft when its config.json says so (``pard_token``), else
    an ordinary draft model (``draft_model.load``)."""
    pard_token = pard_token_of(read_hf_config(source.path))
    if pard_token is None:
        return draft_model.load(source)
    return draft_model.load(source, PardDrafter, pard_token=pard_token)


def default_spec(path: str | None) -> SpecConfig | None:
    """A PARD draft's default tree, a chain of ``DEFAULT_DRAFTS``; None (no default of its own) for any other
    draft model."""
    if path is not None and pard_token_of(read_hf_config(path)) is not None:
        return SpecConfig(tree="chain", num_steps=DEFAULT_DRAFTS)
    return None
