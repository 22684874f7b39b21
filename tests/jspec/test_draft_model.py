"""A separate draft model as drafter: lossless greedy output (chain / static / dynamic, ragged batch, EOS and
max_new_tokens cuts), an exact copy of the target accepts everything, sampled drafts verified by rejection
sampling follow the target's exact distribution (chi-square), one XLA program, and the checkpoint path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.drafters.draft_model import DraftModelDrafter
from jspec.generate import generate_start, run_loop
from jspec.generate_setup import GenerateSetup
from jspec.step import short_draft_nodes
from jspec.sampling import SamplingArrays
from models.config import ModelConfig
from models.llama import init_params, unstack_layers
from tests import spec_fixtures as fx
from tests.exact_distribution import PROMPT, TINY, assert_triples_follow, exact_triples, varied
from tests.program_structure import CALLBACK_PRIMITIVES, all_primitives, top_level_eqns

RAGGED = [[5, 9, 13], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41], [7] * 6]
DRAFT = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                    num_kv_heads=1, head_dim=8)


def engine_for(target, draft_config, draft_params, spec, **kwargs):
    drafter = DraftModelDrafter(draft_config, fx.TARGET, spec, fx.MAX_SEQ_LEN)
    return jspec.SpecEngine(fx.TARGET, target, drafter=drafter, drafter_params=draft_params, max_batch_size=4,
                            max_seq_len=fx.MAX_SEQ_LEN, **kwargs)


@pytest.fixture(scope="module")
def target():
    return fx.near_bigram_target()


@pytest.fixture(scope="module")
def small_draft():
    return init_params(DRAFT, jax.random.key(7))


@pytest.fixture(scope="module")
def plain_outputs(target):
    engine = fx.plain_engine(target)
    return {n: engine.generate(RAGGED, max_new_tokens=n).token_ids for n in (1, 7, 33)}


# slow: draft-model greedy = plain for every tree; default tier: test_pard's greedy [chain] (the draft model's prefill
# and commit), test_dflash's [static], test_spec_engine's EOS test [dynamic],
# test_a_shortened_chain_follows_the_exact_target_distribution (its drafting, sampled)
@pytest.mark.slow
@pytest.mark.parametrize("tree", sorted(fx.SPECS))
def test_greedy_output_equals_plain_decoding(target, small_draft, plain_outputs, tree):
    """A different (smaller, random) draft model: drafts get rejected, output is still the target's."""
    engine = engine_for(target, DRAFT, small_draft, fx.SPECS[tree])
    for max_new_tokens, expected in plain_outputs.items():
        assert engine.generate(RAGGED, max_new_tokens=max_new_tokens).token_ids == expected, max_new_tokens
    assert engine.num_compiled == 2  # sequence buffers: 16 + 1 and 16 + 7 fit 32 slots, 16 + 33 needs 64


# slow: a copy of the target as draft model accepts every draft of a chain and of a static tree; default tier:
# test_spec_engine's forced-acceptance statistics
@pytest.mark.slow
@pytest.mark.parametrize("tree", ["chain", "static"])
def test_exact_copy_of_the_target_accepts_every_draft(target, plain_outputs, tree):
    spec = fx.SPECS[tree]
    depth = spec.max_depth
    engine = engine_for(target, fx.TARGET, target, spec)
    out = engine.generate(RAGGED, max_new_tokens=1 + 4 * (depth + 1))
    assert out.stats.acceptance_length == depth + 1, out.stats
    assert out.stats.accepted_per_position == [1.0] * depth
    expected = fx.plain_engine(target).generate(RAGGED, max_new_tokens=1 + 4 * (depth + 1)).token_ids
    assert out.token_ids == expected
    cut = engine.generate(RAGGED, max_new_tokens=33)  # budget ends inside an accepted run
    assert cut.token_ids == plain_outputs[33]


# slow: a draft model stops at EOS inside an accepted run; default tier: test_spec_engine's and test_ngram's
@pytest.mark.slow
def test_stops_at_eos_inside_an_accepted_run(target, plain_outputs):
    eos = plain_outputs[33][1][9]
    plain = fx.plain_engine(target, eos_token_ids=(eos,)).generate(RAGGED, max_new_tokens=33).token_ids
    assert plain[1][-1] == eos and len(plain[1]) <= 10
    engine = engine_for(target, fx.TARGET, target, fx.SPECS["chain"], eos_token_ids=(eos,))
    assert engine.generate(RAGGED, max_new_tokens=33).token_ids == plain


def test_one_xla_program(target, small_draft):
    engine = engine_for(target, DRAFT, small_draft, fx.SPECS["static"])
    b, p = 2, 16
    sampling = SamplingArrays(jnp.ones((b,)), jnp.zeros((b,), jnp.int32), jnp.ones((b,)))
    args = (target, small_draft, jnp.ones((b, p), jnp.int32), jnp.full((b,), 3, jnp.int32), jax.random.key(0),
            jnp.full((b,), 8, jnp.int32), jnp.full((b, 1), -1, jnp.int32), sampling)
    jaxpr = jax.make_jaxpr(lambda *a: jspec.generate(*a, setup=engine.setup))(*args).jaxpr
    top = top_level_eqns(jaxpr)
    assert [e.primitive.name for e in top].count("while") == 1
    assert not set(all_primitives(jaxpr)) & set(CALLBACK_PRIMITIVES)


def test_vocab_mismatch_is_refused():
    other = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match=r"vocab_size=32.*vocab_size=64"):
        DraftModelDrafter(other, fx.TARGET, fx.SPECS["chain"], fx.MAX_SEQ_LEN)


# --- sampling: drafts drawn from the draft model, verified by (recursive) rejection sampling ---------------------



# slow: a draft model's chain of 2 sampled drafts and its tree (recursive rejection), chi-square in the engine;
# default tier: test_a_shortened_chain_follows_the_exact_target_distribution (the same engine path, verified after one
# draft), test_tree_verify's test_sampling_is_lossless[3-2-True] (deeper sampled drafts over siblings, the same
# verifier)
@pytest.mark.slow
@pytest.mark.parametrize("spec", [jspec.SpecConfig(tree="chain", num_steps=2),
                                  jspec.SpecConfig(tree="static", tree_choices=((0,), (1,), (2,), (0, 0), (1, 0)))],
                         ids=["chain", "tree"])
def test_sampled_drafts_follow_the_exact_target_distribution(spec):
    """The draft model (another random model) samples its drafts at temperature 1.0; x2, x3 come from
    verification steps (x1 from prefill). Counts of (x1, x2, x3) over 12000 rows vs the enumerated joint."""
    target, draft = varied(init_params(TINY, jax.random.key(4))), varied(init_params(TINY, jax.random.key(9)))
    rows = 12000
    drafter = DraftModelDrafter(TINY, TINY, spec, 16)
    engine = jspec.SpecEngine(TINY, target, drafter=drafter, drafter_params=draft, max_batch_size=rows,
                              max_seq_len=16)
    out = engine.generate([PROMPT] * rows, max_new_tokens=3, temperature=1.0, seed=3)
    assert 1.1 < out.stats.acceptance_length < spec.max_depth + 1  # drafts both accepted and rejected
    assert_triples_follow(out.token_ids, exact_triples(TINY, target, PROMPT))


def test_a_shortened_chain_follows_the_exact_target_distribution():
    """The server's short program (``spec_step`` with use_short): a chain of 3 drafts verified after its first, so
    each step commits at most 2 tokens; (x1, x2, x3) still follow the target's joint."""
    target, draft = varied(init_params(TINY, jax.random.key(4))), varied(init_params(TINY, jax.random.key(9)))
    rows, spec = 12000, jspec.SpecConfig(tree="chain", num_steps=3)
    setup = GenerateSetup(TINY, 16, drafter=DraftModelDrafter(TINY, TINY, spec, 16))
    short_nodes = short_draft_nodes(spec, 1)
    assert short_nodes == 2 and short_draft_nodes(spec, 3) is None

    @jax.jit
    def shortened(prompt_ids, prompt_lens, max_new_tokens):
        drawn = SamplingArrays.full(rows, jspec.SamplingParams(temperature=1.0))
        state, inputs = generate_start(target, draft, prompt_ids, prompt_lens, jax.random.key(3), max_new_tokens,
                                       jnp.full((rows, 1), -1, jnp.int32), drawn, setup=setup)
        return run_loop(unstack_layers(target, TINY), draft, state, inputs, setup=setup, short_nodes=short_nodes)

    state = shortened(jnp.tile(jnp.asarray([PROMPT + [0] * 3], jnp.int32), (rows, 1)),
                      jnp.full((rows,), len(PROMPT), jnp.int32), jnp.full((rows,), 3, jnp.int32))
    hist = np.asarray(state.accepted_hist).sum(axis=0)
    assert hist[1] > 0 and hist[2:].sum() == 0  # one draft accepted at most: the short chain ran, and accepted
    tokens = np.asarray(state.tokens)[:, len(PROMPT):len(PROMPT) + 3]
    assert_triples_follow(tokens.tolist(), exact_triples(TINY, target, PROMPT))


# --- loading: from_pretrained(target, drafter=draft_dir | "ngram") ------------------------------------------------


def _write_converted(directory, config: ModelConfig, params) -> str:
    from models.checkpoint import write_jspec_dir
    directory.mkdir()
    hf_config = {"model_type": "llama", "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
                 "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
                 "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
                 "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta}
    write_jspec_dir(str(directory), hf_config, params, "llama", "float32", None)
    return str(directory)


# slow: from_pretrained with a converted draft model = plain; default tier: the bundled draft in test_tree_selection
@pytest.mark.slow
def test_from_pretrained_with_a_draft_model_or_ngram(target, small_draft, tmp_path):
    target_dir = _write_converted(tmp_path / "target", fx.TARGET, target)
    draft_dir = _write_converted(tmp_path / "draft", DRAFT, small_draft)
    kwargs = dict(spec=fx.SPECS["chain"], max_batch_size=4, max_seq_len=64)
    plain = jspec.SpecEngine.from_pretrained(target_dir, max_batch_size=4, max_seq_len=64)
    expected = plain.generate(RAGGED, max_new_tokens=12).token_ids
    for drafter in (draft_dir, "ngram"):
        engine = jspec.SpecEngine.from_pretrained(target_dir, drafter=drafter, **kwargs)
        assert engine.generate(RAGGED, max_new_tokens=12).token_ids == expected, drafter
    other = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=8)
    wrong_dir = _write_converted(tmp_path / "wrong", other, init_params(other, jax.random.key(0)))
    with pytest.raises(ValueError, match=r"vocab_size=32 differs from the target's vocab_size=64"):
        jspec.SpecEngine.from_pretrained(target_dir, drafter=wrong_dir, **kwargs)
