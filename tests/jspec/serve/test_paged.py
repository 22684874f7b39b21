"""The paged decode state against the offline engine: rows prefilled together into scattered pages holding stale
values and stepped in any order over any row set return exactly what ``SpecEngine.generate([prompt])`` returns
alone, for plain decoding and every drafter kind with a cache (the drafters' caches are paged like the target's)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jspec.config import SamplingParams
from jspec.serve import paged
from jspec.serve.programs import admit_row
from tests import spec_fixtures as fx
from tests.jspec.serve.test_slots import BUDGETS, PROMPTS, make_engine

PAGE = 8
NUM_STOP_IDS = 4
SEQ_LEN = 64


@pytest.fixture(scope="module")
def params_t():
    return fx.near_bigram_target()


def serve_paged(engine, prompts, budgets, *, rows_per_step: int, speculate: bool = True):
    """Prefills every prompt (two at a time) into pages handed out in a shuffled order, then steps the rows in
    groups of ``rows_per_step`` (other rows waiting in the store) until all are done -> new tokens per prompt."""
    setup = engine.setup.with_max_seq_len(SEQ_LEN)
    args = (engine.params, engine.drafter_params)
    max_rows = len(prompts) + 1
    layout = paged.paged_layout(*args, setup=setup, num_stop_ids=NUM_STOP_IDS, page_size=PAGE,
                                num_pages=1 + max_rows * 12, max_rows=max_rows)
    assert any(leaf.kind == paged.SLOT and leaf.kv for leaf in layout.leaves)
    store = paged.empty_store(*args, layout, setup=setup, num_stop_ids=NUM_STOP_IDS)
    store = [stale(leaf, i) if spec.kind == paged.SLOT else leaf
             for i, (spec, leaf) in enumerate(zip(layout.leaves, store))]
    free = list(np.random.default_rng(0).permutation(np.arange(1, layout.num_pages)))
    tables = np.zeros((max_rows + 1, layout.pages_per_row), np.int32)
    row_of = list(range(1, len(prompts) + 1))  # row 0 stays unused: rows need not be the lowest
    for i in range(len(prompts)):
        tables[row_of[i]] = [free.pop() for _ in range(layout.pages_per_row)]
    done = np.zeros(len(prompts), bool)
    outputs: list[list[int]] = [[] for _ in prompts]
    for first in range(0, len(prompts), 2):
        group = list(range(first, min(first + 2, len(prompts))))
        rows = [admit_row(prompts[i], SamplingParams(max_new_tokens=budgets[i]), engine.eos_token_ids,
                          width=16, num_stop_ids=NUM_STOP_IDS) for i in group]
        batch = [np.concatenate(parts) for parts in zip(*[r[:5] for r in rows])]
        sampling = jax.tree.map(lambda *a: np.concatenate(a), *[r[5] for r in rows])
        ids = np.asarray([row_of[i] for i in group], np.int32)
        store, _ = paged.prefill_rows(*args, store, *batch, sampling, ids, tables[ids], layout=layout,
                                      setup=setup, seq_len=SEQ_LEN)
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


@pytest.mark.parametrize("name", ["plain", "eagle3-dynamic", "draft-model", "ngram"])
def test_paged_rows_equal_generate_alone(params_t, name):
    engine = make_engine(params_t, name)
    prompts, budgets = PROMPTS[:5], BUDGETS[:5]
    got = serve_paged(engine, prompts, budgets, rows_per_step=2)
    for prompt, budget, tokens in zip(prompts, budgets, got):
        assert tokens == engine.generate([prompt], max_new_tokens=budget).token_ids[0], (name, prompt)
