"""Pallas GPU kernels for speculative decoding, each beside the pure-jnp reference that specifies it.

One file per kernel; each exports its op with ``impl="auto" | "pallas" | "interpret" | "reference"``.
This package imports neither ``jspec`` nor ``models``.
"""

from pallas_kernels.tree_attention import tree_attention, tree_attention_reference
from pallas_kernels.tree_build import TreeArrays, build_dynamic_tree, tree_from_parents
from pallas_kernels.tree_verify import Verified, verify_tree_greedy, verify_tree_sampling

__all__ = ["TreeArrays", "Verified", "build_dynamic_tree", "tree_attention", "tree_attention_reference",
           "tree_from_parents", "verify_tree_greedy", "verify_tree_sampling"]
