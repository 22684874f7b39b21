"""Tree verification: kernel == reference; greedy == a brute-force walk (hypothesis); sampling is lossless
(chi-square against the exact target distribution)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from hypothesis import given, settings, strategies as st

from pallas_kernels.tree_verify import verify_tree_greedy, verify_tree_sampling
from tests.pallas_kernels.stacked import stacked

FORMS = ["interpret", "tpu_interpret", pytest.param("pallas", marks=pytest.mark.gpu),
         pytest.param("tpu", marks=pytest.mark.tpu)]
# slow: the TPU (Mosaic) form in Pallas's TPU interpreter (issue 31: seconds a case on a CPU); default tier: the Triton
# form's interpreter, and the TPU form's on the SGLang vector and one sampling case (named at their tests)
KERNEL_IMPLS = [pytest.param(form, marks=pytest.mark.slow) if form == "tpu_interpret" else form for form in FORMS]
KINDS = ["random", "chain", "star"]
P_VALUE_FLOOR = 1e-3   # chi-square tests: fixed seeds, so a pass is reproducible; a real bias gives p ~ 0


# ----------------------------------------------------------------------------------------------------------------
# Trees as numpy arrays
# ----------------------------------------------------------------------------------------------------------------


def random_parents(rng, kind, num_nodes):
    """i32[T]: a random recursive tree, a chain (depth T-1) or a star."""
    node = np.arange(num_nodes)
    if kind == "random":
        return np.array([-1] + [rng.integers(0, i) for i in range(1, num_nodes)], np.int32)
    return np.where(node == 0, -1, node - 1 if kind == "chain" else 0).astype(np.int32)


def links(parents):
    """parents i32[..., T] -> (next_token, next_sibling) i32[..., T]: children in increasing index order."""
    parents = np.asarray(parents)
    next_token = np.full(parents.shape, -1, np.int32)
    next_sibling = np.full(parents.shape, -1, np.int32)
    for idx in np.ndindex(parents.shape[:-1]):
        last_child = {}
        for j in range(1, parents.shape[-1]):
            p = parents[idx + (j,)]
            if p in last_child:
                next_sibling[idx + (last_child[p],)] = j
            else:
                next_token[idx + (p,)] = j
            last_child[p] = j
    return next_token, next_sibling


def greedy_inputs(rng, batch, num_nodes, kind, vocab=3):
    """(parents, candidates, next_token, next_sibling, target_predict); the target often agrees with a child."""
    parents = np.stack([random_parents(rng, kind, num_nodes) for _ in range(batch)])
    candidates = rng.integers(0, vocab, (batch, num_nodes)).astype(np.int32)
    predict = rng.integers(0, vocab, (batch, num_nodes)).astype(np.int32)
    for b in range(batch):
        for i in range(num_nodes):
            children = np.flatnonzero(parents[b] == i)
            if len(children) and rng.uniform() < 0.6:
                predict[b, i] = candidates[b, rng.choice(children)]
    return (parents, candidates) + links(parents) + (predict,)


def python_greedy_walk(parents, candidates, predict, num_steps):
    """Brute force from the parents: (accept_index list, accept_length, bonus)."""
    path = [0]
    while len(path) <= num_steps:
        cur = path[-1]
        children = [j for j in range(1, len(parents)) if parents[j] == cur]
        match = [j for j in children if candidates[j] == predict[cur]]
        if not match:
            break
        path.append(match[0])
    return path + [-1] * (num_steps + 1 - len(path)), len(path) - 1, predict[path[-1]]


def assert_verified_equal(actual, expected):
    for name in expected._fields:
        np.testing.assert_array_equal(np.asarray(getattr(actual, name)), np.asarray(getattr(expected, name)),
                                      err_msg=name)


# ----------------------------------------------------------------------------------------------------------------
# Greedy
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["reference"] + FORMS)  # the TPU interpreter's form in the default tier too
def test_sglang_verify_tree_greedy_vector(impl):
    # From sgl-project/sglang, sgl-kernel/tests/speculative/test_eagle_utils.py::test_verify_tree_greedy with
    # num_spec_step = 4 slots (3 draft steps). target_predict is the argmax of its target_logits (10 at the
    # listed entries, 18 elsewhere). SGLang's accept_index is flat ([[0, 3, 4, 5], [6, 10, 11, -1]]); ours is
    # local (minus b * T); its accept_token_num is our accept_length; its predicts[last accepted] our bonus.
    candidates = jnp.array([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]])
    next_token = jnp.array([[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]])
    next_sibling = jnp.array([[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]])
    predict = jnp.array([[3, 18, 18, 4, 5, 18], [11, 18, 18, 18, 12, 18]])
    out = verify_tree_greedy(candidates, next_token, next_sibling, predict, num_steps=3, impl=impl)
    np.testing.assert_array_equal(out.accept_index, [[0, 3, 4, 5], [0, 4, 5, -1]])
    np.testing.assert_array_equal(out.accept_length, [3, 2])
    np.testing.assert_array_equal(out.bonus, [18, 18])


@settings(max_examples=30, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2 ** 32 - 1), num_nodes=st.sampled_from([1, 5, 13]),
       num_steps=st.sampled_from([1, 3, 12]), kind=st.sampled_from(KINDS))
def test_greedy_reference_matches_python_walk(seed, num_nodes, num_steps, kind):
    batch = 160   # 30 examples x 160 trees
    parents, candidates, next_token, next_sibling, predict = greedy_inputs(
        np.random.default_rng(seed), batch, num_nodes, kind)
    out = verify_tree_greedy(candidates, next_token, next_sibling, predict, num_steps=num_steps,
                             impl="reference")
    for b in range(batch):
        accept_index, length, bonus = python_greedy_walk(parents[b], candidates[b], predict[b], num_steps)
        assert np.asarray(out.accept_index[b]).tolist() == accept_index
        assert int(out.accept_length[b]) == length
        assert int(out.bonus[b]) == bonus


# (batch, num_nodes, num_steps)
WALK_CASES = [(1, 1, 1), (3, 8, 3), (3, 33, 6), (1, 33, 32)]


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("batch,num_nodes,num_steps", WALK_CASES)
def test_greedy_kernel_matches_reference(impl, batch, num_nodes, num_steps):
    rng = np.random.default_rng(batch * 100 + num_nodes)
    for kind in KINDS:
        _, *inputs = greedy_inputs(rng, batch, num_nodes, kind)
        assert_verified_equal(verify_tree_greedy(*inputs, num_steps=num_steps, impl=impl),
                              verify_tree_greedy(*inputs, num_steps=num_steps, impl="reference"))


# ----------------------------------------------------------------------------------------------------------------
# Sampling: kernel == reference
# ----------------------------------------------------------------------------------------------------------------


def random_probs(key, shape, scale=2.0):
    return jax.nn.softmax(scale * jax.random.normal(key, shape), axis=-1)


# slow: the Triton form's interpreter on vocab 33 and on the deep walks (33 nodes), the TPU form's on every case but
# one; default tier: [5-1-1-1-interpret], [5-3-8-3-interpret] and [33-3-33-6-tpu_interpret] (vocab-rows-nodes-steps)
@pytest.mark.parametrize(*stacked(("vocab", [5, 33]), ("batch,num_nodes,num_steps", WALK_CASES), ("impl", FORMS),
                                  slow=lambda vocab, walk, impl:
                                  impl == "interpret" and f"{vocab}-{walk}" not in ("5-1-1-1", "5-3-8-3")
                                  or impl == "tpu_interpret" and f"{vocab}-{walk}" != "33-3-33-6"))
def test_sampling_kernel_matches_reference(impl, batch, num_nodes, num_steps, vocab):
    rng = np.random.default_rng(num_nodes + vocab)
    for i, kind in enumerate(KINDS):
        key = jax.random.key(i * 1000 + num_nodes)
        _, candidates, next_token, next_sibling, _ = greedy_inputs(rng, batch, num_nodes, kind, vocab=vocab)
        target, draft = (random_probs(k, (batch, num_nodes, vocab)) for k in jax.random.split(key))
        for draft_probs in (None, draft):
            args = (candidates, next_token, next_sibling, target, key)
            kwargs = dict(num_steps=num_steps, draft_probs=draft_probs)
            assert_verified_equal(verify_tree_sampling(*args, impl=impl, **kwargs),
                                  verify_tree_sampling(*args, impl="reference", **kwargs))


# slow: [reference] (per-row keys make rows independent in the reference); default tier: [interpret]
@pytest.mark.parametrize("impl", [pytest.param("reference", marks=pytest.mark.slow), "interpret"])
def test_per_row_keys_make_each_row_independent_of_the_others(impl):
    """key[B]: row b's result is the one-row call's with key[b], whatever the other rows hold."""
    rng = np.random.default_rng(7)
    batch, num_nodes, vocab = 3, 6, 33
    _, candidates, next_token, next_sibling, _ = greedy_inputs(rng, batch, num_nodes, "random", vocab=vocab)
    target, draft = (random_probs(k, (batch, num_nodes, vocab)) for k in jax.random.split(jax.random.key(3)))
    keys = jax.random.split(jax.random.key(11), batch)
    for draft_probs in (None, draft):
        together = verify_tree_sampling(candidates, next_token, next_sibling, target, keys, num_steps=3,
                                        draft_probs=draft_probs, impl=impl)
        for b in range(batch):
            alone = verify_tree_sampling(candidates[b:b + 1], next_token[b:b + 1], next_sibling[b:b + 1],
                                         target[b:b + 1], keys[b:b + 1], num_steps=3,
                                         draft_probs=None if draft_probs is None else draft_probs[b:b + 1],
                                         impl=impl)
            assert_verified_equal(jax.tree.map(lambda x: x[b:b + 1], together), alone)


# ----------------------------------------------------------------------------------------------------------------
# Sampling: lossless
# ----------------------------------------------------------------------------------------------------------------

VOCAB = 5
NUM_SAMPLES = 60_000


def exact_model(seed):
    """A tiny 'target' p0[V], P1[V, V] (second token given the first) and 'drafter' q0, Q1, far apart."""
    rng = np.random.default_rng(seed)
    normalize = lambda x: x / x.sum(-1, keepdims=True)
    p0, p1 = normalize(rng.uniform(0.2, 1.0, VOCAB)), normalize(rng.uniform(0.2, 1.0, (VOCAB, VOCAB)))
    q0, q1 = normalize(rng.uniform(0.0, 1.0, VOCAB) ** 3), normalize(rng.uniform(0.0, 1.0, (VOCAB, VOCAB)) ** 3)
    return [jnp.asarray(x, jnp.float32) for x in (p0, p1, q0, q1)]


def two_level_tree(width, grand_width):
    """Parents of a root with `width` children, each with `grand_width` children (children listed first)."""
    parents = [-1] + [0] * width
    for c in range(1, width + 1):
        parents += [c] * grand_width
    return np.asarray(parents, np.int32)


def draft_tokens(key, parents, first, second, sampled):
    """i32[N, T] draft tokens: children of the root from `first` f32[V], grandchildren from second[x] f32[V, V].

    sampled: i.i.d. draws (with replacement); else the top tokens in order (deterministic drafts).
    """
    num_nodes = len(parents)
    tokens = jnp.zeros((NUM_SAMPLES, num_nodes), jnp.int32)
    keys = jax.random.split(key, num_nodes)
    for j in range(1, num_nodes):
        p = int(parents[j])
        probs = first[None, :] if p == 0 else second[tokens[:, p]]
        if sampled:
            token = jax.random.categorical(keys[j], jnp.log(jnp.broadcast_to(probs, (NUM_SAMPLES, VOCAB))))
        else:
            rank = int(np.sum(parents[1:j] == p))   # j is the rank-th child of p
            token = jnp.argsort(-probs, axis=-1)[..., rank]
        tokens = tokens.at[:, j].set(jnp.broadcast_to(token, (NUM_SAMPLES,)))
    return tokens


def verify_step(key, parents, model, root_probs, root_draft, sampled):
    """One verify step over NUM_SAMPLES trees rooted where root_probs f32[N, V] is the target's distribution.

    Nodes at depth 1 with token x get the target P1[x] (and draft Q1[x]); deeper nodes a uniform target (only
    the first two emitted tokens are checked, and a depth-2 node's distribution only matters after them).
    Returns (emitted tokens i32[N, 3] padded with -1, the number emitted i32[N]).
    """
    _, p1, _, q1 = model
    draft_key, verify_key = jax.random.split(key)
    tokens = draft_tokens(draft_key, parents, root_draft, q1, sampled)
    depth_one = jnp.asarray(parents == 0)[None, :, None]
    uniform = jnp.full((VOCAB,), 1.0 / VOCAB)
    target = jnp.where(depth_one, p1[tokens], uniform)
    target = target.at[:, 0].set(root_probs)
    draft = jnp.where(depth_one, q1[tokens], uniform).at[:, 0].set(root_draft) if sampled else None
    next_token, next_sibling = links(parents)
    batch_links = [jnp.broadcast_to(jnp.asarray(x), tokens.shape) for x in (next_token, next_sibling)]
    out = verify_tree_sampling(tokens, *batch_links, target, verify_key, num_steps=2, draft_probs=draft,
                               impl="reference")
    accepted = jnp.take_along_axis(tokens, jnp.maximum(out.accept_index[:, 1:], 0), axis=1)
    emitted = jnp.concatenate([jnp.where(out.accept_index[:, 1:] >= 0, accepted, -1),
                               jnp.full((NUM_SAMPLES, 1), -1, jnp.int32)], axis=1)
    emitted = emitted.at[jnp.arange(NUM_SAMPLES), out.accept_length].set(out.bonus)
    return emitted, out.accept_length + 1


def first_two_tokens(seed, width, grand_width, sampled):
    """Samples the first two tokens the speculative loop emits: a second verify step when the first emits one."""
    model = exact_model(seed)
    p0, _, q0, _ = model
    key1, key2 = jax.random.split(jax.random.key(seed))
    parents = two_level_tree(width, grand_width)
    emitted, count = verify_step(key1, parents, model, jnp.broadcast_to(p0, (NUM_SAMPLES, VOCAB)), q0, sampled)
    first = emitted[:, 0]
    # The next step is rooted at the first token: its root has target P1[first] and draft Q1[first].
    second_step = next_step_first_token(key2, model, first, width, sampled)
    second = jnp.where(count >= 2, emitted[:, 1], second_step)
    return np.asarray(first), np.asarray(second), model


def next_step_first_token(key, model, first, width, sampled):
    """The first token of a verify step rooted at token `first` i32[N] (a root with `width` children)."""
    _, p1, _, q1 = model
    parents = np.asarray([-1] + [0] * width, np.int32)
    draft_key, verify_key = jax.random.split(key)
    root_draft = q1[first]                                          # f32[N, V]
    if sampled:
        tokens = jax.random.categorical(draft_key, jnp.log(root_draft)[:, None, :], axis=-1,
                                        shape=(NUM_SAMPLES, width))
    else:
        tokens = jnp.argsort(-root_draft, axis=-1)[:, :width]
    tokens = jnp.concatenate([first[:, None], tokens], axis=1).astype(jnp.int32)
    target = jnp.broadcast_to(p1[first][:, None, :], tokens.shape + (VOCAB,))
    draft = jnp.broadcast_to(root_draft[:, None, :], target.shape) if sampled else None
    next_token, next_sibling = links(parents)
    batch_links = [jnp.broadcast_to(jnp.asarray(x), tokens.shape) for x in (next_token, next_sibling)]
    out = verify_tree_sampling(tokens, *batch_links, target, verify_key, num_steps=1, draft_probs=draft,
                               impl="reference")
    accepted = jnp.take_along_axis(tokens, jnp.maximum(out.accept_index[:, 1:2], 0), axis=1)[:, 0]
    return jnp.where(out.accept_length >= 1, accepted, out.bonus)


# slow: [4-3-True] (recursive rejection over 4 x 3 sampled siblings); default tier: [3-2-True], [1-1-True], [3-2-False]
@pytest.mark.parametrize("width,grand_width,sampled", [(3, 2, False), (3, 2, True), (1, 1, True),
                                                       pytest.param(4, 3, True, marks=pytest.mark.slow)])
def test_sampling_is_lossless(width, grand_width, sampled):
    first, second, (p0, p1, _, _) = first_two_tokens(17 + width, width, grand_width, sampled)
    expected = np.asarray(p0, np.float64)[:, None] * np.asarray(p1, np.float64)   # P(t1, t2)
    expected /= expected.sum()
    observed = np.zeros((VOCAB, VOCAB))
    np.add.at(observed, (first, second), 1)
    _, p_value = scipy.stats.chisquare(observed.ravel(), expected.ravel() * NUM_SAMPLES)
    assert p_value > P_VALUE_FLOOR, (p_value, observed / NUM_SAMPLES, expected)


# ----------------------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------------------


def test_static_argument_validation():
    ids = np.zeros((2, 4), np.int32)
    with pytest.raises(ValueError, match="num_steps=0"):
        verify_tree_greedy(ids, ids, ids, ids, num_steps=0, impl="reference")
    with pytest.raises(ValueError, match="target_predict.shape"):
        verify_tree_greedy(ids, ids, ids, ids[:, :3], num_steps=2, impl="reference")
    with pytest.raises(ValueError, match="retrieve_next_sibling.shape"):
        verify_tree_greedy(ids, ids, ids[:1], ids, num_steps=2, impl="reference")
    probs = np.full((2, 4, 3), 1 / 3, np.float32)
    with pytest.raises(ValueError, match="target_probs.shape"):
        verify_tree_sampling(ids, ids, ids, probs[:, :2], jax.random.key(0), num_steps=2, impl="reference")
    with pytest.raises(ValueError, match="draft_probs.shape"):
        verify_tree_sampling(ids, ids, ids, probs, jax.random.key(0), num_steps=2, draft_probs=probs[..., :2],
                             impl="reference")
