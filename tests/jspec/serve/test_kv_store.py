"""The server's KV store is laid out as the state's owners declare: the target's pools and each drafter's, named,
with the bytes a token takes in them; the store has the state's type; a declaration the state's shapes contradict
is refused naming the leaf. Shapes only (``jax.eval_shape``): nothing here compiles."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.drafters import DrafterBase, static_draft_tree
from jspec.serve import kv_store
from jspec.serve.programs import idle_slots
from jspec.state_layout import TARGET_KV, PerPosition, PerRow
from tests import spec_fixtures as fx
from tests.jspec.serve.test_slots import make_engine

NUM_STOP_IDS = 4
SEQ_LEN = 64
HKV, HEAD_DIM = fx.TARGET.num_kv_heads, fx.TARGET.head_dim


@pytest.fixture(scope="module")
def params_t():
    return fx.near_bigram_target()


def layout_of(engine, setup=None, max_rows: int = 3) -> kv_store.PagedLayout:
    setup = setup or engine.setup.with_max_seq_len(SEQ_LEN)
    return kv_store.paged_layout(engine.params, engine.drafter_params, setup=setup, num_stop_ids=NUM_STOP_IDS,
                                 page_size=8, num_pages=20, max_rows=max_rows)


def bytes_per_token_from_shapes(engine, layout: kv_store.PagedLayout) -> float:
    """Bytes of every paged leaf of one row's idle state over the slots it holds: what a token costs, read off the
    arrays themselves."""
    setup = engine.setup.with_max_seq_len(SEQ_LEN)
    state = jax.eval_shape(functools.partial(idle_slots, setup=setup, num_slots=1, num_stop_ids=NUM_STOP_IDS),
                           engine.params, engine.drafter_params)
    return sum(leaf.size * leaf.dtype.itemsize / (SEQ_LEN + spec.extra_slots)
               for spec, leaf in zip(layout.leaves, jax.tree.leaves(state)) if spec.kind == kv_store.SLOT)


# (kind, the drafter's pools: name -> (buffers, per-token shape)); the target's K/V and the token buffer always
EXPECTED_POOLS = {
    "plain": {},
    "eagle3-dynamic": {"EAGLE-3 K/V": (2, (1, HKV, HEAD_DIM))},
    "draft-model": {"draft model K/V": (2 * fx.TARGET.num_layers, (HKV, HEAD_DIM))},
    "ngram": {"n-gram tokens": (1, ())},
}


@pytest.mark.parametrize("name", sorted(EXPECTED_POOLS))
def test_the_target_and_each_drafter_declare_their_pools(params_t, name):
    engine = make_engine(params_t, name)
    layout = layout_of(engine)
    pools = {pool.name: pool for pool in layout.pools}
    expected = {TARGET_KV: (2 * fx.TARGET.num_layers, (HKV, HEAD_DIM)), "tokens": (1, ()), **EXPECTED_POOLS[name]}
    assert {name: (len(pool.buffers), pool.buffers[0][0]) for name, pool in pools.items()} == expected
    assert layout.bytes_per_token() == pytest.approx(bytes_per_token_from_shapes(engine, layout))
    assert layout.bytes_per_token(kv_split=2) == pytest.approx(
        layout.bytes_per_token() - pools[TARGET_KV].bytes_per_token / 2)
    tree_window = engine.setup.cache_slots - engine.setup.max_seq_len  # the verify pass's slots past the context
    assert layout.extra_slots == tree_window
    assert layout.pages_per_row == -(-(SEQ_LEN + tree_window) // 8)


def test_the_api_features_add_their_own_pools(params_t):
    engine = make_engine(params_t, "eagle3-dynamic")
    setup = dataclasses.replace(engine.setup.with_max_seq_len(SEQ_LEN), logprobs=20, logits_processors=True)
    layout = layout_of(engine, setup)
    logprobs = layout.pool("log-probabilities")
    assert sorted(logprobs.buffers) == [((), "float32"), ((20,), "float32"), ((20,), "int32")]
    assert {pool.name for pool in layout.pools} == {TARGET_KV, "tokens", "EAGLE-3 K/V", "log-probabilities"}
    state, inputs = jax.tree.unflatten(layout.treedef, list(layout.leaves))
    assert state.features.output_counts.kind == kv_store.ROW and inputs.features.processors.logit_bias.kind == kv_store.ROW


def test_the_store_has_the_states_type(params_t):
    engine = make_engine(params_t, "eagle3-dynamic")
    setup = engine.setup.with_max_seq_len(SEQ_LEN)
    layout = layout_of(engine, max_rows=5)
    state, inputs = jax.eval_shape(functools.partial(kv_store.empty_store, layout=layout, setup=setup,
                                                     num_stop_ids=NUM_STOP_IDS), engine.params, engine.drafter_params)
    assert all(k.shape == (20, 8, HKV, HEAD_DIM) for k in state.cache.k + state.cache.v)
    assert state.draft.cache.k.shape == (20, 8, 1, HKV, HEAD_DIM)  # the head's stacked layer axis kept
    assert state.tokens.shape == (20, 8)
    assert state.seq_len.shape == (6,) and inputs.stop_ids.shape == (6, NUM_STOP_IDS)  # max_rows + the null row
    assert state.step.shape == ()


@dataclasses.dataclass(frozen=True)
class Remembers(DrafterBase):
    """Drafts the token it saw ``spec.num_steps`` positions ago, from a buffer of every token (slot = position):
    its state must be declared per position, which ``declared`` says."""

    spec: jspec.SpecConfig
    max_seq_len: int
    declared: str = "per position"

    def state_layout(self, state):
        if self.declared == "default":
            return super().state_layout(state)
        slots = self.max_seq_len + (1 if self.declared == "one slot too many" else 0)
        return (PerPosition("remembered tokens", slots), PerRow())

    def prefill(self, params_t, params_d, ctx):
        batch, width = ctx.prompt_ids.shape
        tokens = jnp.zeros((batch, self.max_seq_len), jnp.int32).at[:, :width].set(ctx.prompt_ids)
        return tokens, ctx.prompt_lens

    def propose(self, params_t, params_d, state, root, cache_len, *, sampling=None, key=None):
        tokens, _ = state
        tree = self.static_tree
        earlier = jnp.take_along_axis(tokens, jnp.maximum(cache_len - 1, 0)[:, None], axis=1)
        drafts = jnp.concatenate([root[:, None], jnp.repeat(earlier, tree.num_nodes - 1, axis=1)], axis=1)
        return state, static_draft_tree(tree, drafts, cache_len)

    def commit(self, params_t, params_d, state, ctx):
        return state


def user_engine(params_t, declared: str) -> jspec.SpecEngine:
    drafter = Remembers(fx.SPECS["chain"], fx.MAX_SEQ_LEN, declared)
    return jspec.SpecEngine(fx.TARGET, params_t, drafter=drafter, drafter_params={}, max_batch_size=2,
                            max_seq_len=fx.MAX_SEQ_LEN)


def test_a_user_drafters_declared_buffer_is_paged_in_its_own_pool(params_t):
    layout = layout_of(user_engine(params_t, "per position"))
    assert layout.pool("remembered tokens").buffers == (((), "int32"),)


@pytest.mark.parametrize("declared, says", [
    ("default", r"\[0\]\.draft\[0\] of shape \(3, 32\) \(context 32; \(3, 48\) at 48\) is declared PerRow.*"
                r"PerPosition"),
    ("one slot too many", r"\[0\]\.draft\[0\] .* is declared PerPosition\(pool='remembered tokens', slots=33.*"
                          r"the context plus 1 slots on axis 1"),
], ids=["default", "one slot too many"])
def test_a_declaration_the_shapes_contradict_is_refused_naming_the_leaf(params_t, declared, says):
    with pytest.raises(ValueError, match=says):
        layout_of(user_engine(params_t, declared))


def test_pool_bytes_count_every_buffer():
    pool = kv_store.KVPool("k/v", (((2, 4), "bfloat16"), ((2, 4), "bfloat16"), ((), "int32")))
    assert pool.bytes_per_token == 2 * 8 * 2 + 4
    assert pool.describe() == "k/v: 3 buffers of [2, 4] bfloat16 or [] int32 (36 bytes/token)"
    assert np.dtype(pool.buffers[0][1]).itemsize == 2
