"""Static draft trees (EAGLE/Medusa ``tree_choices``) and chains, as numpy buffers built at trace time.

A choice is a path of child ranks from the root: ``(0,)`` is the root's best child, ``(1,)`` its second best,
``(0, 2)`` the third-best child of ``(0,)``. Nodes are numbered root first, then by (depth, path), so parents
precede children and siblings come in rank order — verification tries the drafter's best guess first.

Node ``i >= 1`` is drafted from the top-``rank[i] + 1`` tokens of its parent's draft distribution. The drafter
runs one forward per depth over the nodes of that depth; node i writes its K/V at window slot ``i - 1``, and its
window mask row marks the slots of its ancestors (itself included, the root excluded: the root's K/V is in the
committed cache of the drafter already).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class StaticTree:
    """All arrays are numpy, fixed by the choices. T = len(choices) + 1 nodes."""

    parents: np.ndarray        # i32[T] parent node, -1 for the root
    depth: np.ndarray          # i32[T] root 0
    rank: np.ndarray           # i32[T] rank among the parent's top-k (root: 0)
    mask: np.ndarray           # bool[T, T] j is i or an ancestor of i
    next_token: np.ndarray     # i32[T] first child, -1 if none
    next_sibling: np.ndarray   # i32[T] next sibling, -1 if none
    levels: tuple[np.ndarray, ...]  # levels[d - 1]: i32 node ids at depth d, d = 1..max_depth

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return len(self.levels)

    @property
    def topk(self) -> int:
        """Children a drafted node may need: max rank + 1."""
        return int(self.rank.max()) + 1

    @property
    def window_mask(self) -> np.ndarray:
        """bool[T - 1, T - 1]: node i (row i - 1) sees the window slot of node j (column j - 1)."""
        return self.mask[1:, 1:]


@functools.lru_cache(maxsize=64)
def build_static_tree(choices: tuple[tuple[int, ...], ...]) -> StaticTree:
    """Numbers the nodes of validated choices (every prefix present; see SpecConfig) and derives the arrays."""
    paths = sorted(choices, key=lambda path: (len(path), path))
    index = {(): 0}
    for i, path in enumerate(paths, start=1):
        index[path] = i
    num_nodes = len(paths) + 1
    parents = np.full(num_nodes, -1, np.int32)
    depth = np.zeros(num_nodes, np.int32)
    rank = np.zeros(num_nodes, np.int32)
    for path, i in index.items():
        if path:
            parents[i], depth[i], rank[i] = index[path[:-1]], len(path), path[-1]
    mask = np.zeros((num_nodes, num_nodes), bool)
    for i in range(num_nodes):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    next_token = np.full(num_nodes, -1, np.int32)
    next_sibling = np.full(num_nodes, -1, np.int32)
    last_child: dict[int, int] = {}
    for i in range(1, num_nodes):
        p = parents[i]
        if p in last_child:
            next_sibling[last_child[p]] = i
        else:
            next_token[p] = i
        last_child[p] = i
    levels = tuple(np.nonzero(depth == d)[0].astype(np.int32) for d in range(1, int(depth.max()) + 1))
    return StaticTree(parents, depth, rank, mask, next_token, next_sibling, levels)
