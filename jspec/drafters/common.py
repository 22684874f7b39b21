"""What the drafters share: ``spec``, ``max_seq_len`` and the tree buffers and cache sizes that follow from them."""

from __future__ import annotations

import dataclasses

from typing import Any

from jspec.config import SpecConfig, static_choices
from jspec.sharding import replicated_specs
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
