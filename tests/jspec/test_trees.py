"""Static trees from EAGLE/Medusa choices: node order, parents, masks and sibling links; SpecConfig checks."""

import numpy as np
import pytest

import jspec
from jspec.config import static_choices
from jspec.trees import build_static_tree

CHOICES = ((1,), (0,), (0, 0), (1, 0), (0, 1), (0, 0, 0), (2,))


def test_static_tree_arrays():
    tree = build_static_tree(CHOICES)
    # root, then by (depth, path): (0,) (1,) (2,) (0,0) (0,1) (1,0) (0,0,0)
    np.testing.assert_array_equal(tree.parents, [-1, 0, 0, 0, 1, 1, 2, 4])
    np.testing.assert_array_equal(tree.depth, [0, 1, 1, 1, 2, 2, 2, 3])
    np.testing.assert_array_equal(tree.rank, [0, 0, 1, 2, 0, 1, 0, 0])
    np.testing.assert_array_equal(tree.next_token, [1, 4, 6, -1, 7, -1, -1, -1])
    np.testing.assert_array_equal(tree.next_sibling, [-1, 2, 3, -1, 5, -1, -1, -1])
    assert tree.topk == 3 and tree.max_depth == 3
    for i in range(tree.num_nodes):  # mask row = the node and its ancestors, by walking parents
        ancestors, j = set(), i
        while j >= 0:
            ancestors.add(j)
            j = tree.parents[j]
        assert set(np.nonzero(tree.mask[i])[0]) == ancestors
    assert [level.tolist() for level in tree.levels] == [[1, 2, 3], [4, 5, 6], [7]]


def test_chain_is_a_static_path():
    spec = jspec.SpecConfig(tree="chain", num_steps=3)
    tree = build_static_tree(static_choices(spec))
    np.testing.assert_array_equal(tree.parents, [-1, 0, 1, 2])
    assert spec.tree_size == 4 and spec.max_depth == 3 and tree.topk == 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(tree="beam"), "tree='beam'"),
    (dict(tree="dynamic", num_steps=2, topk=2, num_draft_tokens=8), "num_draft_tokens=8 exceeds"),
    (dict(tree="static"), "needs tree_choices"),
    (dict(tree="static", tree_choices=((0,), (0, 1, 0))), r"no parent path \(0, 1\)"),
    (dict(tree="static", tree_choices=((0,), (0,))), "duplicate"),
    (dict(tree="chain", tree_choices=((0,),)), "only used with tree='static'"),
    (dict(num_steps=0), "num_steps=0"),
])
def test_spec_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        jspec.SpecConfig(**kwargs)
