"""The paged decode state against the offline engine: rows prefilled together into scattered pages holding stale
values and stepped in any order over any row set return exactly what ``SpecEngine.generate([prompt])`` returns
alone, for plain decoding and every drafter kind with a cache (the drafters' caches are paged like the target's)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

import jspec
from jspec.attention import target_attention
from jspec.config import SamplingParams
from jspec.serve import kv_store, paged
from jspec.serve.programs import admit_row
from tests import spec_fixtures as fx
from tests.jspec.serve.test_slots import BUDGETS, PROMPTS, make_engine

PAGE = 8
NUM_STOP_IDS = 4
SEQ_LEN = 64


@pytest.fixture(scope="module")
def params_t():
    return fx.near_bigram_target()


def serve_paged(engine, prompts, budgets, *, rows_per_step: int, speculate: bool = True, page: int = PAGE):
    """Prefills every prompt (two at a time) into pages handed out in a shuffled order, then steps the rows in
    groups of ``rows_per_step`` (other rows waiting in the store) until all are done -> new tokens per prompt."""
    setup = engine.setup.with_max_seq_len(SEQ_LEN)
    args = (engine.params, engine.drafter_params)
    max_rows = len(prompts) + 1
    layout = kv_store.paged_layout(*args, setup=setup, num_stop_ids=NUM_STOP_IDS, page_size=page,
                                   num_pages=1 + max_rows * (12 * PAGE // page), max_rows=max_rows)
    store = stale_store(layout, kv_store.empty_store(*args, layout, setup=setup, num_stop_ids=NUM_STOP_IDS))
    free = list(np.random.default_rng(0).permutation(np.arange(1, layout.num_pages)))
    tables = np.zeros((max_rows + 1, 1, layout.pages_per_row), np.int32)
    row_of = list(range(1, len(prompts) + 1))  # row 0 stays unused: rows need not be the lowest
    for i in range(len(prompts)):
        tables[row_of[i], 0] = [free.pop() for _ in range(layout.pages_per_row)]
    done = np.zeros(len(prompts), bool)
    outputs: list[list[int]] = [[] for _ in prompts]
    for first in range(0, len(prompts), 2):
        group = list(range(first, min(first + 2, len(prompts))))
        rows = [admit_row(prompts[i], SamplingParams(max_new_tokens=budgets[i]), engine.eos_token_ids,
                          width=16, num_stop_ids=NUM_STOP_IDS) for i in group]
        batch = [np.concatenate(parts) for parts in zip(*[r[:5] for r in rows])]
        sampling = jax.tree.map(lambda *a: np.concatenate(a), *[r[5] for r in rows])
        ids = np.asarray([row_of[i] for i in group], np.int32)
        store, _ = paged.prefill_rows(*args, store, *batch, sampling, None, ids, tables[ids], layout=layout,
                                      setup=setup, seq_len=SEQ_LEN)  # None: no logits processors
    order = list(range(len(prompts)))
    while not done.all():
        order = order[1:] + order[:1]
        group = [i for i in order if not done[i]][:rows_per_step]
        ids = np.full(rows_per_step, layout.null_row, np.int32)
        ids[:len(group)] = [row_of[i] for i in group]
        store, out = paged.step_rows(*args, store, ids, tables[ids], np.zeros(rows_per_step, bool),
                                     np.int32(2), layout=layout, setup=setup, seq_len=SEQ_LEN,
                                     speculate=speculate, write_pages=paged.write_pages(layout, setup, 2))
        out = jax.device_get(out)
        for k, i in enumerate(group):
            n = int(out.num_generated[k])
            outputs[i] = out.tokens[k, len(prompts[i]):len(prompts[i]) + n].tolist()
            done[i] = bool(out.done[k])
    return outputs


def stale(pool: jax.Array, seed: int) -> jax.Array:
    """A pool as earlier requests leave it: every slot holds something (pages are reused unwiped)."""
    key = jax.random.key(seed)
    if jax.numpy.issubdtype(pool.dtype, jax.numpy.integer):
        return jax.random.randint(key, pool.shape, 0, fx.TARGET.vocab_size, pool.dtype)
    return jax.random.normal(key, pool.shape, pool.dtype)


def stale_store(layout: kv_store.PagedLayout, store: kv_store.Store) -> kv_store.Store:
    """``store`` with every pool :func:`stale`."""
    leaves = [stale(leaf, i) if spec.kind == kv_store.SLOT else leaf
              for i, (spec, leaf) in enumerate(zip(layout.leaves, jax.tree.leaves(store)))]
    return jax.tree.unflatten(layout.treedef, leaves)


# slow: rows in scattered pages equal generate alone, stepped by the paged functions without the scheduler (no drafter,
# EAGLE-3 trees, n-gram lookup's token buffer, a draft model's whole KV cache); default tier: test_slots'
# test_every_request_equals_generate_alone_greedy[eagle3-dynamic] (the scheduler over the same paged step, a drafter
# cache paged), test_paged_scheduler, test_app (the n-gram server)
@pytest.mark.slow
@pytest.mark.parametrize("name", ["plain", "eagle3-dynamic", "draft-model", "ngram", "dflash"])
def test_paged_rows_equal_generate_alone(params_t, name):
    engine = make_engine(params_t, name)
    prompts, budgets = PROMPTS[:5], BUDGETS[:5]
    got = serve_paged(engine, prompts, budgets, rows_per_step=2)
    for prompt, budget, tokens in zip(prompts, budgets, got):
        assert tokens == engine.generate([prompt], max_new_tokens=budget).token_ids[0], (name, prompt)


# slow: the server's step programs through the paged kernel (interpreter) equal offline generate; default tier: the
# kernel against its reference (test_paged_tree_attention) and test_paged_rows_equal_generate_alone
@pytest.mark.slow
@pytest.mark.parametrize("impl", ["interpret", "tpu_interpret"])
def test_the_paged_tree_attention_kernel_keeps_every_row_equal_to_generate_alone(params_t, impl):
    """The server's attention through pallas_kernels.paged_tree_attention (its Triton or TPU form in a Pallas
    interpreter, pages of 16, GQA), the offline reference through the dense tree kernel: the same tokens."""
    engine = make_engine(params_t, "eagle3-dynamic")
    engine.setup = dataclasses.replace(engine.setup, attention_fn=functools.partial(target_attention, impl=impl))
    prompts, budgets = PROMPTS[:3], BUDGETS[:3]
    got = serve_paged(engine, prompts, budgets, rows_per_step=2, page=16)
    for prompt, budget, tokens in zip(prompts, budgets, got):
        assert tokens == engine.generate([prompt], max_new_tokens=budget).token_ids[0], prompt


def engine_with(params_t, name: str):
    if name == "hybrid":
        from tests.jspec.test_hybrid import hybrid_drafter
        return jspec.SpecEngine(fx.TARGET, params_t, drafter=hybrid_drafter(), drafter_params=fx.random_head(),
                                max_batch_size=4, max_seq_len=fx.MAX_SEQ_LEN)
    return make_engine(params_t, name)


# slow: [hybrid] (its head and lookup continue from a cached prefix), [plain] (the target alone); default tier:
# [eagle3-dynamic] (the target's K/V checked there too), [dflash]
@pytest.mark.parametrize("name", ["eagle3-dynamic", pytest.param("hybrid", marks=pytest.mark.slow),
                                  pytest.param("plain", marks=pytest.mark.slow), "dflash"])
def test_a_cached_prefix_continues_as_a_whole_prefill(params_t, name):
    """A prompt prefilled whole into row 1, then the same prompt into row 2 from row 1's first three pages (its
    fourth recomputed, as the server does for a head pairing slot p with token p + 1): row 2's state (the target's
    K/V, the tokens, and the drafter's: the head's K/V slots, its last logits and feature; DFlash's context K/V)
    equals row 1's."""
    engine = engine_with(params_t, name)
    setup = engine.setup.with_max_seq_len(SEQ_LEN)
    args = (engine.params, engine.drafter_params)
    layout = kv_store.paged_layout(*args, setup=setup, num_stop_ids=NUM_STOP_IDS, page_size=PAGE, num_pages=40,
                                   max_rows=3)
    store = stale_store(layout, kv_store.empty_store(*args, layout, setup=setup, num_stop_ids=NUM_STOP_IDS))
    prompt = [(5 * i) % 60 + 1 for i in range(29)]
    tables = np.zeros((4, 1, layout.pages_per_row), np.int32)
    tables[1, 0] = np.arange(1, 1 + layout.pages_per_row)
    tables[2, 0, :3] = tables[1, 0, :3]
    tables[2, 0, 3:] = np.arange(20, 20 + layout.pages_per_row - 3)
    whole = admit_row(prompt, SamplingParams(max_new_tokens=8), engine.eos_token_ids, width=32,
                      num_stop_ids=NUM_STOP_IDS)
    store, _ = paged.prefill_rows(*args, store, *whole, np.asarray([1], np.int32), tables[[1]], layout=layout,
                                  setup=setup, seq_len=SEQ_LEN)
    cached = 3 * PAGE
    rest = admit_row(prompt[cached:], SamplingParams(max_new_tokens=8), engine.eos_token_ids, width=8,
                     num_stop_ids=NUM_STOP_IDS)
    store, _ = paged.prefill_cached_rows(*args, store, rest[0], np.asarray([len(prompt)], np.int32),
                                         np.asarray([cached], np.int32), *rest[2:], np.asarray([2], np.int32),
                                         tables[[2]], layout=layout, setup=setup, seq_len=SEQ_LEN)
    (state, _) = kv_store.gather_view(layout, store, np.asarray([1, 2], np.int32), tables[[1, 2]], SEQ_LEN)
    assert state.tokens[0, :len(prompt) + 1].tolist() == state.tokens[1, :len(prompt) + 1].tolist()
    assert state.seq_len.tolist() == [len(prompt) + 1] * 2
    for k in (state.cache.k, state.cache.v):
        for layer in k:
            np.testing.assert_allclose(layer[1, :len(prompt)], layer[0, :len(prompt)], atol=2e-5)
    if name == "plain":
        return
    if name == "dflash":  # per layer [B, S, Hkv, D]: slot p the context of the token at p
        for layer in state.draft.cache.k + state.draft.cache.v:
            np.testing.assert_allclose(layer[1, :len(prompt)], layer[0, :len(prompt)], atol=2e-5)
        return
    head = state.draft.model if name == "hybrid" else state.draft
    np.testing.assert_allclose(head.logits[1], head.logits[0], atol=2e-5)
    np.testing.assert_allclose(head.hidden[1], head.hidden[0], atol=2e-5)
    for k in (head.cache.k, head.cache.v):  # [1, B, S, Hkv, D]: slots 0 .. P-1 hold pairs (token p + 1, feature p)
        np.testing.assert_allclose(k[:, 1, :len(prompt)], k[:, 0, :len(prompt)], atol=2e-5)
    if name == "hybrid":  # lookup's buffer: slots past its length are padding
        lookup = state.draft.lookup
        assert lookup.length.tolist() == [len(prompt) + 1] * 2
        assert lookup.tokens[1, :len(prompt) + 1].tolist() == lookup.tokens[0, :len(prompt) + 1].tolist()
