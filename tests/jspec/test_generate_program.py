"""jspec.generate is one XLA program: one while loop, no host callbacks; same-bucket calls compile nothing."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.sampling import SamplingArrays
from models.config import ModelConfig
from models.llama import init_params
from tests.program_structure import CALLBACK_PRIMITIVES, all_primitives, find_eqns, top_level_eqns

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=8)


@pytest.fixture(scope="module")
def engine():
    params = init_params(CONFIG, jax.random.key(0))
    return jspec.SpecEngine(CONFIG, params, max_batch_size=4, max_seq_len=64)


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
    # the loop body holds the target forward: the scan over its layers
    assert find_eqns(loop.params["body_jaxpr"].jaxpr, "scan")
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
