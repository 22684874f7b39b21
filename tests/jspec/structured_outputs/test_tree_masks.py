"""The host's tree masks: every reachable node's mask equal to a fresh matcher's after consuming that node's path,
forbidden drafts replaced by the grammar's forced tokens, committed tokens advancing the grammar."""

import numpy as np
import pytest

import jspec
from jspec.structured_outputs import StructuredOutputsParams
from jspec.structured_outputs.grammar import GrammarCompiler
from jspec.structured_outputs.tree_masks import advance, constrain_tree, root_bitmask
from jspec.tokenizer import load_tokenizer

SCHEMA = StructuredOutputsParams(json={"type": "object", "properties": {"name": {"enum": ["ada", "bob"]}},
                                       "required": ["name"], "additionalProperties": False},
                                 disable_any_whitespace=True)
VOCAB = 32000


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(load_tokenizer(jspec.bundled_model()), VOCAB, (2,))


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(jspec.bundled_model())


def expected_mask(compiler, path: list[int]) -> np.ndarray:
    matcher = compiler.matcher(SCHEMA)
    assert matcher.consume_tokens(path)
    return root_bitmask([matcher], VOCAB)[0, 0]


def test_each_node_masked_by_its_own_path_and_forbidden_drafts_replaced(compiler, tokenizer):
    good = tokenizer.encode('{"name":"ada"}', add_special_tokens=False).ids
    # root (the last committed token), then two branches: the text's first tokens, and a draft the grammar forbids
    # at the root ("x") with a child under it.
    x = tokenizer.encode("x", add_special_tokens=False).ids[-1]
    tokens = np.array([[1, good[0], good[1], x, good[1]]])
    parents = [-1, 0, 1, 0, 3]
    mask = np.zeros((1, 5, 5), bool)
    for n in range(5):
        j = n
        while j >= 0:
            mask[0, n, j] = True
            j = parents[j]
    bitmask, new_tokens, substituted = constrain_tree([compiler.matcher(SCHEMA)], tokens, mask, VOCAB,
                                                      substitute=False)
    assert not substituted.any() and (new_tokens == tokens).all()
    np.testing.assert_array_equal(bitmask[0, 0], expected_mask(compiler, []))
    np.testing.assert_array_equal(bitmask[0, 1], expected_mask(compiler, good[:1]))
    np.testing.assert_array_equal(bitmask[0, 2], expected_mask(compiler, good[:2]))
    assert (bitmask[0, 3] == -1).all() and (bitmask[0, 4] == -1).all()  # unreachable: left unconstrained

    bitmask, new_tokens, substituted = constrain_tree([compiler.matcher(SCHEMA)], tokens, mask, VOCAB)
    forced = compiler.matcher(SCHEMA).compute_ff_tokens()
    assert forced and substituted[0] and new_tokens[0, 3] == forced[0]  # '{"name":"' is forced
    np.testing.assert_array_equal(bitmask[0, 3], expected_mask(compiler, forced[:1]))


def test_rows_without_a_grammar_are_unconstrained_and_advance_checks_tokens(compiler, tokenizer):
    tokens = np.array([[1, 5, 6], [1, 7, 8]])
    mask = np.tril(np.ones((3, 3), bool))[None].repeat(2, axis=0)
    bitmask, _, _ = constrain_tree([None, compiler.matcher(SCHEMA)], tokens, mask, VOCAB)
    assert (bitmask[0] == -1).all() and not (bitmask[1, 0] == -1).all()

    matcher = compiler.matcher(SCHEMA)
    text = tokenizer.encode('{"name":"bob"}', add_special_tokens=False).ids
    committed = np.array([[0, 0] + text + [2, 0]])
    advance([matcher], committed, np.array([2]), np.array([2 + len(text) + 1]))  # EOS ends the grammar
    assert matcher.is_stopped()
    with pytest.raises(RuntimeError, match="rejected committed token"):
        advance([compiler.matcher(SCHEMA)], np.array([tokenizer.encode("x", add_special_tokens=False).ids]),
                np.array([0]), np.array([1]))


def test_bad_grammars_are_refused_when_compiled(compiler):
    with pytest.raises(ValueError, match="structured_outputs regex"):
        compiler.matcher(StructuredOutputsParams(regex="a(b"))
    with pytest.raises(ValueError, match="structured_outputs grammar"):
        compiler.matcher(StructuredOutputsParams(grammar="start: undefined_rule"))


def test_a_short_steps_masks_cover_only_the_nodes_it_verifies(compiler, tokenizer):
    """nodes=k (a short chain's first k nodes, root included): those are masked as over the whole chain, the rest
    stay all allowed and keep their drafts."""
    good = tokenizer.encode('{"name":"ada"}', add_special_tokens=False).ids
    x = tokenizer.encode("x", add_special_tokens=False).ids[-1]
    tokens = np.array([[1] + good[:3] + [x]])
    chain = np.tril(np.ones((5, 5), bool))[None]
    whole, _, _ = constrain_tree([compiler.matcher(SCHEMA)], tokens, chain, VOCAB)
    short, new_tokens, _ = constrain_tree([compiler.matcher(SCHEMA)], tokens, chain, VOCAB, nodes=3)
    np.testing.assert_array_equal(short[:, :3], whole[:, :3])
    assert (short[:, 3:] == -1).all() and (new_tokens == tokens).all()
    assert not (whole[:, 3] == -1).all()


def test_chains_masked_in_parallel_equal_masking_node_by_node(compiler, tokenizer):
    """Chains take llguidance's parallel fill along their drafts; every row (drafts all allowed, one forbidden and
    replaced by a forced token, past the grammar's end, a padding draft, a row without a grammar) gets what the
    node-by-node masking of a tree gives it."""
    from jspec.structured_outputs import tree_masks

    text = tokenizer.encode('{"name":"ada"}', add_special_tokens=False).ids
    eos = 2
    x = tokenizer.encode("x", add_special_tokens=False).ids[-1]
    cases = [(2, text[2:6]), (3, [x] + text[4:7]), (len(text) - 2, text[-2:] + [eos, 5]), (1, text[1:3] + [-1, 7])]
    states, chains = [], []
    for consumed, drafts in cases:
        matcher = compiler.matcher(SCHEMA)
        assert matcher.consume_tokens(text[:consumed])
        states.append(matcher)
        chains.append([text[consumed - 1]] + drafts)
    states.append(None)
    chains.append([1, 2, 3, 4, 5])
    tokens = np.array(chains)
    mask = np.tril(np.ones((5, 5), bool))[None].repeat(len(chains), axis=0)
    bitmask, new_tokens, substituted = constrain_tree(states, tokens, mask, VOCAB)
    depth = mask.sum(axis=-1) - 1
    for b, matcher in enumerate(states):
        want, want_tokens = np.full_like(bitmask[b], -1), tokens[b].copy()
        changed = matcher is not None and tree_masks._constrain_row(matcher, want_tokens, mask[b], depth[b], want,
                                                                    5, VOCAB, True)
        np.testing.assert_array_equal(bitmask[b], want, err_msg=f"row {b}")
        assert (new_tokens[b] == want_tokens).all() and substituted[b] == changed
    assert not substituted[0] and substituted[1]  # "x" forbidden at its parent: the forced token drafted instead
    assert tree_masks._mask_chains(states, [0, 1, 3], tokens, np.full_like(bitmask, -1), VOCAB) == [3, 1]
    for matcher in states[:-1]:  # the grammars are where they were
        assert not matcher.is_stopped()
