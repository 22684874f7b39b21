"""Prompt lookup first, a model drafter where lookup finds nothing: the ``"ngram+eagle3"`` drafter.

Code repeats itself (a name, a call, a line pattern), and where it does, prompt lookup (``ngram.py``) drafts the
continuation for free and often gets all of it accepted; elsewhere it has nothing, and a step without drafts
commits one token. A model drafter (the EAGLE-3 head) drafts everywhere, at the price of its forwards. This
drafter asks lookup first and runs the model's drafting forwards only when some row found no match of at least
``min_ngram`` tokens (Snowflake's Arctic Speculator likewise combines suffix decoding with a trained MLP/LSTM
speculator). Per row and step::

    lookup matched (suffix of >= min_ngram tokens seen before):   draft = its continuation
    otherwise:                                                     draft = the model's chain

Both draft the same chain (``tree="chain"``, ``num_steps`` tokens), so verification and commit are unchanged. The
model's ``commit`` runs every step whoever drafted: it rewrites the model's window from the committed tokens and
the target's features (the "extend"), so the model never needs the ``propose`` a lookup step skipped (the same
property ``step.root_step`` relies on), nor the state its own ``propose`` left (its window: scratch), which is
dropped. The tree carries no ``draft_probs``: verification treats every draft as a deterministic proposal, which is
exact for any proposal drawn without the target's random draws (lookup, the head's top-1, or a sampling model's own
draws, which then forgo rejection sampling's higher acceptance). Greedy output is exactly the target's, sampled
output distributed as the target's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jspec.config import SpecConfig
from jspec.drafters import eagle3
from jspec.drafters.base import CommitContext, DraftTree, DrafterSource, PrefillContext
from jspec.drafters.common import DrafterBase
from jspec.drafters.ngram import NgramDrafter


class HybridState(NamedTuple):
    model: Any   # the model drafter's state
    lookup: Any  # ngram.NgramState


@dataclasses.dataclass(frozen=True)
class LookupThenModelDrafter(DrafterBase):
    """lookup: the prompt-lookup drafter (its ``min_ngram`` is the shortest match trusted over the model);
    model: any drafter of the ``Drafter`` protocol drafting the same chain whose ``commit`` needs nothing its
    ``propose`` wrote (true of every model drafter here). params_d = the model's params."""

    model: Any
    lookup: NgramDrafter
    spec: SpecConfig
    max_seq_len: int

    def __post_init__(self):
        if self.spec.tree != "chain":
            raise ValueError(f"the lookup-then-model drafter drafts chains: expected SpecConfig(tree='chain'), got "
                             f"tree={self.spec.tree!r}")
        if self.lookup.spec != self.spec or self.lookup.max_seq_len != self.max_seq_len:
            raise ValueError(f"the lookup drafts spec={self.lookup.spec} with max_seq_len={self.lookup.max_seq_len}"
                             f"; expected the hybrid's spec={self.spec}, max_seq_len={self.max_seq_len}")
        model = self.model.spec
        if model.tree != "chain" or model.num_steps > self.spec.num_steps:
            raise ValueError(f"the model drafts spec={model}; expected a chain of at most the hybrid's "
                             f"{self.spec.num_steps} tokens")
        if self.model.max_seq_len != self._model_seq_len(self.max_seq_len):
            raise ValueError(f"the model's max_seq_len={self.model.max_seq_len}; expected "
                             f"{self._model_seq_len(self.max_seq_len)} (the hybrid's {self.max_seq_len} plus room "
                             f"for a commit of {self.spec.num_steps + 1} tokens after drafting "
                             f"{model.num_steps})")

    def _model_seq_len(self, max_seq_len: int) -> int:
        """The model's buffers: its window is sized for its own chain, and a step's commit writes up to the
        hybrid's num_steps + 1 tokens there."""
        return max_seq_len + self.spec.num_steps - self.model.spec.num_steps

    @property
    def short_chain_nodes(self) -> int | None:
        """Nodes (root included) of the model's chain when it is shorter than lookup's; None when equal."""
        depth = self.model.spec.num_steps
        return None if depth == self.spec.num_steps else depth + 1

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return self.model.tap_layers

    def with_max_seq_len(self, max_seq_len: int) -> "LookupThenModelDrafter":
        return dataclasses.replace(self, model=self.model.with_max_seq_len(self._model_seq_len(max_seq_len)),
                                   lookup=self.lookup.with_max_seq_len(max_seq_len), max_seq_len=max_seq_len)

    def param_specs(self, params_d: Any, tensor_parallel_size: int) -> Any:
        """The model's placement of its params (params_d is the model's)."""
        return self.model.param_specs(params_d, tensor_parallel_size)

    # --- the protocol ------------------------------------------------------------------------------------------

    def state_layout(self, state: HybridState) -> HybridState:
        """The model's declarations and lookup's, side by side."""
        return HybridState(self.model.state_layout(state.model), self.lookup.state_layout(state.lookup))

    def prefill(self, params_t: Any, params_d: Any, ctx: PrefillContext) -> HybridState:
        return HybridState(self.model.prefill(params_t, params_d, ctx), self.lookup.prefill(params_t, {}, ctx))

    @property
    def caches_prefix(self) -> bool:
        return self.model.caches_prefix and self.lookup.caches_prefix

    def prefill_cached(self, params_t: Any, params_d: Any, state: HybridState, ctx: PrefillContext,
                       cached_lens: jax.Array) -> HybridState:
        return HybridState(self.model.prefill_cached(params_t, params_d, state.model, ctx, cached_lens),
                           self.lookup.prefill_cached(params_t, {}, state.lookup, ctx, cached_lens))

    def propose(self, params_t: Any, params_d: Any, state: HybridState, root: jax.Array, cache_len: jax.Array,
                *, sampling: Any = None, key: jax.Array | None = None) -> tuple[HybridState, DraftTree]:
        lookup_state, found = self.lookup.propose(params_t, {}, state.lookup, root, cache_len)

        def model_chain(model_state):
            # What the model's drafting wrote to its state (its window) is scratch that its commit rewrites, so
            # it is dropped: only tokens leave the branch, and no cache passes through the cond (XLA would copy it).
            _, tree = self.model.propose(params_t, params_d, model_state, root, cache_len, sampling=sampling,
                                         key=key)
            return tree.tokens

        nodes = self.model.spec.num_steps + 1

        def lookup_only(model_state):
            del model_state
            return found.tokens[:, :nodes]

        # Skip the model's forwards when every row has a lookup draft (only the taken branch runs).
        model_tokens = jax.lax.cond(jnp.all(found.drafted), lookup_only, model_chain, state.model)
        width = found.tokens.shape[1]
        if nodes < width:  # a shorter model chain: the root holds the nodes it leaves (the step does not verify them)
            model_tokens = jnp.concatenate([model_tokens, jnp.broadcast_to(root[:, None], (root.shape[0],
                                                                                          width - nodes))], axis=1)
        tokens = jnp.where(found.drafted[:, None], found.tokens, model_tokens)
        full = found.drafted if nodes < width else None
        return HybridState(state.model, lookup_state), found._replace(tokens=tokens, drafted=None, full=full)

    def commit(self, params_t: Any, params_d: Any, state: HybridState, ctx: CommitContext) -> HybridState:
        return HybridState(self.model.commit(params_t, params_d, state.model, ctx),
                           self.lookup.commit(params_t, {}, state.lookup, ctx))


# The head reads its last 128 committed slots only, so a head forward costs the same at any sequence length; its
# acceptance did not drop (docs/results/history.md, "Notes moved from code comments").
HEAD_ATTENTION_SPAN = 128
HEAD_MAX_DEPTH = 7


def load_ngram_eagle3(source: DrafterSource) -> tuple[LookupThenModelDrafter, Any]:
    """``"ngram+eagle3"``: lookup of the last 3 tokens first, the EAGLE-3 head at ``source.path`` (the bundled
    one, by the registry) elsewhere. 3 tokens, not 2: trusting 2-token matches too cost acceptance on the
    calibration prompts for about the same on HumanEval (docs/results/history.md)."""
    depth = min(source.spec.num_steps, HEAD_MAX_DEPTH)
    model_spec = dataclasses.replace(source.spec, num_steps=depth)
    model, params = eagle3.load(source._replace(spec=model_spec,
                                                max_seq_len=source.max_seq_len + source.spec.num_steps - depth))
    model = dataclasses.replace(model, attention_span=HEAD_ATTENTION_SPAN)
    lookup = NgramDrafter(source.spec, source.max_seq_len, max_ngram=3, min_ngram=3)
    return LookupThenModelDrafter(model, lookup, source.spec, source.max_seq_len), params
