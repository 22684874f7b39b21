"""The lookup-then-model drafter (jspec/drafters/hybrid.py): per row, the lookup's draft where a suffix matched
and the model's elsewhere; the model's forwards skipped when every row matched; lossless greedy output (ragged
batch, rows of both kinds, EOS cut) and sampling (chi-square against the enumerated joint); validation; and
drafter="ngram+eagle3" on the bundled model equal to plain decoding."""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.drafters import hybrid
from jspec.drafters.base import PrefillContext
from jspec.drafters.common import DrafterBase
from jspec.drafters.draft_model import DraftModelDrafter
from jspec.drafters.eagle3 import Eagle3Drafter
from jspec.drafters.hybrid import LookupThenModelDrafter
from jspec.drafters.ngram import NgramDrafter
from jspec.drafters.tree_search import static_draft_tree
from jspec.generate import generate_start, run_loop
from jspec.sampling import SamplingArrays
from models.llama import init_params, unstack_layers
from tests import spec_fixtures as fx
from tests.exact_distribution import TINY, assert_triples_follow, exact_triples, varied

CHAIN = jspec.SpecConfig(tree="chain", num_steps=4)
RAGGED = [[5, 9, 13], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41], [7] * 6]


def hybrid_drafter(spec=CHAIN, max_seq_len=fx.MAX_SEQ_LEN, min_ngram=2, attention_span=None, model_steps=None):
    """model_steps: the head's chain when shorter than lookup's (its buffers then hold the longer commit)."""
    steps = spec.num_steps if model_steps is None else model_steps
    head = Eagle3Drafter(fx.HEAD, fx.TARGET, dataclasses.replace(spec, num_steps=steps),
                         max_seq_len + spec.num_steps - steps, attention_span=attention_span)
    return LookupThenModelDrafter(head, NgramDrafter(spec, max_seq_len, max_ngram=3, min_ngram=min_ngram), spec,
                                  max_seq_len)


@dataclasses.dataclass(frozen=True)
class ConstantModel(DrafterBase):
    """A model drafter that always drafts ``token`` and counts the proposals that ran in ``PROPOSALS`` (a host
    callback: it fires only where the branch holding it runs; the hybrid drops the state a proposal returns)."""

    spec: Any
    max_seq_len: int
    token: int = 63

    def prefill(self, params_t, params_d, ctx):
        return jnp.zeros(ctx.prompt_ids.shape[:1], jnp.int32)

    def propose(self, params_t, params_d, state, root, cache_len, *, sampling=None, key=None):
        jax.debug.callback(lambda: PROPOSALS.append(1))
        nodes = jnp.full((root.shape[0], self.static_tree.num_nodes - 1), self.token, jnp.int32)
        tokens = jnp.concatenate([root[:, None], nodes], axis=1)
        return state, static_draft_tree(self.static_tree, tokens, cache_len)

    def commit(self, params_t, params_d, state, ctx):
        return state


PROPOSALS: list[int] = []


def _propose(prompts, model_steps=CHAIN.num_steps):
    """(model proposals that ran, draft tokens) of one propose after prefilling right-padded ``prompts`` (the
    last prompt token is the root); the model drafts a chain of ``model_steps``."""
    return _propose_tree(prompts, model_steps)[:2]


def _propose_tree(prompts, model_steps):
    """-> (model proposals that ran, draft tokens, the DraftTree)."""
    model = ConstantModel(dataclasses.replace(CHAIN, num_steps=model_steps), 32 + CHAIN.num_steps - model_steps)
    drafter = LookupThenModelDrafter(model, NgramDrafter(CHAIN, 32, max_ngram=3, min_ngram=2), CHAIN, 32)
    width = max(len(p) for p in prompts)
    ids = jnp.asarray([p[:-1] + [0] * (width - len(p) + 1) for p in prompts], jnp.int32)
    lens = jnp.asarray([len(p) - 1 for p in prompts], jnp.int32)
    first = jnp.asarray([p[-1] for p in prompts], jnp.int32)
    state = drafter.prefill({}, {}, PrefillContext(ids, lens, first, None))
    PROPOSALS.clear()
    _, tree = jax.jit(drafter.propose)({}, {}, state, first, lens)
    tokens = np.asarray(tree.tokens)
    jax.effects_barrier()
    return len(PROPOSALS), tokens, tree


def test_each_row_takes_the_lookup_draft_where_a_suffix_matched_else_the_models():
    counted, tokens = _propose([[1, 2, 3, 4, 5, 1, 2], [9, 8, 7, 6, 5, 4, 3]])
    assert tokens[0].tolist() == [2, 3, 4, 5, 1]   # "1 2" seen before: its continuation, repeating
    assert tokens[1].tolist() == [3, 63, 63, 63, 63]  # no 2-token suffix seen before: the model's chain
    assert counted == 1  # one batched proposal


def test_the_model_is_not_run_when_every_row_matched():
    counted, tokens = _propose([[1, 2, 3, 4, 5, 1, 2], [7, 8, 9, 7, 8, 9, 7, 8]])
    assert tokens[1].tolist() == [8, 9, 7, 8, 9]
    assert counted == 0


def test_a_single_token_match_is_not_trusted_over_the_model():
    counted, tokens = _propose([[4, 9, 1, 2, 3, 4]])  # only "4" recurs: a 1-gram, below min_ngram 2
    assert tokens[0].tolist() == [4, 63, 63, 63, 63] and counted == 1


def test_a_shorter_model_chain_leaves_the_root_in_its_rows_and_marks_them_short():
    """Lookup drafts the chain of 4, the model 2: the step verifies only 3 nodes unless every row is full."""
    counted, tokens, tree = _propose_tree([[1, 2, 3, 4, 5, 1, 2], [9, 8, 7, 6, 5, 4, 3]], model_steps=2)
    assert tokens[0].tolist() == [2, 3, 4, 5, 1]
    assert tokens[1].tolist() == [3, 63, 63, 3, 3]
    assert np.asarray(tree.full).tolist() == [True, False] and tree.drafted is None and counted == 1
    _, _, same = _propose_tree([[1, 2, 3, 4, 5, 1, 2]], model_steps=CHAIN.num_steps)
    assert same.full is None  # chains of equal length: one verify width


@pytest.fixture(scope="module")
def target():
    return fx.near_bigram_target()


# slow: ngram+eagle3 with a random head greedy = plain; default tier: test_bundled_ngram_eagle3_equals_plain_decoding
@pytest.mark.slow
def test_greedy_output_equals_plain_decoding():
    """A random head's drafts are rejected; lookup hits as the near-bigram target's greedy output cycles. Every
    row, whoever drafted it, must be plain decoding's (a trained head's accepted drafts: the bundled test below).
    The head reads its last 3 slots only, so its sliced attention runs from the fourth token on (the head reading
    every slot is every EAGLE-3 engine test's)."""
    target = fx.near_bigram_target(seed=2)  # its greedy outputs cycle within 33 tokens: lookup drafts get accepted
    plain = fx.plain_engine(target)
    engine = jspec.SpecEngine(fx.TARGET, target, drafter=hybrid_drafter(attention_span=3),
                              drafter_params=fx.random_head(),
                              max_batch_size=4, max_seq_len=fx.MAX_SEQ_LEN)
    for max_new_tokens in (1, 7, 33):
        expected = plain.generate(RAGGED, max_new_tokens=max_new_tokens).token_ids
        out = engine.generate(RAGGED, max_new_tokens=max_new_tokens)
        assert out.token_ids == expected, max_new_tokens
    assert out.stats.acceptance_length > 1.5, out.stats


# slow: ngram+eagle3 with the head's chain shorter than lookup's greedy = plain; default tier: the bundled chain of 11
# (test_bundled_ngram_eagle3_equals_plain_decoding), whose head drafts 7
@pytest.mark.slow
def test_greedy_output_equals_plain_decoding_with_a_shorter_model_chain(target):
    """Lookup drafts 6 tokens, the head 2: a step where every running row found a lookup draft verifies all 7
    nodes (committing up to 7 tokens), any other step the first 3. Both must give plain decoding's tokens."""
    plain = fx.plain_engine(target)
    spec = jspec.SpecConfig(tree="chain", num_steps=6)
    drafter = hybrid_drafter(spec, model_steps=2, attention_span=3)
    assert drafter.short_chain_nodes == 3
    engine = jspec.SpecEngine(fx.TARGET, target, drafter=drafter, drafter_params=fx.random_head(),
                              max_batch_size=4, max_seq_len=fx.MAX_SEQ_LEN)
    for prompts in (RAGGED, RAGGED[3:]):  # mixed rows (mostly short steps); one cycling row (long steps)
        out = engine.generate(prompts, max_new_tokens=33)
        assert out.token_ids == plain.generate(prompts, max_new_tokens=33).token_ids
    assert out.stats.accepted_per_position[3] > 0, out.stats  # a long step accepted more than the head drafts


# slow: the server's short chain cut on the hybrid (below and above its head's chain) keeps greedy output; default tier:
# test_app's test_every_step_program_in_turn_keeps_greedy_output (the cut on prompt lookup's chain),
# test_greedy_output_equals_plain_decoding_with_a_shorter_model_chain (the hybrid's own cut)
@pytest.mark.slow
@pytest.mark.parametrize("short_nodes", [2, 5], ids=["cut-below-the-head", "cut-above-the-head"])
def test_the_servers_short_chain_composes_with_the_shorter_model_chain(target, short_nodes):
    """The server's short program (``spec_step``'s short_nodes) on the hybrid whose head drafts 2 of lookup's 6: cut
    after 1 draft (shorter than the head's chain: the hybrid's own cut never runs) or after 4 (longer: it still
    runs where no row found a lookup draft). Greedy output is plain decoding's either way."""
    plain = fx.plain_engine(target).generate(RAGGED, max_new_tokens=33).token_ids
    drafter = hybrid_drafter(jspec.SpecConfig(tree="chain", num_steps=6), model_steps=2, attention_span=3)
    engine = jspec.SpecEngine(fx.TARGET, target, drafter=drafter, drafter_params=fx.random_head(),
                              max_batch_size=4, max_seq_len=fx.MAX_SEQ_LEN)
    rows, width = len(RAGGED), max(map(len, RAGGED))
    prompt_ids = np.zeros((rows, width), np.int32)
    for b, prompt in enumerate(RAGGED):
        prompt_ids[b, :len(prompt)] = prompt
    lens = np.asarray([len(p) for p in RAGGED], np.int32)

    @jax.jit
    def shortened(params_t, params_d):
        state, inputs = generate_start(params_t, params_d, prompt_ids, lens, jax.random.key(0),
                                       jnp.full((rows,), 33, jnp.int32), jnp.full((rows, 1), -1, jnp.int32),
                                       SamplingArrays.full(rows), setup=engine.setup)
        return run_loop(unstack_layers(params_t, fx.TARGET), params_d, state, inputs, setup=engine.setup,
                        short_nodes=short_nodes)

    state = shortened(engine.params, engine.drafter_params)
    tokens, generated = np.asarray(state.tokens), np.asarray(state.num_generated)
    assert [tokens[b, lens[b]:lens[b] + generated[b]].tolist() for b in range(rows)] == plain
    assert np.asarray(state.accepted_hist)[:, short_nodes:].sum() == 0  # no step committed past the cut


# slow: ngram+eagle3 stops at EOS inside an accepted run; default tier: test_spec_engine's and test_ngram's EOS tests
@pytest.mark.slow
def test_stops_at_eos_inside_an_accepted_run(target):
    plain_ids = fx.plain_engine(target).generate(RAGGED, max_new_tokens=33).token_ids
    eos = plain_ids[1][9]
    expected = fx.plain_engine(target, eos_token_ids=(eos,)).generate(RAGGED, max_new_tokens=33).token_ids
    engine = jspec.SpecEngine(fx.TARGET, target, drafter=hybrid_drafter(), drafter_params=fx.random_head(),
                              max_batch_size=4, max_seq_len=fx.MAX_SEQ_LEN, eos_token_ids=(eos,))
    assert engine.generate(RAGGED, max_new_tokens=33).token_ids == expected


# slow: ngram+eagle3 sampling chi-square (deterministic drafts); default tier: test_spec_sampling, the same path
@pytest.mark.slow
def test_sampling_follows_the_exact_target_distribution():
    """Tiny random target (V = 6: lookups hit often), the target itself as the model drafter (its drafts drawn
    with the drafter's own keys), temperature 1: counts of (x1, x2, x3) vs the enumerated joint. Both kinds of
    draft are verified as deterministic proposals."""
    target = varied(init_params(TINY, jax.random.key(4)))
    spec, rows, prompt = jspec.SpecConfig(tree="chain", num_steps=2), 12000, [1, 4, 2, 1, 4]
    drafter = LookupThenModelDrafter(DraftModelDrafter(TINY, TINY, spec, 16),
                                     NgramDrafter(spec, 16, max_ngram=3, min_ngram=2), spec, 16)
    engine = jspec.SpecEngine(TINY, target, drafter=drafter, drafter_params=target, max_batch_size=rows,
                              max_seq_len=16)
    out = engine.generate([prompt] * rows, max_new_tokens=3, temperature=1.0, seed=5)
    assert out.stats.acceptance_length > 1.1, out.stats
    assert_triples_follow(out.token_ids, exact_triples(TINY, target, prompt))


def test_shapes_are_validated():
    with pytest.raises(ValueError, match="drafts chains"):
        hybrid_drafter(jspec.SpecConfig(tree="dynamic", num_steps=3, topk=2, num_draft_tokens=6))
    with pytest.raises(ValueError, match="expected the hybrid's spec"):
        LookupThenModelDrafter(Eagle3Drafter(fx.HEAD, fx.TARGET, CHAIN, fx.MAX_SEQ_LEN),
                               NgramDrafter(jspec.SpecConfig(tree="chain", num_steps=2), fx.MAX_SEQ_LEN), CHAIN,
                               fx.MAX_SEQ_LEN)
    with pytest.raises(ValueError, match="attention_span=0"):
        hybrid_drafter(attention_span=0)
    with pytest.raises(ValueError, match="a chain of at most the hybrid's 4"):
        LookupThenModelDrafter(Eagle3Drafter(fx.HEAD, fx.TARGET, dataclasses.replace(CHAIN, num_steps=5), 32),
                               NgramDrafter(CHAIN, 32), CHAIN, 32)
    with pytest.raises(ValueError, match="max_seq_len=32; expected 34"):
        LookupThenModelDrafter(Eagle3Drafter(fx.HEAD, fx.TARGET, dataclasses.replace(CHAIN, num_steps=2), 32),
                               NgramDrafter(CHAIN, 32), CHAIN, 32)
    drafter = hybrid_drafter().with_max_seq_len(64)
    assert drafter.max_seq_len == drafter.model.max_seq_len == drafter.lookup.max_seq_len == 64
    drafter = hybrid_drafter(model_steps=2).with_max_seq_len(64)
    assert (drafter.lookup.max_seq_len, drafter.model.max_seq_len) == (64, 66)


def test_bundled_ngram_eagle3_equals_plain_decoding():
    """drafter="ngram+eagle3" by name: the bundled head behind lookup, on a prompt that repeats itself; lookup's
    chain of 11 over the head's 7 (auto's longer candidate; the random-head tests above cover equal chains)."""
    prompt = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
    path = jspec.bundled_model()
    plain = jspec.SpecEngine.from_pretrained(path, max_batch_size=1, max_seq_len=256)
    expected = plain.generate([prompt], max_new_tokens=48).token_ids
    for spec, head_steps in ((jspec.SpecConfig(tree="chain", num_steps=11), hybrid.HEAD_MAX_DEPTH),):
        engine = jspec.SpecEngine.from_pretrained(path, drafter="ngram+eagle3", spec=spec, max_batch_size=1,
                                                  max_seq_len=256)
        drafter = engine.setup.drafter
        assert isinstance(drafter, hybrid.LookupThenModelDrafter) and drafter.model.spec.num_steps == head_steps
        assert drafter.model.attention_span == hybrid.HEAD_ATTENTION_SPAN < engine.setup.max_seq_len
        out = engine.generate([prompt], max_new_tokens=48)
        assert out.token_ids == expected, spec
        assert out.stats.acceptance_length > 2.0, out.stats
