"""jspec.generate is one XLA program: one while loop, no host callbacks; same-bucket calls compile nothing."""

import re

import jax
import jax.numpy as jnp
import pytest

import jspec
from jspec.sampling import SamplingArrays
from models.config import ModelConfig
from models.llama import init_params
from tests.program_structure import (
    CALLBACK_PRIMITIVES,
    all_primitives,
    find_eqns,
    top_level_eqns,
)

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=8)


@pytest.fixture(scope="module")
def engine():
    params = init_params(CONFIG, jax.random.key(0))
    return jspec.SpecEngine(CONFIG, params, max_batch_size=4, max_seq_len=64)


def assert_target_in(body, config: ModelConfig) -> None:
    """The target's layers (unrolled at inference: one MLP down-projection per layer) and its lm_head run in
    ``body``."""
    dots = find_eqns(body, "dot_general")
    down = [e for e in dots if e.invars[0].aval.shape[-1] == config.intermediate_size
            and e.outvars[0].aval.shape[-1] == config.hidden_size]
    lm_head = [e for e in dots if e.outvars[0].aval.shape[-1] == config.vocab_size]
    assert len(down) >= config.num_layers, f"{len(down)} MLP down-projections in the loop, expected {config.num_layers}"
    assert lm_head, "the target's lm_head does not run inside the loop"


def generate_args(engine, b=2, p=16):
    sampling = SamplingArrays(jnp.zeros((b,)), jnp.zeros((b,), jnp.int32), jnp.ones((b,)))
    return (engine.params, None, jnp.zeros((b, p), jnp.int32), jnp.ones((b,), jnp.int32), jax.random.key(0),
            jnp.full((b,), 8, jnp.int32), jnp.full((b, 1), -1, jnp.int32), sampling)


def test_one_while_loop_and_no_host_callbacks(engine):
    args = generate_args(engine)
    jaxpr = jax.make_jaxpr(lambda *a: jspec.generate(*a, setup=engine.setup))(*args).jaxpr
    top = top_level_eqns(jaxpr)
    loops = [e for e in top if e.primitive.name == "while"]
    assert len(loops) == 1, [e.primitive.name for e in top]
    (loop,) = loops
    # the loop body holds the whole target forward: every layer's MLP and the lm_head
    assert_target_in(loop.params["body_jaxpr"].jaxpr, CONFIG)
    assert not set(all_primitives(jaxpr)) & set(CALLBACK_PRIMITIVES)
    compiled = jspec.generate.lower(*args, setup=engine.setup).compile().as_text()
    targets = re.findall(r'custom_call_target="([^"]+)"', compiled)
    assert not [t for t in targets if "callback" in t.lower()], targets
    assert " outfeed(" not in compiled and " send(" not in compiled


def test_same_bucket_compiles_nothing_new(engine):
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.append(event) if "backend_compile" in event else None)
    first = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=5)
    assert engine.num_compiled == 1
    before = len(compiles)
    # other lengths in the same buckets (batch 2, width 16), other sampling values and max_new_tokens
    second = engine.generate([[7, 8, 9, 10, 11], [12]], max_new_tokens=9, temperature=0.8, top_k=5, seed=3)
    assert engine.num_compiled == 1
    assert len(compiles) == before, compiles[before:]
    assert second.stats.compile_seconds == 0.0 and first.stats.compile_seconds > 0.0
    assert [len(t) for t in second.token_ids] == [9, 9]


SPEC_TARGET = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                          num_kv_heads=2, head_dim=8)
DRAFT_VOCAB = 48  # distinct from the target's, so the head's lm_head is recognisable in the program


def _spec_engine(tree):
    from jspec.drafters.eagle3 import Eagle3Drafter
    from models.eagle3 import eagle3_config_from_hf, init_eagle3_params

    head = eagle3_config_from_hf({"hidden_size": 32, "intermediate_size": 40, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "vocab_size": 64, "draft_vocab_size": DRAFT_VOCAB})
    spec = {"chain": jspec.SpecConfig(tree="chain", num_steps=3),
            "static": jspec.SpecConfig(tree="static", tree_choices=((0,), (1,), (0, 0))),
            "dynamic": jspec.SpecConfig(tree="dynamic", num_steps=3, topk=2, num_draft_tokens=5)}[tree]
    params_d = {"head": init_eagle3_params(head, jax.random.key(1)), "d2t": jnp.zeros((DRAFT_VOCAB,), jnp.int32)}
    return jspec.SpecEngine(SPEC_TARGET, init_params(SPEC_TARGET, jax.random.key(0)),
                            drafter=Eagle3Drafter(head, SPEC_TARGET, spec, 64), drafter_params=params_d,
                            max_batch_size=4, max_seq_len=64)


def speculative_loop(engine):
    """-> (generate's arguments with the drafter's params, the program's jaxpr, the body of its one while loop);
    asserts there is exactly one loop at the top level."""
    args = generate_args(engine)
    args = (args[0], engine.drafter_params) + args[2:]
    jaxpr = jax.make_jaxpr(lambda *a: jspec.generate(*a, setup=engine.setup))(*args).jaxpr
    loops = [e for e in top_level_eqns(jaxpr) if e.primitive.name == "while"]
    assert len(loops) == 1
    return args, jaxpr, loops[0].params["body_jaxpr"].jaxpr


# slow: [chain], [static] (a chain's, a static tree's generate is one while loop holding both models); default tier:
# [dynamic]
@pytest.mark.parametrize("tree", [pytest.param("chain", marks=pytest.mark.slow),
                                  pytest.param("static", marks=pytest.mark.slow), "dynamic"])
def test_speculative_generate_is_one_loop_holding_both_models(tree):
    engine = _spec_engine(tree)
    args, jaxpr, body = speculative_loop(engine)
    assert_target_in(body, SPEC_TARGET)
    head_lm_head = [e for e in find_eqns(body, "dot_general")
                    if any(getattr(v.aval, "shape", ())[-1:] == (DRAFT_VOCAB,) for v in e.invars)]
    assert head_lm_head, "the drafter does not run inside the loop"
    assert not set(all_primitives(jaxpr)) & set(CALLBACK_PRIMITIVES)
    compiled = jspec.generate.lower(*args, setup=engine.setup).compile().as_text()
    targets = re.findall(r'custom_call_target="([^"]+)"', compiled)
    assert not [t for t in targets if "callback" in t.lower()], targets


# slow: a second speculative call in the same bucket compiles nothing; default tier:
# test_same_bucket_compiles_nothing_new (plain decoding, the same bucketing)
@pytest.mark.slow
def test_speculative_same_bucket_compiles_nothing_new():
    engine = _spec_engine("dynamic")
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.append(event) if "backend_compile" in event else None)
    engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=5)
    before = len(compiles)
    engine.generate([[7, 8, 9, 10, 11], [12]], max_new_tokens=9, temperature=0.8, top_p=0.9, seed=3)
    assert engine.num_compiled == 1 and len(compiles) == before, compiles[before:]


MTP_TARGET = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8)  # intermediate != 2H: the modules' input_proj [2H, H] stands out


# slow: [vanilla-5] (vanilla MTP's generate is one loop holding target and modules); default tier: [mtp_eagle-3] (the
# same program shape with the other module chaining)
@pytest.mark.parametrize("mode, forwards", [("mtp_eagle", 2 + 1),
                                            pytest.param("vanilla", 2 + 3, marks=pytest.mark.slow)])
def test_mtp_generate_is_one_loop_holding_target_and_modules(mode, forwards):
    """MTP (jspec/drafters/mtp.py), chain of 3: the loop body runs the target and every module forward: 2 drafting
    depths in propose, then the commit's extend (module 0 alone for mtp_eagle, the three modules for vanilla)."""
    from jspec.drafters.mtp import MtpDrafter
    from models.mtp import MtpConfig, init_mtp_params

    config = MtpConfig.for_target(MTP_TARGET, 3)
    drafter = MtpDrafter(config, MTP_TARGET, jspec.SpecConfig(tree="chain", num_steps=3), 64, mode=mode)
    engine = jspec.SpecEngine(MTP_TARGET, init_params(MTP_TARGET, jax.random.key(0)), drafter=drafter,
                              drafter_params=init_mtp_params(config, jax.random.key(1)), max_batch_size=4,
                              max_seq_len=64)
    _, jaxpr, body = speculative_loop(engine)
    assert_target_in(body, MTP_TARGET)
    input_proj = [e for e in find_eqns(body, "dot_general") if e.invars[0].aval.shape[-1] == 2 * 32
                  and e.outvars[0].aval.shape[-1] == 32]
    assert len(input_proj) == forwards, len(input_proj)
    assert not set(all_primitives(jaxpr)) & set(CALLBACK_PRIMITIVES)
