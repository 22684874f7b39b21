"""Tree build: kernel == reference on random and adversarial trees; reference == a brute-force oracle;
SGLang's published test vector."""

import numpy as np
import pytest
import jax.numpy as jnp

from pallas_kernels.tree_build import (build_dynamic_tree, num_mask_words, pack_mask_reference,
                                       tree_from_parents)
from tests.pallas_kernels.stacked import stacked

FORMS = ["interpret", "tpu_interpret", pytest.param("pallas", marks=pytest.mark.gpu),
         pytest.param("tpu", marks=pytest.mark.tpu)]
# slow: the TPU (Mosaic) form in Pallas's TPU interpreter (issue 31: seconds a case on a CPU); default tier: the Triton
# form's interpreter on every case, and the TPU form's on the SGLang vector and one garbage dynamic tree
KERNEL_IMPLS = [pytest.param(form, marks=pytest.mark.slow) if form == "tpu_interpret" else form for form in FORMS]


# ----------------------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------------------


def eagle2_candidates(rng, topk, num_steps, num_nodes):
    """Simulates an EAGLE-2 drafter: (parent_list i32[topk*(num_steps-1)+1], selected_index i32[T-1]).

    Candidate ids follow SGLang: the root's topk children are 0..topk-1; at step s >= 1, child j of beam node k
    is topk + (s-1)*topk^2 + k*topk + j, and parent_list[1 + (s-1)*topk + k] is beam node k's candidate id.
    Scores are cumulative products of probabilities in (0, 1), so a child never outscores its parent and the
    T-1 best always include every selected node's parent.
    """
    scores = list(rng.uniform(0.01, 1.0, topk))
    beam = list(np.argsort(scores)[::-1][:topk])
    parent_list = [-1]
    for step in range(1, num_steps):
        parent_list += [int(c) for c in beam]
        base = topk + (step - 1) * topk * topk
        new = []
        for k, parent in enumerate(beam):
            for j in range(topk):
                scores.append(scores[parent] * rng.uniform(0.01, 1.0))
                new.append(base + k * topk + j)
        beam = sorted(new, key=lambda c: -scores[c])[:topk]
    selected = sorted(np.argsort(np.asarray(scores))[::-1][:num_nodes - 1].tolist())
    return np.asarray(parent_list, np.int32), np.asarray(selected, np.int32)


def random_parents(rng, kind, num_nodes):
    """i32[T] parents of a random tree ("random"), a chain, a star, or garbage ("invalid")."""
    node = np.arange(num_nodes)
    if kind == "random":
        parents = np.array([-1] + [rng.integers(0, i) for i in range(1, num_nodes)])
    elif kind == "chain":
        parents = node - 1
    elif kind == "star":
        parents = np.where(node == 0, -1, 0)
    else:
        parents = rng.integers(-2, num_nodes + 2, num_nodes)
    return parents.astype(np.int32)


def oracle(parents, seq_len):
    """Brute force from the parents of a valid tree: (mask, positions, next_token, next_sibling)."""
    num_nodes = len(parents)
    mask = np.zeros((num_nodes, num_nodes), bool)
    for i in range(num_nodes):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j] if j > 0 else -1
    children = [[j for j in range(1, num_nodes) if parents[j] == i] for i in range(num_nodes)]
    next_token = [c[0] if c else -1 for c in children]
    next_sibling = [-1] * num_nodes
    for c in children:
        for a, b in zip(c, c[1:]):
            next_sibling[a] = b
    return mask, seq_len + mask.sum(1) - 1, np.array(next_token), np.array(next_sibling)


def dynamic_parents_oracle(parent_list, selected, topk):
    """Parents of the nodes of a valid dynamic tree, by searching selected for each parent candidate."""
    parents = [-1]
    for g in selected:
        slot = g // topk
        parents.append(0 if slot == 0 else 1 + list(selected).index(parent_list[slot]))
    return np.array(parents)


def assert_trees_equal(actual, expected):
    for name in expected._fields:
        np.testing.assert_array_equal(np.asarray(getattr(actual, name)), np.asarray(getattr(expected, name)),
                                      err_msg=name)


def assert_matches_oracle(tree, parents_per_seq, seq_lens, packed):
    batch, num_nodes = tree.positions.shape
    for b in range(batch):
        mask, positions, next_token, next_sibling = oracle(parents_per_seq[b], seq_lens[b])
        expected_mask = np.asarray(pack_mask_reference(jnp.asarray(mask))) if packed else mask
        np.testing.assert_array_equal(np.asarray(tree.mask[b]), expected_mask)
        np.testing.assert_array_equal(np.asarray(tree.positions[b]), positions)
        np.testing.assert_array_equal(np.asarray(tree.retrieve_next_token[b]), next_token)
        np.testing.assert_array_equal(np.asarray(tree.retrieve_next_sibling[b]), next_sibling)
        np.testing.assert_array_equal(np.asarray(tree.retrieve_index[b]), b * num_nodes + np.arange(num_nodes))


# ----------------------------------------------------------------------------------------------------------------
# SGLang's test vector
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["reference"] + FORMS)  # the TPU interpreter's form in the default tier too
def test_sglang_build_tree_kernel_efficient_vector(impl):
    # From sgl-project/sglang, sgl-kernel/tests/speculative/test_eagle_utils.py::test_build_tree_kernel_efficient
    # (topk=4, depth=4, num_draft_token=8, seq_lens=[5, 10]). That test builds parent_list as
    # torch.cat(parents_list[:-1], dim=1) and selected_index as the sorted torch.topk(7) of the flattened
    # score_list; the values below are those two tensors, computed from its literals (no ties at the cut).
    parent_list = jnp.array([[-1, 0, 1, 2, 3, 4, 8, 9, 10, 20, 24, 21, 28],
                             [-1, 0, 1, 2, 3, 4, 5, 6, 7, 24, 28, 20, 21]], jnp.int32)
    selected_index = jnp.array([[0, 1, 4, 8, 20, 24, 36],
                                [0, 4, 5, 6, 7, 24, 36]], jnp.int32)
    seq_lens = jnp.array([5, 10], jnp.int32)
    tree = build_dynamic_tree(parent_list, selected_index, seq_lens, topk=4, num_steps=4, impl=impl)
    # SGLang's positions are flat [B * T]; its retrive_next_token / retrive_next_sibling are local node ids
    # (0..T-1 within each sequence, as ours), while its retrive_index is flat (b * T + j, as ours).
    np.testing.assert_array_equal(np.asarray(tree.positions).reshape(-1),
                                  [5, 6, 6, 7, 7, 8, 8, 9, 10, 11, 12, 12, 12, 12, 13, 14])
    np.testing.assert_array_equal(tree.retrieve_index, [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]])
    np.testing.assert_array_equal(tree.retrieve_next_token, [[1, 3, 4, 5, 6, 7, -1, -1],
                                                             [1, 2, -1, 6, -1, -1, 7, -1]])
    np.testing.assert_array_equal(tree.retrieve_next_sibling, [[-1, 2, -1, -1, -1, -1, -1, -1],
                                                               [-1, -1, 3, 4, 5, -1, -1, -1]])
    np.testing.assert_array_equal(tree.valid, [True, True])


# ----------------------------------------------------------------------------------------------------------------
# Dynamic trees
# ----------------------------------------------------------------------------------------------------------------

# (batch, num_nodes, topk, num_steps, packed)
DYNAMIC_CASES = [(1, 1, 1, 1, False), (3, 2, 1, 1, True), (3, 8, 4, 4, False), (1, 8, 2, 3, True),
                 (3, 33, 4, 5, True), (1, 33, 8, 3, False), (3, 33, 1, 40, False)]


def dynamic_batch(seed, batch, num_nodes, topk, num_steps):
    rng = np.random.default_rng(seed)
    rows = [eagle2_candidates(rng, topk, num_steps, num_nodes) for _ in range(batch)]
    parent_list = np.stack([r[0] for r in rows])
    selected = np.stack([r[1] for r in rows]).reshape(batch, num_nodes - 1)
    return parent_list, selected, rng.integers(0, 100, batch).astype(np.int32)


@pytest.mark.parametrize("batch,num_nodes,topk,num_steps,packed", DYNAMIC_CASES)
def test_dynamic_reference_matches_oracle(batch, num_nodes, topk, num_steps, packed):
    parent_list, selected, seq_lens = dynamic_batch(batch * 100 + num_nodes, batch, num_nodes, topk, num_steps)
    tree = build_dynamic_tree(parent_list, selected, seq_lens, topk=topk, num_steps=num_steps, packed=packed,
                              impl="reference")
    parents = [dynamic_parents_oracle(parent_list[b], selected[b], topk) for b in range(batch)]
    assert np.asarray(tree.valid).all()
    assert_matches_oracle(tree, parents, seq_lens, packed)


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("batch,num_nodes,topk,num_steps,packed", DYNAMIC_CASES)
def test_dynamic_kernel_matches_reference(impl, batch, num_nodes, topk, num_steps, packed):
    parent_list, selected, seq_lens = dynamic_batch(batch * 7 + num_nodes, batch, num_nodes, topk, num_steps)
    kwargs = dict(topk=topk, num_steps=num_steps, packed=packed)
    assert_trees_equal(build_dynamic_tree(parent_list, selected, seq_lens, impl=impl, **kwargs),
                       build_dynamic_tree(parent_list, selected, seq_lens, impl="reference", **kwargs))


@pytest.mark.parametrize("impl", ["reference"] + KERNEL_IMPLS)
def test_dynamic_missing_parent_falls_back_to_chain(impl):
    # Sequence 0: node 2 is candidate 2 (slot 1), whose parent candidate 0 was not selected (a tie lost it).
    # Sequence 1: a valid tree. Sequence 2: a candidate id beyond the pool and a negative one.
    topk, num_steps = 2, 3
    parent_list = np.array([[-1, 0, 1, 4, 5], [-1, 0, 1, 4, 5], [-1, 0, 1, 4, 5]], np.int32)
    selected = np.array([[1, 2, 4], [0, 1, 4], [0, 99, -3]], np.int32)
    tree = build_dynamic_tree(parent_list, selected, np.array([3, 4, 5], np.int32), topk=topk,
                              num_steps=num_steps, impl=impl)
    np.testing.assert_array_equal(tree.valid, [False, True, False])
    chain = oracle(np.arange(4) - 1, 0)
    for b in (0, 2):
        np.testing.assert_array_equal(np.asarray(tree.mask[b]), chain[0])
        np.testing.assert_array_equal(np.asarray(tree.retrieve_next_token[b]), [1, 2, 3, -1])
        np.testing.assert_array_equal(np.asarray(tree.retrieve_next_sibling[b]), [-1, -1, -1, -1])
    np.testing.assert_array_equal(tree.positions, [[3, 4, 5, 6], [4, 5, 5, 6], [5, 6, 7, 8]])


# slow: the TPU interpreter's form on unpacked masks; default tier: its [True-tpu_interpret] (the same garbage, packed)
@pytest.mark.parametrize(*stacked(("packed", [False, True]), ("impl", FORMS),
                                  slow=lambda packed, impl: impl == "tpu_interpret" and packed != "True"))
def test_dynamic_kernel_matches_reference_on_garbage(impl, packed):
    # Valid EAGLE-2 trees, each with one entry of parent_list or selected_index overwritten by garbage.
    batch, num_nodes, topk, num_steps = 16, 8, 3, 3
    parent_list, selected, seq_lens = dynamic_batch(3, batch, num_nodes, topk, num_steps)
    rng = np.random.default_rng(4)
    for b in range(batch):
        target = parent_list if b % 2 else selected
        target[b, rng.integers(0, target.shape[1])] = rng.integers(-2, topk + (num_steps - 1) * topk ** 2 + 3)
    kwargs = dict(topk=topk, num_steps=num_steps, packed=packed)
    kernel = build_dynamic_tree(parent_list, selected, seq_lens, impl=impl, **kwargs)
    assert_trees_equal(kernel, build_dynamic_tree(parent_list, selected, seq_lens, impl="reference", **kwargs))
    assert 0 < np.asarray(kernel.valid).sum() < batch   # both outcomes exercised


# ----------------------------------------------------------------------------------------------------------------
# Trees from parents (static trees, chains)
# ----------------------------------------------------------------------------------------------------------------

# (batch, num_nodes, packed)
STATIC_CASES = [(1, 1, False), (3, 8, True), (3, 33, False), (1, 33, True)]
KINDS = ["random", "chain", "star", "invalid"]


def static_batch(seed, batch, num_nodes, kind):
    rng = np.random.default_rng(seed)
    parents = np.stack([random_parents(rng, kind, num_nodes) for _ in range(batch)])
    return parents, rng.integers(0, 100, batch).astype(np.int32)


@pytest.mark.parametrize("kind", KINDS[:3])
@pytest.mark.parametrize("batch,num_nodes,packed", STATIC_CASES)
def test_from_parents_reference_matches_oracle(kind, batch, num_nodes, packed):
    parents, seq_lens = static_batch(num_nodes, batch, num_nodes, kind)
    tree = tree_from_parents(parents, seq_lens, packed=packed, impl="reference")
    assert np.asarray(tree.valid).all()
    assert_matches_oracle(tree, parents, seq_lens, packed)


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("batch,num_nodes,packed", STATIC_CASES)
def test_from_parents_kernel_matches_reference(impl, batch, num_nodes, packed):
    for i, kind in enumerate(KINDS):
        parents, seq_lens = static_batch(i * 31 + num_nodes, batch, num_nodes, kind)
        assert_trees_equal(tree_from_parents(parents, seq_lens, packed=packed, impl=impl),
                           tree_from_parents(parents, seq_lens, packed=packed, impl="reference"))


def test_invalid_parents_fall_back_to_chain():
    parents = np.array([[-1, 0, 2, 1], [-1, 0, 0, 5], [7, 0, 1, 1]], np.int32)
    tree = tree_from_parents(parents, np.zeros(3, np.int32), impl="reference")
    np.testing.assert_array_equal(tree.valid, [False, False, True])
    np.testing.assert_array_equal(tree.retrieve_next_token[:2], [[1, 2, 3, -1]] * 2)
    np.testing.assert_array_equal(tree.positions, [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 2]])


def test_packed_mask_bit_layout():
    # 40 nodes in a chain: row i has bits 0..i set; word 1 starts at node 32; bit 31 is the int32 sign bit.
    tree = tree_from_parents(np.arange(40, dtype=np.int32)[None] - 1, np.zeros(1, np.int32), packed=True,
                             impl="reference")
    assert tree.mask.shape == (1, 40, num_mask_words(40)) == (1, 40, 2)
    words = np.asarray(tree.mask[0]).view(np.uint32)
    assert words[0].tolist() == [1, 0]
    assert words[31].tolist() == [0xFFFFFFFF, 0]
    assert words[33].tolist() == [0xFFFFFFFF, 0b11]


def test_static_argument_validation():
    parent_list, selected, seq_lens = np.zeros((2, 5), np.int32), np.zeros((2, 3), np.int32), np.zeros(2, np.int32)
    with pytest.raises(ValueError, match="topk=0"):
        build_dynamic_tree(parent_list, selected, seq_lens, topk=0, num_steps=3, impl="reference")
    with pytest.raises(ValueError, match="num_steps=0"):
        build_dynamic_tree(parent_list, selected, seq_lens, topk=2, num_steps=0, impl="reference")
    with pytest.raises(ValueError, match="parent_list.shape"):
        build_dynamic_tree(parent_list, selected, seq_lens, topk=3, num_steps=3, impl="reference")
    with pytest.raises(ValueError, match="seq_lens.shape"):
        tree_from_parents(np.zeros((2, 4), np.int32), np.zeros(3, np.int32), impl="reference")
    with pytest.raises(ValueError, match="impl='cuda'"):
        tree_from_parents(np.zeros((2, 4), np.int32), np.zeros(2, np.int32), impl="cuda")
