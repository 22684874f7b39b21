"""Forced acceptance (jspec.accept.forced_path, benchmarks only) against a walk of the first-child links in numpy."""

import jax.numpy as jnp
import numpy as np
import pytest

from jspec.accept import forced_path
from jspec.drafters.base import DraftTree
from jspec.trees import build_static_tree

CHAIN_3 = ((0,), (0, 0), (0, 0, 0))                                # 0 -> 1 -> 2 -> 3
TREE = ((1,), (0,), (0, 0), (1, 0), (0, 1), (0, 0, 0), (2,))       # first children 0 -> 1 -> 4 -> 7
SHALLOW_FIRST = ((0,), (1,), (1, 0), (1, 0, 0), (1, 1), (2,), (3,))  # first children 0 -> 1; depth 3 via (1,)


def draft_tree(choices_per_row, vocab: int, seed: int = 0) -> tuple[DraftTree, int]:
    """One static tree per row (all of the same size), random tokens -> (DraftTree, max depth over rows)."""
    trees = [build_static_tree(choices) for choices in choices_per_row]
    assert len({tree.num_nodes for tree in trees}) == 1
    batch, num_nodes = len(trees), trees[0].num_nodes
    stack = lambda name: jnp.asarray(np.stack([getattr(tree, name) for tree in trees]))
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (batch, num_nodes)), jnp.int32)
    positions = stack("depth") + 5
    tree = DraftTree(tokens, stack("mask"), positions, stack("next_token"), stack("next_sibling"))
    return tree, max(tree.max_depth for tree in trees)


def forced_reference(next_token: np.ndarray, logits: np.ndarray, accept: int, max_depth: int):
    """Per row: follow next_token from the root while a child exists, at most min(accept, max_depth) times."""
    batch = next_token.shape[0]
    index = np.full((batch, max_depth + 1), -1, np.int32)
    length, bonus = np.zeros(batch, np.int32), np.zeros(batch, np.int32)
    for b in range(batch):
        path = [0]
        while len(path) - 1 < min(accept, max_depth) and next_token[b, path[-1]] >= 0:
            path.append(int(next_token[b, path[-1]]))
        index[b, :len(path)] = path
        length[b] = len(path) - 1
        bonus[b] = int(np.argmax(logits[b, path[-1]]))
    return index, length, bonus


def check(choices_per_row, accept, *, vocab=11, seed=0):
    tree, max_depth = draft_tree(choices_per_row, vocab, seed)
    logits = np.random.default_rng(seed + 1).normal(size=tree.tokens.shape + (vocab,)).astype(np.float32)
    got = forced_path(tree, jnp.asarray(logits), accept=accept, max_depth=max_depth)
    want = forced_reference(np.asarray(tree.next_token), logits, accept, max_depth)
    np.testing.assert_array_equal(got.accept_index, want[0])
    np.testing.assert_array_equal(got.accept_length, want[1])
    np.testing.assert_array_equal(got.bonus, want[2])
    assert got.accept_index.dtype == got.accept_length.dtype == got.bonus.dtype == jnp.int32
    return got, logits


@pytest.mark.parametrize("accept", [0, 1, 2, 3, 4, 7])
def test_chain_accepts_min_of_n_and_depth(accept):
    got, logits = check([CHAIN_3, CHAIN_3], accept)
    n = min(accept, 3)
    np.testing.assert_array_equal(got.accept_index, [list(range(n + 1)) + [-1] * (3 - n)] * 2)  # by hand
    np.testing.assert_array_equal(got.accept_length, [n, n])
    np.testing.assert_array_equal(got.bonus, logits[:, n].argmax(-1))


@pytest.mark.parametrize("accept, path", [(0, [0]), (1, [0, 1]), (2, [0, 1, 4]), (3, [0, 1, 4, 7]),
                                          (5, [0, 1, 4, 7])])
def test_tree_follows_first_children(accept, path):
    got, logits = check([TREE], accept)
    np.testing.assert_array_equal(got.accept_index[0], path + [-1] * (4 - len(path)))  # by hand
    assert int(got.accept_length[0]) == len(path) - 1
    assert int(got.bonus[0]) == int(logits[0, path[-1]].argmax())


@pytest.mark.parametrize("accept", [0, 1, 2, 3, 6])
def test_rows_with_different_trees(accept):
    """Row 0's first-child path stops at depth 1 though its tree is 3 deep: it accepts at most 1."""
    got, _ = check([SHALLOW_FIRST, TREE, TREE], accept, seed=accept)
    assert int(got.accept_length[0]) == min(accept, 1)
    np.testing.assert_array_equal(got.accept_length[1:], [min(accept, 3)] * 2)
