"""What the drafters share: ``spec``, ``max_seq_len`` and the tree buffers and cache sizes that follow from them."""

from __future__ import annotations

import dataclasses

from typing import Any

from jspec.config import SpecConfig, static_choices
from jspec.drafters.base import PrefillContext
from jspec.sharding import replicated_specs
from jspec.state_layout import per_row
from jspec.drafters.tree_search import dynamic_window_size
from jspec.trees import StaticTree, build_static_tree


class DrafterBase:
    """Mixed into every drafter (a frozen dataclass with at least the fields ``spec: SpecConfig`` and
    ``max_seq_len: int``): what follows from those two."""

    spec: SpecConfig
    max_seq_len: int

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return ()

    @property
    def caches_prefix(self) -> bool:
        """Whether :meth:`prefill_cached` can start this drafter from a cached prefix: a drafter that reads no
        target states reruns its prefill over the whole prompt; one that does must override both."""
        return not self.tap_layers

    def prefill_cached(self, params_t: Any, params_d: Any, state: Any, ctx: PrefillContext,
                       cached_lens: Any) -> Any:
        """The state after a prefill whose first ``cached_lens[b]`` (i32[B]) prompt positions were computed before:
        a prefix-cache hit, their slots already in ``state`` (the server's paged view of the row; its other
        leaves stale). ctx.prompt_ids: i32[B, S] the row's token buffer, the whole prompt from position 0;
        ctx.taps: the target's taps at the uncached positions only, [len(tap_layers), B, W, H] (tap j of row b
        at position cached_lens[b] + j), or None. This default reruns :meth:`prefill` over the whole prompt."""
        del state, cached_lens
        if self.tap_layers:
            raise NotImplementedError(f"{type(self).__name__} reads target layers {self.tap_layers} and does not "
                                      f"continue from a cached prefix (caches_prefix is False)")
        return self.prefill(params_t, params_d, ctx)

    @property
    def short_chain_nodes(self) -> int | None:
        """None: every row drafts the whole tree (``base.Drafter`` says what a number means)."""
        return None

    def with_max_seq_len(self, max_seq_len: int) -> "DrafterBase":
        """The same drafter with buffers for ``max_seq_len`` token slots per sequence."""
        return dataclasses.replace(self, max_seq_len=max_seq_len)

    def param_specs(self, params_d: Any, tensor_parallel_size: int) -> Any:
        """PartitionSpecs of ``params_d`` over a ("data", "model") mesh: replicated unless a drafter says otherwise
        (``jspec.sharding`` explains each drafter's choice)."""
        del tensor_parallel_size
        return replicated_specs(params_d)

    def state_layout(self, state: Any) -> Any:
        """``state``'s structure with each leaf's declaration (``jspec.state_layout``): here every leaf per row,
        the same size at every context. A drafter keeping a buffer per position (its own K/V, a token buffer)
        declares it :class:`~jspec.state_layout.PerPosition` so the server pages it."""
        return per_row(state)

    @property
    def static_tree(self) -> StaticTree | None:
        """The chain's or static tree's numpy buffers (built at trace time); None for a dynamic tree."""
        choices = static_choices(self.spec)
        return None if choices is None else build_static_tree(choices)

    @property
    def model_cache_slots(self) -> int:
        """S_draft of a drafter with its own KV cache: committed slots, then the larger of the drafting window
        (one slot per non-root node) and a commit's extend (max_depth + 1 tokens)."""
        tree = self.static_tree
        window = tree.num_nodes - 1 if tree is not None else dynamic_window_size(self.spec.topk, self.spec.num_steps)
        return self.max_seq_len + max(window, self.spec.max_depth + 1)
