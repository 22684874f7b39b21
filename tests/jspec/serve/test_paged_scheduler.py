"""The scheduler over the paged KV cache: admission by pages holds more requests than static slots would, a pool
too small for the load preempts and recomputes requests without losing or altering one, and the metrics count it."""

from __future__ import annotations

import re

import pytest

from jspec.serve.requests import Request
from jspec.serve.slots import SlotEngine
from tests import spec_fixtures as fx
from tests.jspec.serve.test_slots import BUDGETS, MAX_SEQ_LEN, PROMPTS, Collector, make_engine, serve_all


@pytest.fixture(scope="module")
def params_t():
    return fx.near_bigram_target()


def metric(text: str, name: str) -> float:
    """A sample's value in a /metrics body."""
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))


class Watching(Collector):
    """A sink that also records how many requests were running whenever it was called."""

    def __init__(self, slots: SlotEngine, seen: list[int]):
        super().__init__()
        self.slots, self.seen = slots, seen

    def __call__(self, tokens, reason):
        self.seen.append(self.slots.num_running)
        super().__call__(tokens, reason)


def serve_watching(slots: SlotEngine, requests: list[dict]) -> tuple[list[Collector], int]:
    seen: list[int] = []
    sinks = [Watching(slots, seen) for _ in requests]
    for sink, kwargs in zip(sinks, requests):
        slots.submit(Request(sink=sink, **kwargs))
    for sink in sinks:
        assert sink.finished.wait(120), "a request did not finish"
    return sinks, max(seen)


# slow: [eagle3-dynamic] (preemption by recompute with a drafter cache paged); default tier: [plain], test_slots'
# [eagle3-dynamic] rows
@pytest.mark.parametrize("name,async_scheduling", [pytest.param("plain", True, id="plain"),
                                                     pytest.param("plain", False, id="plain-sync"),
                                                     pytest.param("eagle3-dynamic", True, id="eagle3-dynamic",
                                                                  marks=pytest.mark.slow)])
def test_a_pool_too_small_preempts_and_every_request_equals_generate_alone(params_t, name, async_scheduling):
    """Seven requests through four rows and a pool that holds one request and two pages: requests are preempted
    and recomputed, and each returns what it returns alone. With async scheduling (the default) chunks are
    dispatched while the one before is unread, and a preemption happens only with no chunk in flight (a pool
    that cannot hold two chunks ahead for every row reads the chunk in flight back first); without it, no chunk
    is ever dispatched with another in flight."""
    engine = make_engine(params_t, name)
    slots = SlotEngine(engine, max_seq_len=MAX_SEQ_LEN, steps_per_chunk=3, adapt=False, block_size=8,
                       max_num_seqs=4, row_buckets=(4,), max_total_tokens=1,
                       enable_prefix_caching=False)
    with pytest.raises(ValueError, match="max_total_tokens=1: expected at least") as refused:
        slots.warm_up()
    one_request = int(re.search(r"at least (\d+) token slots", str(refused.value)).group(1))
    slots = SlotEngine(engine, max_seq_len=MAX_SEQ_LEN, steps_per_chunk=3, adapt=False, block_size=8,
                       max_num_seqs=4, row_buckets=(4,), max_total_tokens=one_request + 16,
                       enable_prefix_caching=False, async_scheduling=async_scheduling)
    slots.warm_up()
    overlapped, preempted_in_flight = [], []
    dispatch, preempt = slots._dispatch, slots.scheduler.preempt

    def watched_dispatch(running):
        overlapped.append(slots._flight is not None)
        return dispatch(running)

    def watched_preempt(row):
        preempted_in_flight.append(slots._flight is not None)
        return preempt(row)

    slots._dispatch, slots.scheduler.preempt = watched_dispatch, watched_preempt
    slots.start()
    try:
        requests = [dict(prompt_ids=p, max_tokens=n, seed=i) for i, (p, n) in enumerate(zip(PROMPTS, BUDGETS))]
        sinks = serve_all(slots, requests)
        metrics = slots.metrics.render().decode()
    finally:
        slots.shutdown(10)
    for prompt, budget, sink in zip(PROMPTS, BUDGETS, sinks):
        assert sink.tokens == engine.generate([prompt], max_new_tokens=budget).token_ids[0], (name, prompt)
        assert sink.reason in ("stop", "length")
    preempted = metric(metrics, "jspec:num_preemptions_total")
    assert preempted > 0, metrics
    assert slots.blocks.num_used_pages == 0 and slots.num_running == 0
    assert any(overlapped) == async_scheduling, overlapped
    assert len(preempted_in_flight) == preempted and not any(preempted_in_flight)


# slow: admission by pages lets more requests run than static slots would, on the real programs; default tier:
# test_scheduler's test_pages_hold_more_requests_than_static_slots_would (the same scheduling on host programs),
# test_a_pool_too_small_preempts_and_every_request_equals_generate_alone[plain] (admission and preemption by pages)
@pytest.mark.slow
def test_pages_hold_more_requests_than_static_slots_would(params_t):
    """A pool of two max_seq_len requests' worth of slots runs six short requests at once."""
    engine = make_engine(params_t, "plain")
    slots = SlotEngine(engine, max_seq_len=MAX_SEQ_LEN, steps_per_chunk=2, adapt=False, block_size=8,
                       max_num_seqs=8, row_buckets=(8,), max_total_tokens=2 * MAX_SEQ_LEN + 16,
                       enable_prefix_caching=False)
    slots.warm_up()
    slots.start()
    try:
        requests = [dict(prompt_ids=[3 + i, 5, 7], max_tokens=12) for i in range(8)]
        sinks, most = serve_watching(slots, requests)
    finally:
        slots.shutdown(10)
    assert most >= 6, most
    for request, sink in zip(requests, sinks):
        assert sink.tokens == engine.generate([request["prompt_ids"]], max_new_tokens=12).token_ids[0]


# slow: the scheduler's prefix hits leave outputs unchanged (no drafter, n-gram lookup, EAGLE-3 with its last page
# recomputed); default tier: test_scheduler's test_a_shared_prefix_is_computed_once (hits counted, on host
# programs), test_app's shared-prefix test (n-gram over HTTP), test_paged's
# test_a_cached_prefix_continues_as_a_whole_prefill[eagle3-dynamic], test_block_manager's drop_last_hit test
@pytest.mark.slow
@pytest.mark.parametrize("name", ["plain", "ngram", "eagle3-dynamic"])
def test_a_shared_prefix_is_computed_once_and_outputs_are_unchanged(params_t, name):
    """Requests sharing a 40-token prefix (five pages of 8): after the first, every later one finds its whole
    pages in the cache (hits counted in tokens, as vLLM counts them; EAGLE-3 computes the last one again) and
    still returns what it returns alone."""
    engine = make_engine(params_t, name)
    slots = SlotEngine(engine, max_seq_len=MAX_SEQ_LEN, steps_per_chunk=2, adapt=False, block_size=8,
                       max_num_seqs=4, row_buckets=(4,), precompile="all")  # a hit is not cut for want of a program
    slots.warm_up()
    slots.start()
    prefix = [(7 * i) % 60 + 1 for i in range(40)]
    requests = [dict(prompt_ids=prefix + [i + 1, 2 * i + 3], max_tokens=10 + i) for i in range(5)]
    try:
        first = serve_all(slots, requests[:1])
        rest = serve_all(slots, requests[1:])
        metrics = slots.metrics.render().decode()
    finally:
        slots.shutdown(10)
    for request, sink in zip(requests, first + rest):
        alone = engine.generate([request["prompt_ids"]], max_new_tokens=request["max_tokens"]).token_ids[0]
        assert sink.tokens == alone, request
    hits = metric(metrics, "jspec:prefix_cache_hits_total")
    queries = metric(metrics, "jspec:prefix_cache_queries_total")
    reused = 32 if name == "eagle3-dynamic" else 40
    assert hits == 4 * reused, metrics  # each later request: its five whole prefix pages (four for EAGLE-3)
    assert queries == 5 * 41  # every prompt but its last token


class Logged(Collector):
    """A sink that appends (its name, tokens so far) to a log shared by several requests."""

    def __init__(self, name: str, log: list):
        super().__init__()
        self.name, self.log = name, log

    def __call__(self, tokens, reason):
        super().__call__(tokens, reason)
        self.log.append((self.name, len(self.tokens)))


# slow: chunked prefill on the real programs, with no drafter and with EAGLE-3 (each piece's last page
# recomputed); default tier: test_scheduler's test of the same name (the scheduling, on host programs), test_app's
# test_a_shared_prefix_is_found_in_the_cache_and_changes_nothing (prompts prefilled in pieces, real programs),
# test_paged's test_a_cached_prefix_continues_as_a_whole_prefill[eagle3-dynamic] (the head continuing from pages
# already written)
@pytest.mark.slow
@pytest.mark.parametrize("name", ["plain", "eagle3-dynamic"])
def test_a_long_prompt_is_prefilled_in_pieces_between_chunks_of_the_running_rows(params_t, name):
    """Chunked prefill: with --max-num-batched-tokens 16 (two pages of 8), a 45-token prompt is prefilled in
    pieces; a short request submitted with it gains tokens between them (it is not stalled for the whole prompt), and
    both return what they return alone. EAGLE-3 computes each piece's last page again with the next piece. (The
    start-up runs of every program prefill a calibration prompt, which must fit a piece too.)"""
    engine = make_engine(params_t, name)
    with pytest.raises(ValueError, match="max_num_batched_tokens=4: expected an integer >= "):
        SlotEngine(engine, max_seq_len=MAX_SEQ_LEN, block_size=8, max_num_batched_tokens=4)
    slots = SlotEngine(engine, max_seq_len=MAX_SEQ_LEN, steps_per_chunk=1, adapt=False, block_size=8,
                       max_num_seqs=2, row_buckets=(2,), max_num_batched_tokens=16, enable_prefix_caching=False)
    assert slots.piece_width == 16 and max(slots.widths) == 16  # no program wider than a piece
    slots.warm_up(list(range(1, 40)))  # a calibration prompt longer than a piece: cut to one
    slots.start()
    log: list = []
    running, long = Logged("running", log), Logged("long", log)
    long_prompt = [(5 * i) % 60 + 1 for i in range(45)]
    try:
        slots.submit(Request(prompt_ids=[3, 9, 27], max_tokens=40, sink=running))
        slots.submit(Request(prompt_ids=long_prompt, max_tokens=12, sink=long))
        for sink in (running, long):
            assert sink.finished.wait(120), "a request did not finish"
    finally:
        slots.shutdown(10)
    # Prefilled whole, the long prompt's first token would come before any chunk (prefills go first); in pieces,
    # the running request's prefill and then a chunk after each middle piece come first.
    first_long = next(i for i, (who, _) in enumerate(log) if who == "long")
    assert sum(who == "running" for who, _ in log[:first_long]) >= 3, log
    assert running.tokens == engine.generate([[3, 9, 27]], max_new_tokens=40).token_ids[0]
    assert long.tokens == engine.generate([long_prompt], max_new_tokens=12).token_ids[0]
    assert slots.blocks.num_used_pages == 0 and slots.num_running == 0


# slow: readout ownership under async scheduling on the real programs; default tier: test_scheduler's test of the
# same name (the same steps on host programs)
@pytest.mark.slow
def test_a_readout_goes_only_to_the_request_that_held_the_row_at_dispatch(params_t):
    """Async scheduling's edge, driven step by step (no scheduler thread): a request finishes in chunk A while
    chunk B, dispatched before A was read back, still steps its row (another request keeps B in flight); the row
    then goes to a new request, whose prefill reads B back. B's readout of that row belongs to the finished request
    and is skipped: every request returns what it returns alone."""
    engine = make_engine(params_t, "plain")
    slots = SlotEngine(engine, max_seq_len=16, steps_per_chunk=2, adapt=False, max_num_seqs=2, row_buckets=(2,),
                       enable_prefix_caching=False, async_scheduling=True)  # short: one prompt width to compile
    slots.warm_up()
    budgets = (3, 9, 5)
    sinks = [Collector() for _ in budgets]
    for prompt, budget, sink in zip(PROMPTS[:2], budgets, sinks):
        slots.submit(Request(prompt_ids=prompt, max_tokens=budget, sink=sink))
    slots._admit(slots.scheduler.take_waiting())  # their first tokens
    slots._chunk()  # A: the first request's last two tokens; not read back
    assert slots._flight is not None and not sinks[0].finished.is_set()
    slots._chunk()  # B over both rows (the first finished on the device), then A read back: its row is free
    assert slots._flight is not None and sinks[0].finished.is_set() and slots.num_running == 1
    slots.submit(Request(prompt_ids=PROMPTS[2], max_tokens=budgets[2], sink=sinks[2]))
    slots._admit(slots.scheduler.take_waiting())  # into the first one's row; its prefill reads B back first
    while slots.num_running:
        slots._chunk()
    alone = engine.generate(PROMPTS[:3], max_new_tokens=max(budgets)).token_ids  # greedy: a prefix per budget
    for tokens, budget, sink in zip(alone, budgets, sinks):
        assert sink.tokens == tokens[:budget] and sink.reason == "length"
    assert slots.blocks.num_used_pages == 0 and slots._flight is None
