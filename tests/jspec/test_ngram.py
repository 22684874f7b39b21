"""The n-gram (prompt lookup) drafter: the lookup against a brute-force oracle, lossless greedy output for
chains and trees (ragged batch, EOS and max_new_tokens cuts), acceptance > 1.5 on self-repeating text, lossless
sampling on a random target (and in the root-only decode of a step without drafts), the verify pass skipped when
nothing matched, one XLA program, and drafter="ngram" in from_pretrained."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

import jspec
from jspec.drafters.ngram import NgramDrafter, find_continuations
from jspec.generate import generate_start
from jspec.step import spec_step
from jspec.sampling import SamplingArrays, row_keys
from models.attention import KVCache
from models.llama import LlamaModel, init_params
from tests import spec_fixtures as fx
from tests.exact_distribution import TINY, assert_triples_follow, exact_triples, varied
from tests.program_structure import CALLBACK_PRIMITIVES, all_primitives, top_level_eqns

RAGGED = [[5, 9, 13], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41], [7] * 6]
SPECS = {
    "chain": jspec.SpecConfig(tree="chain", num_steps=4),
    "branches": jspec.SpecConfig(tree="static", tree_choices=((0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0))),
    "dynamic": jspec.SpecConfig(tree="dynamic", num_steps=4, topk=3, num_draft_tokens=9),
}


def ngram_engine(params, spec, **kwargs):
    return jspec.SpecEngine(fx.TARGET, params, drafter=NgramDrafter(spec, fx.MAX_SEQ_LEN), drafter_params={},
                            max_batch_size=4, max_seq_len=fx.MAX_SEQ_LEN, **kwargs)


def lookup_oracle(seq, max_ngram, min_ngram, branches, depth):
    """Brute force: per branch, the most recent match of the longest suffix with a fresh first token."""
    out, used = [], []
    for _ in range(branches):
        found = None
        for n in range(max_ngram, min_ngram - 1, -1):
            for i in range(len(seq) - n - 1, -1, -1):
                if seq[i:i + n] == seq[len(seq) - n:] and seq[i + n] not in used:
                    found = i + n
                    break
            if found is not None:
                break
        if found is None:
            out.append(None)
            continue
        period = len(seq) - found
        draft = [seq[found + m % period] for m in range(depth)]
        used.append(draft[0])
        out.append(draft)
    return out


def test_lookup_matches_brute_force():
    rng = np.random.default_rng(0)
    size, batch = 40, 64
    tokens = rng.integers(0, 4, (batch, size)).astype(np.int32)  # small alphabet: many matches, some periodic
    lengths = rng.integers(1, size + 1, batch).astype(np.int32)
    tokens[5, :12] = [1, 2, 3] * 4
    lengths[5] = 12
    drafts, found = find_continuations(jnp.asarray(tokens), jnp.asarray(lengths), max_ngram=3, min_ngram=1,
                                       num_branches=3, depth=5)
    drafts, found = np.asarray(drafts), np.asarray(found)
    for b in range(batch):
        expected = lookup_oracle(tokens[b, :lengths[b]].tolist(), 3, 1, 3, 5)
        for j, draft in enumerate(expected):
            assert found[b, j] == (draft is not None), (b, j)
            if draft is not None:
                assert drafts[b, j].tolist() == draft, (b, j)
    assert drafts[5, 0].tolist() == [1, 2, 3, 1, 2]


@pytest.fixture(scope="module")
def target():
    return fx.near_bigram_target()


@pytest.fixture(scope="module")
def plain_outputs(target):
    engine = fx.plain_engine(target)
    return {n: engine.generate(RAGGED, max_new_tokens=n).token_ids for n in (1, 7, 33)}


# slow: n-gram greedy = plain on the near-bigram target for every tree; default tier:
# test_random_target_greedy_is_lossless (chain and branches), test_no_match_skips_the_verify_pass[True], the EOS test
# (chain), test_hybrid's bundled lookup
@pytest.mark.slow
@pytest.mark.parametrize("tree", sorted(SPECS))
def test_greedy_output_equals_plain_decoding(target, plain_outputs, tree):
    engine = ngram_engine(target, SPECS[tree])
    for max_new_tokens, expected in plain_outputs.items():
        out = engine.generate(RAGGED, max_new_tokens=max_new_tokens)
        assert out.token_ids == expected, max_new_tokens
    # the near-bigram target's greedy output falls into a cycle: lookup finds it
    assert out.stats.acceptance_length > 1.5, out.stats
    assert engine.num_compiled == 2  # sequence buffers: 16 + 1 and 16 + 7 fit 32 slots, 16 + 33 needs 64


# slow: lookup drafts from a repeated prompt and accepts them; default tier: test_hybrid's bundled test (lookup drafts
# accepted on real text), test_no_match_skips_the_verify_pass
@pytest.mark.slow
def test_repeated_prompt_is_drafted_from(target):
    """A prompt that repeats itself, and a target whose greedy continuation repeats it: long acceptance."""
    pattern = fx.plain_engine(target).generate([[3]], max_new_tokens=12).token_ids[0]
    prompt = ([3] + pattern) * 3
    out = ngram_engine(target, SPECS["chain"]).generate([prompt], max_new_tokens=25)
    expected = fx.plain_engine(target).generate([prompt], max_new_tokens=25).token_ids
    assert out.token_ids == expected
    assert out.stats.acceptance_length > 1.5, out.stats


def test_stops_at_eos_inside_an_accepted_run(target, plain_outputs):
    eos = plain_outputs[33][1][9]
    plain = fx.plain_engine(target, eos_token_ids=(eos,)).generate(RAGGED, max_new_tokens=33).token_ids
    assert plain[1][-1] == eos and len(plain[1]) <= 10
    assert ngram_engine(target, SPECS["chain"], eos_token_ids=(eos,)).generate(
        RAGGED, max_new_tokens=33).token_ids == plain


def test_random_target_greedy_is_lossless():
    params = init_params(fx.TARGET, jax.random.key(3))
    plain = fx.plain_engine(params).generate(RAGGED, max_new_tokens=20).token_ids
    assert ngram_engine(params, SPECS["branches"]).generate(RAGGED, max_new_tokens=20).token_ids == plain


# slow: n-gram chain and branching-tree sampling chi-square (deterministic drafts); default tier: test_spec_sampling,
# test_root_only_step_samples_the_target_distribution
@pytest.mark.slow
@pytest.mark.parametrize("tree", ["chain", "branches"])
def test_random_target_sampling_follows_the_exact_distribution(tree):
    """Tiny random target (V = 6, so lookups hit often) at temperature 1: counts of (x1, x2, x3) vs the
    enumerated joint; n-gram drafts are deterministic, verified by per-node target draws."""
    target = varied(init_params(TINY, jax.random.key(8)))  # a target that often repeats the prompt's bigrams
    prompt, rows = [1, 4, 2, 1, 4], 12000
    engine = jspec.SpecEngine(TINY, target, drafter=NgramDrafter(SPECS[tree], 16), drafter_params={},
                              max_batch_size=rows, max_seq_len=16)
    out = engine.generate([prompt] * rows, max_new_tokens=3, temperature=1.0, seed=2)
    assert out.stats.acceptance_length > 1.1, out.stats  # drafts really are accepted
    assert_triples_follow(out.token_ids, exact_triples(TINY, target, prompt))


def _one_step(engine, params, prompt):
    """(cache before, cache after, state after) of the first speculative step after prefilling ``prompt``."""
    sampling = SamplingArrays(jnp.zeros((1,)), jnp.zeros((1,), jnp.int32), jnp.ones((1,)))
    ids = jnp.asarray([prompt + [0] * (32 - len(prompt))], jnp.int32)
    state, inputs = generate_start(engine.params, {}, ids, jnp.asarray([len(prompt)], jnp.int32), jax.random.key(0),
                                   jnp.full((1,), 8, jnp.int32), jnp.full((1, 1), -1, jnp.int32), sampling,
                                   setup=engine.setup)
    step = jax.jit(functools.partial(spec_step, setup=engine.setup))
    return state.cache, step(engine.params, {}, state, inputs), state


# slow: [False] (no lookup match: the step runs the target on the root alone); default tier: [True] (the same step
# with a match), test_random_target_greedy_is_lossless (steps with and without matches = plain)
@pytest.mark.parametrize("drafted", [pytest.param(False, marks=pytest.mark.slow), True])
def test_no_match_skips_the_verify_pass(target, drafted):
    """Without a lookup match the step runs the target on the root alone: the cache slots the T - 1 other tree
    nodes would take keep the prefill's values. With a match they are rewritten by the verify pass. Either way
    the committed tokens are plain decoding's."""
    plain = fx.plain_engine(target)
    if drafted:  # the target's greedy continuation repeats the prompt: the root is found in it
        pattern = plain.generate([[3]], max_new_tokens=12).token_ids[0]
        prompt = ([3] + pattern) * 2
    else:        # tokens the first generated token (the root) is not among
        prompt = [5, 9, 13]
    first = plain.generate([prompt], max_new_tokens=1).token_ids[0][0]
    assert (first in prompt) == drafted
    engine = ngram_engine(target, SPECS["chain"])
    before, after, state = _one_step(engine, engine.params, prompt)
    root = int(state.cache_len[0])
    nodes = slice(root + 1, root + engine.setup.spec.tree_size)
    untouched = all(bool(jnp.array_equal(b[:, nodes], a[:, nodes])) for b, a in zip(before.k, after.cache.k))
    assert untouched == (not drafted)
    n = int(after.seq_len[0] - state.seq_len[0])
    assert n >= 1 and (n == 1 or drafted)
    expected = plain.generate([prompt], max_new_tokens=1 + n).token_ids[0]
    assert np.asarray(after.tokens[0, len(prompt):len(prompt) + 1 + n]).tolist() == expected


# slow: a step with no draft samples the target's distribution (chi-square); default tier: test_sampling's chi-square of
# the sampler every step uses
@pytest.mark.slow
def test_root_only_step_samples_the_target_distribution():
    """A step in which no row has a match samples the next token from the target at temperature 1: 12000 rows
    share the prefix [p, x1] (x1 the greedy first token, never seen before it), so every row takes the root-only
    branch (asserted on the cache), and the counts of x2 follow p(x2 | p, x1) (chi-square)."""
    target = varied(init_params(TINY, jax.random.key(4)))
    plain = jspec.SpecEngine(TINY, target, max_batch_size=1, max_seq_len=16)
    prompt = next([p] for p in range(TINY.vocab_size)
                  if plain.generate([[p]], max_new_tokens=1).token_ids[0][0] != p)
    rows = 12000
    engine = jspec.SpecEngine(TINY, target, drafter=NgramDrafter(SPECS["chain"], 16), drafter_params={},
                              max_batch_size=rows, max_seq_len=16)
    greedy = SamplingArrays(jnp.zeros((rows,)), jnp.zeros((rows,), jnp.int32), jnp.ones((rows,)))
    state, inputs = generate_start(engine.params, {}, jnp.asarray([prompt + [0] * 15] * rows, jnp.int32),
                                   jnp.ones((rows,), jnp.int32), jax.random.key(0), jnp.full((rows,), 4, jnp.int32),
                                   jnp.full((rows, 1), -1, jnp.int32), greedy, setup=engine.setup)
    first = int(state.tokens[0, 1])
    assert first != prompt[0] and bool(jnp.all(state.tokens[:, 1] == first))
    hot = inputs._replace(sampling=SamplingArrays(jnp.ones((rows,)), jnp.zeros((rows,), jnp.int32),
                                                  jnp.ones((rows,))), keys=row_keys(jax.random.key(7), rows))
    after = jax.jit(functools.partial(spec_step, setup=engine.setup))(engine.params, {}, state, hot)
    nodes = slice(2, 1 + engine.setup.spec.tree_size)
    assert all(bool(jnp.array_equal(b[:, nodes], a[:, nodes])) for b, a in zip(state.cache.k, after.cache.k))
    assert bool(jnp.all(after.seq_len == 3))
    seqs = jnp.asarray([prompt + [first]])
    cache = KVCache.zeros(TINY.num_layers, 1, 2, TINY.num_kv_heads, TINY.head_dim, jnp.float32)
    logits = LlamaModel(TINY).apply({"params": target}, seqs, jnp.arange(2)[None], cache,
                                    jnp.zeros((1,), jnp.int32)).logits[0, -1]
    probs = np.asarray(jax.nn.softmax(logits), np.float64)
    expected = probs / probs.sum() * rows
    counts = np.bincount(np.asarray(after.tokens[:, 2]), minlength=TINY.vocab_size)
    assert (expected >= 5).all(), expected
    assert scipy.stats.chisquare(counts, expected).pvalue > 1e-3


def test_one_xla_program(target):
    engine = ngram_engine(target, SPECS["branches"])
    b, p = 2, 16
    sampling = SamplingArrays(jnp.zeros((b,)), jnp.zeros((b,), jnp.int32), jnp.ones((b,)))
    args = (target, {}, jnp.ones((b, p), jnp.int32), jnp.full((b,), 3, jnp.int32), jax.random.key(0),
            jnp.full((b,), 8, jnp.int32), jnp.full((b, 1), -1, jnp.int32), sampling)
    jaxpr = jax.make_jaxpr(lambda *a: jspec.generate(*a, setup=engine.setup))(*args).jaxpr
    assert [e.primitive.name for e in top_level_eqns(jaxpr)].count("while") == 1
    assert not set(all_primitives(jaxpr)) & set(CALLBACK_PRIMITIVES)


def test_tree_shapes_and_knobs_are_validated():
    with pytest.raises(ValueError, match="branches of continuations"):
        NgramDrafter(jspec.SpecConfig(tree="static", tree_choices=((0,), (0, 1))), 64)
    with pytest.raises(ValueError, match="min_ngram=3 exceeds max_ngram=2"):
        NgramDrafter(SPECS["chain"], 64, max_ngram=2, min_ngram=3)
    tree = NgramDrafter(SPECS["dynamic"], 64).tree
    assert tree.num_nodes == SPECS["dynamic"].tree_size and tree.max_depth == 4
