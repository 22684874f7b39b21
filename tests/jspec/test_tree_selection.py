"""Dynamic-tree selection: EAGLE-2 (best cumulative log-prob) and top1_chain (the drafter's top-1 chain to full
depth, the rest by cumulative log-prob), each against a brute-force search over explicit token paths; and
greedy output equal to plain decoding on the bundled model with top1_chain."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.drafters.tree_search import draft_dynamic_tree

VOCAB, TOPK, STEPS, NODES = 12, 3, 5, 9


def _table(seed: int) -> np.ndarray:
    """Logits of the next token given the current one: flat enough that EAGLE-2 prefers shallow nodes."""
    return np.random.default_rng(seed).normal(size=(VOCAB, VOCAB)).astype(np.float32) * 1.5


def _forward(table):
    def forward(carry, tokens, hidden, positions, offset, rows):
        return carry, jnp.asarray(table)[tokens], hidden
    return forward


def _brute_force(table, root: int, keep_chain: bool) -> set[tuple[int, ...]]:
    """Token paths of the selected nodes, by the definition: per depth keep topk frontier nodes (the chain node
    first when keep_chain), expand each by its topk children, select the NODES - 1 best (chain forced)."""
    log_p = np.asarray(jax.nn.log_softmax(jnp.asarray(table), axis=-1))

    def children(path, score):
        order = np.argsort(-log_p[path[-1] if path else root], kind="stable")[:TOPK]
        return [(path + (int(t),), score + float(log_p[path[-1] if path else root][t]), rank == 0)
                for rank, t in enumerate(order)]

    pool, chain = [], set()
    level = [(p, s, c) for p, s, c in children((), 0.0)]
    for depth in range(1, STEPS + 1):
        pool += level
        chain |= {p for p, _, c in level if c}
        if depth == STEPS:
            break
        ranked = sorted(level, key=lambda n: (not (keep_chain and n[2]), -n[1]))[:TOPK]
        level = [(p, s, c and on_chain) for p_, s_, on_chain in ranked for p, s, c in children(p_, s_)]
    forced = chain if keep_chain else set()
    rest = sorted((n for n in pool if n[0] not in forced), key=lambda n: -n[1])
    return forced | {p for p, _, _ in rest[:NODES - 1 - len(forced)]}


def _selected_paths(draft, batch_row: int) -> set[tuple[int, ...]]:
    tokens = np.asarray(draft.tokens[batch_row])
    selected = np.asarray(draft.selected_index[batch_row])
    parents = np.asarray(draft.parent_list[batch_row])
    token_of = {int(g): int(t) for g, t in zip(selected, tokens[1:])}
    paths = set()
    for g in token_of:
        path, node = [], g
        while True:
            path.append(token_of[node])
            if node // TOPK == 0:
                break
            node = int(parents[node // TOPK])
        paths.add(tuple(reversed(path)))
    return paths


@pytest.mark.parametrize("keep_chain", [False, True])
def test_selection_equals_brute_force(keep_chain):
    dropped = 0
    for seed in range(6):
        table = _table(seed)
        roots = jnp.array([0, 5])
        _, draft = draft_dynamic_tree(_forward(table), None, roots, jnp.asarray(table)[roots],
                                      jnp.zeros((2, 4)), jnp.array([3, 7]), topk=TOPK, num_steps=STEPS,
                                      num_draft_tokens=NODES, to_target=lambda ids: ids,
                                      keep_top1_chain=keep_chain)
        for row, root in enumerate((0, 5)):
            got = _selected_paths(draft, row)
            assert got == _brute_force(table, root, keep_chain), (seed, root)
            greedy, token = [], root
            for _ in range(STEPS):
                token = int(np.argmax(table[token]))
                greedy.append(token)
            chain = tuple(greedy)
            if keep_chain:
                assert chain in got  # the top-1 chain to full depth
            elif chain not in got:
                dropped += 1
    if not keep_chain:
        assert dropped > 0  # these tables do make EAGLE-2 drop the deep greedy path


def test_selection_option_is_validated():
    with pytest.raises(ValueError, match="selection='best'"):
        jspec.SpecConfig(selection="best")
    with pytest.raises(ValueError, match="dynamic trees"):
        jspec.SpecConfig(tree="chain", num_steps=3, selection="top1_chain")
    with pytest.raises(ValueError, match="num_steps=6"):
        jspec.SpecConfig(num_steps=6, topk=2, num_draft_tokens=6, selection="top1_chain")


# slow: [draft] (top1_chain selection with the bundled draft model = plain); default tier: [eagle3]
@pytest.mark.parametrize("drafter", ["eagle3", pytest.param("draft", marks=pytest.mark.slow)])
def test_top1_chain_greedy_equals_plain_on_the_bundled_model(drafter, bundled_plain_tokens):
    prompts, plain = bundled_plain_tokens
    spec = jspec.SpecConfig(tree="dynamic", num_steps=6, topk=3, num_draft_tokens=12, selection="top1_chain")
    engine = jspec.SpecEngine.from_pretrained(jspec.bundled_model(), drafter=drafter, spec=spec, max_batch_size=2,
                                              max_seq_len=128, dtype="float32")
    out = engine.generate(prompts, max_new_tokens=40)
    assert out.token_ids == plain
    assert out.stats.acceptance_length > 1.5


@pytest.fixture(scope="module")
def bundled_plain_tokens():
    prompts = ["def fibonacci(n):", "class Stack:\n    def push(self, item):"]
    plain = jspec.SpecEngine.from_pretrained(jspec.bundled_model(), max_batch_size=2, max_seq_len=128,
                                             dtype="float32")
    return prompts, plain.generate(prompts, max_new_tokens=40).token_ids
