"""The scheduler of the slot engine against programs run on the host (``host_programs``: nothing compiles):
admission by pages, preemption by recompute, prefix hits, chunked prefill, cancelling, readout ownership under async
scheduling, and buckets compiled on first use off the scheduler's thread. Every request must return what the toy
model returns for it alone, which a wrong page table, a page freed too early or a readout handed to the wrong
request would change. That the real programs give generate's tokens under the same scheduling is
test_paged_scheduler's and test_slots' (and test_app's, over HTTP)."""

from __future__ import annotations

import re
import time

import pytest

from jspec.batching import prompt_bucket
from jspec.serve.model_runner import CACHED_STAND_IN
from jspec.serve.requests import NotAccepting, QueueFull, Request
from tests import spec_fixtures as fx
from tests.jspec.serve.host_programs import HostSlotEngine
from tests.jspec.serve.test_slots import BUDGETS, MAX_SEQ_LEN, PROMPTS, Collector, serve_all

PAGED = dict(max_seq_len=MAX_SEQ_LEN, adapt=False, block_size=8, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def engine():
    return fx.plain_engine(fx.near_bigram_target())


def metric(slots: HostSlotEngine, name: str) -> float:
    """A sample's value in the slot engine's /metrics body."""
    text = slots.metrics.render().decode()
    return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE).group(1))


def served(slots: HostSlotEngine, requests: list[dict]) -> list[Collector]:
    """Queues ``requests`` on ``slots`` (warm), then starts it (so the scheduler finds them all waiting, however
    fast the host programs run), waits for them and shuts it down; every request returned what it returns alone
    and every page is free again."""
    sinks = [Collector() for _ in requests]
    for sink, kwargs in zip(sinks, requests):
        slots.submit(Request(sink=sink, **kwargs))
    slots.start()
    try:
        for sink in sinks:
            assert sink.finished.wait(60), "a request did not finish"
    finally:
        slots.shutdown(10)
    for request, sink in zip(requests, sinks):
        assert sink.tokens == slots.expected(request["prompt_ids"], request["max_tokens"]), request
        assert sink.reason in ("stop", "length")
    assert slots.blocks.num_used_pages == 0 and slots.num_running == 0
    return sinks


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_pool_too_small_preempts_and_recomputes_without_changing_a_request(engine, async_scheduling):
    """Seven requests through four rows and a pool that holds one request and two pages: requests are preempted
    and recomputed, and each returns what it returns alone. With async scheduling chunks are dispatched while the
    one before is unread, and a preemption happens only with no chunk in flight; without it, no chunk is ever
    dispatched with another in flight. A pool smaller than one request is refused at warm-up, naming the least."""
    with pytest.raises(ValueError, match="max_total_tokens=1: expected at least") as refused:
        HostSlotEngine(engine, **PAGED, max_num_seqs=4, row_buckets=(4,), max_total_tokens=1).warm_up()
    one_request = int(re.search(r"at least (\d+) token slots", str(refused.value)).group(1))
    slots = HostSlotEngine(engine, **PAGED, steps_per_chunk=3, max_num_seqs=4, row_buckets=(4,),
                           max_total_tokens=one_request + 16, async_scheduling=async_scheduling)
    slots.warm_up()
    overlapped, preempted_in_flight = [], []
    dispatch, preempt = slots._dispatch, slots.scheduler.preempt
    slots._dispatch = lambda running: overlapped.append(slots._flight is not None) or dispatch(running)
    slots.scheduler.preempt = lambda row: preempted_in_flight.append(slots._flight is not None) or preempt(row)
    served(slots, [dict(prompt_ids=p, max_tokens=n) for p, n in zip(PROMPTS, BUDGETS)])
    preempted = metric(slots, "jspec:num_preemptions_total")
    assert preempted > 0
    assert any(overlapped) == async_scheduling, overlapped
    assert len(preempted_in_flight) == preempted and not any(preempted_in_flight)


def test_pages_hold_more_requests_than_static_slots_would(engine):
    """A pool of two max_seq_len requests' worth of slots runs six short requests at once."""
    slots = HostSlotEngine(engine, **PAGED, steps_per_chunk=2, max_num_seqs=8, row_buckets=(8,),
                           max_total_tokens=2 * MAX_SEQ_LEN + 16)
    slots.warm_up()
    seen: list[int] = []
    update = slots._update_from_output
    slots._update_from_output = lambda *args, **kwargs: seen.append(slots.num_running) or update(*args, **kwargs)
    served(slots, [dict(prompt_ids=[3 + i, 5, 7], max_tokens=12) for i in range(8)])
    assert max(seen) >= 6, seen


def serve_one_then_four_sharing_its_prefix(slots: HostSlotEngine) -> None:
    """Serves one request, then four at once sharing its 40-token prefix (five pages of 8), each with its own
    2-token rest; each must return what it returns alone."""
    prefix = [(7 * i) % 60 + 1 for i in range(40)]
    requests = [dict(prompt_ids=prefix + [i + 1, 2 * i + 3], max_tokens=10 + i) for i in range(5)]
    slots.start()
    try:
        sinks = serve_all(slots, requests[:1]) + serve_all(slots, requests[1:])
    finally:
        slots.shutdown(10)
    for request, sink in zip(requests, sinks):
        assert sink.tokens == slots.expected(request["prompt_ids"], request["max_tokens"]), request


def test_a_shared_prefix_is_computed_once(engine):
    """Requests sharing a 40-token prefix (five pages of 8): after the first, every later one finds its five whole
    pages in the cache (hits counted in tokens, as vLLM counts them), prefills only its rest on them, and still
    returns what it returns alone."""
    slots = HostSlotEngine(engine, **{**PAGED, "enable_prefix_caching": True}, steps_per_chunk=2, max_num_seqs=4,
                           row_buckets=(4,), precompile="all")
    slots.warm_up()
    cached = []
    prefill = slots._prefill
    slots._prefill = lambda items, width, rows, cached_lens, lengths: cached.append(cached_lens) or prefill(
        items, width, rows, cached_lens, lengths)
    serve_one_then_four_sharing_its_prefix(slots)
    assert metric(slots, "jspec:prefix_cache_hits_total") == 4 * 40
    assert metric(slots, "jspec:prefix_cache_queries_total") == 5 * 41  # every prompt but its last token
    assert sorted(n for lens in cached if lens for n in lens) == [40] * 4
    assert slots.blocks.num_used_pages == 0


def test_a_burst_of_prefix_hits_runs_on_the_warm_cached_prefill_while_its_own_width_compiles(engine):
    """precompile="needed" with prefix caching: warm-up compiles one cached prefill, CACHED_STAND_IN tokens wide.
    A burst of requests sharing the first one's cached prefix, whose short rests' own width is still compiling
    (slowly, off the scheduler), hits the cache on it at once rather than being admitted without its hit."""
    slots = HostSlotEngine(engine, **{**PAGED, "enable_prefix_caching": True, "max_seq_len": 2 * MAX_SEQ_LEN},
                           steps_per_chunk=2, max_num_seqs=4, row_buckets=(4,))
    slots.warm_up()
    stand_in = prompt_bucket(CACHED_STAND_IN, slots.max_prompt_width, half_steps=False)
    assert [key for key in slots.runner.programs.keys() if key[0] == "prefill_cached"] == [
        ("prefill_cached", 1, stand_in)]
    slots.runner.compile_seconds = 0.5  # from now on
    serve_one_then_four_sharing_its_prefix(slots)
    assert metric(slots, "jspec:prefix_cache_hits_total") == 4 * 40
    assert ("prefill_cached", 1, stand_in) in slots.runner.programs.keys()
    assert slots.blocks.num_used_pages == 0


def test_a_long_prompt_is_prefilled_in_pieces_between_chunks_of_the_running_rows(engine):
    """Chunked prefill: with --max-num-batched-tokens 16 (two pages of 8), a 45-token prompt is prefilled in
    pieces of 16; a short request submitted with it gains tokens between them, and both return what they return
    alone."""
    with pytest.raises(ValueError, match="max_num_batched_tokens=4: expected an integer >= "):
        HostSlotEngine(engine, **PAGED, max_num_batched_tokens=4)
    slots = HostSlotEngine(engine, **PAGED, steps_per_chunk=1, max_num_seqs=2, row_buckets=(2,),
                           max_num_batched_tokens=16)
    assert slots.piece_width == 16 and max(slots.widths) == 16
    slots.warm_up(list(range(1, 40)))
    log: list = []
    update = slots._update_from_output
    slots._update_from_output = lambda rows, *args, **kwargs: log.append(
        [slots._rows[r].request.max_tokens for r in rows]) or update(rows, *args, **kwargs)
    long_prompt = [(5 * i) % 60 + 1 for i in range(45)]
    served(slots, [dict(prompt_ids=[3, 9, 27], max_tokens=40), dict(prompt_ids=long_prompt, max_tokens=12)])
    first_long = next(i for i, budgets in enumerate(log) if 12 in budgets)
    assert first_long >= 3, log  # the running request's prefill, then a chunk after each middle piece


def test_a_readout_goes_only_to_the_request_that_held_the_row_at_dispatch(engine):
    """Async scheduling's edge, driven step by step (no scheduler thread): a request finishes in chunk A while
    chunk B, dispatched before A was read back, still steps its row; the row then goes to a new request, whose
    prefill reads B back. B's readout of that row belongs to the finished request and is skipped."""
    slots = HostSlotEngine(engine, max_seq_len=16, steps_per_chunk=2, adapt=False, max_num_seqs=2, row_buckets=(2,),
                           enable_prefix_caching=False, async_scheduling=True)
    slots.warm_up()
    budgets = (3, 9, 5)
    sinks = [Collector() for _ in budgets]
    for prompt, budget, sink in zip(PROMPTS[:2], budgets, sinks):
        slots.submit(Request(prompt_ids=prompt, max_tokens=budget, sink=sink))
    slots._admit(slots.scheduler.take_waiting())
    slots._chunk()  # A: the first request's last two tokens; not read back
    assert slots._flight is not None and not sinks[0].finished.is_set()
    slots._chunk()  # B over both rows, then A read back: the first request's row is free
    assert slots._flight is not None and sinks[0].finished.is_set() and slots.num_running == 1
    slots.submit(Request(prompt_ids=PROMPTS[2], max_tokens=budgets[2], sink=sinks[2]))
    slots._admit(slots.scheduler.take_waiting())  # into the first one's row; its prefill reads B back first
    while slots.num_running:
        slots._chunk()
    for prompt, budget, sink in zip(PROMPTS[:3], budgets, sinks):
        assert sink.tokens == slots.expected(prompt, budget) and sink.reason in ("stop", "length")
    assert slots.blocks.num_used_pages == 0 and slots._flight is None


def test_a_missing_bucket_runs_on_a_larger_one_while_it_compiles_off_the_scheduler(engine):
    """precompile="needed": warm-up compiles the widest prefill and the longest context's step programs; a short
    request runs on them at once while its own buckets compile on the compiling thread (slowly here: never the
    scheduler's), and the gauges count them."""
    slots = HostSlotEngine(engine, **PAGED, steps_per_chunk=3, row_buckets=(1, 4), seq_buckets=(32, MAX_SEQ_LEN),
                           compile_seconds=0.3)
    slots.warm_up(PROMPTS[0])
    widest = slots.widths[-1]
    assert set(slots.runner.programs.keys()) == {("prefill", 1, widest), ("step", "full", 1, MAX_SEQ_LEN),
                                           ("step", "full", 4, MAX_SEQ_LEN)}
    assert metric(slots, "jspec:programs_compiled") == 3
    slots.runner.compile_threads.clear()
    prompt = PROMPTS[2]  # 3 + 12 tokens: the 32-slot bucket, the narrowest prompt width
    slots.start()
    try:
        first, = serve_all(slots, [dict(prompt_ids=prompt, max_tokens=12)])
        assert slots.runner.programs.wait_idle(30)
        assert {("step", "full", 1, 32), ("prefill", 1, 16)} <= set(slots.runner.programs.compiled_on_demand)
        assert (metric(slots, "jspec:programs_compiled"), metric(slots, "jspec:programs_compiling")) == (
            3 + len(slots.runner.programs.compiled_on_demand), 0)
        second, = serve_all(slots, [dict(prompt_ids=prompt, max_tokens=12)])
    finally:
        slots.shutdown()
    assert first.tokens == second.tokens == slots.expected(prompt, 12)
    threads = slots.runner.compile_threads
    assert threads and set(threads) == {"jspec-compile"}, threads


def test_a_cancelled_request_frees_its_row_and_the_queue_is_bounded(engine):
    """Cancelling ends a request at a chunk boundary with its reason and frees its row and pages for the next
    (driven chunk by chunk, no scheduler thread); a full queue refuses (QueueFull), and a server not warm or shut
    down takes nothing (NotAccepting)."""
    slots = HostSlotEngine(engine, **PAGED, steps_per_chunk=2, max_num_seqs=1, row_buckets=(1,), max_queue=1)
    with pytest.raises(NotAccepting):
        slots.submit(Request([1, 2], 4, Collector()))
    slots.warm_up()
    running, waiting = Collector(), Collector()
    first = slots.submit(Request([1, 2, 3], 60, running))
    with pytest.raises(QueueFull):  # the first one still waits
        slots.submit(Request([1, 2, 3], 60, Collector()))
    slots._admit(slots.scheduler.take_waiting())  # the only row
    slots._chunk()
    slots.submit(Request([4, 5], 6, waiting))  # waits for the row
    first.cancel()
    for _ in range(20):
        if slots.num_running:
            slots._chunk()
        slots._admit(slots.scheduler.take_waiting())
        if waiting.finished.is_set():
            break
    slots._land()
    assert running.reason == "abort" and 0 < len(running.tokens) < 60
    assert waiting.tokens == slots.expected([4, 5], 6)
    assert slots.blocks.num_used_pages == 0 and slots.num_running == 0
    slots.shutdown(1)
    with pytest.raises(NotAccepting):
        slots.submit(Request([1, 2], 4, Collector()))


def settle(slots, timeout: float = 30.0) -> None:
    """Waits until no request runs and no chunk is in flight (a chunk dispatched before the last readout lands)."""
    deadline = time.monotonic() + timeout
    while slots.num_running or slots._flight is not None:
        assert time.monotonic() < deadline, "the scheduler did not settle"
        time.sleep(0.01)


def test_chunks_whose_requests_use_no_api_feature_run_the_lean_step(engine):
    """A server offering log-probabilities and logits processors: while no running request uses them, chunks run
    the step program without them ("step_lean"), compiled on first use off the scheduler (the full one serves
    meanwhile); a chunk with a request that uses a processor runs the full one. (Their values under real programs:
    test_slots' slow test_chunks_whose_requests_use_no_api_feature_run_the_programs_without_them, test_app's served
    requests.)"""
    slots = HostSlotEngine(engine, **PAGED, steps_per_chunk=2, max_num_seqs=4, row_buckets=(4,), max_logprobs=5,
                           logits_processors=True)
    slots.warm_up()
    calls = slots.runner.calls
    plain = [dict(prompt_ids=p, max_tokens=n) for p, n in zip(PROMPTS[:3], BUDGETS[:3])]
    slots.start()
    try:
        serve_all(slots, plain)
        assert slots.runner.programs.wait_idle(60)
        assert "step_lean" in [key[0] for key in slots.runner.programs.compiled_on_demand]
        before = len(calls)
        serve_all(slots, plain)
        lean_chunks = [key[0] for key in calls[before:] if key[0].startswith("step")]
        settle(slots)  # the last chunk read back: nothing of these requests' runs after this point
        before = len(calls)
        # Both taken at once (submitted under the scheduler's lock): the penalised request, 30 tokens against 18,
        # then rides every chunk. Submitted one after the other, a scheduler that ran ahead of this thread could
        # finish it before taking the other, whose chunks alone then rightly run lean.
        penalised = [Collector(), Collector()]
        with slots.scheduler.lock:
            for sink, request in zip(penalised, [dict(plain[0], processors={"presence_penalty": 0.5}), plain[1]]):
                slots.submit(Request(sink=sink, **request))
        assert all(sink.finished.wait(60) for sink in penalised)
        full_chunks = [key[0] for key in calls[before:] if key[0].startswith("step")]
    finally:
        slots.shutdown(10)
    assert lean_chunks and set(lean_chunks) == {"step_lean"}
    assert full_chunks and set(full_chunks) == {"step"}
    assert [sink.tokens for sink in penalised] == [slots.expected(r["prompt_ids"], r["max_tokens"]) for r in plain[:2]]
