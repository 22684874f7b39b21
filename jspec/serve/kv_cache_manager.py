"""The scheduler's KV cache manager (vLLM v1's name): which pages each running request holds. It allocates a new
request's pages (reusing a cached prefix where one is found and its prefill can run), extends a running request's
pages a chunk or two ahead, keys the pages of committed tokens for prefix caching, and frees a request's pages,
writing each row's page table on the model runner as it goes. Host only: the pages themselves are the runner's
store (``jspec.serve.kv_store``); the coordinator (``jspec.serve.kv_cache_coordinator``) keeps the page groups
(a binding sliding window's apart, whose pages a request holds only while its window reads them), each group's
block manager (``jspec.serve.block_manager``) its free list, reference counts and prefix keys."""

from __future__ import annotations

from jspec.batching import prompt_bucket
from jspec.serve.block_manager import Allocation, pages_for
from jspec.serve.kv_cache_coordinator import KVCacheCoordinator
from jspec.serve.metrics import ServeMetrics
from jspec.serve.model_runner import ModelRunner
from jspec.serve.requests import Running
from jspec.serve.serve_config import ServeConfig


class KVCacheManager:
    """blocks: the pool's page groups; runner: whose page tables and lookahead are used; metrics: the prefix-cache
    counters and ``kv_cache_usage`` it keeps; config: block size, prefix caching, the widths a prefill takes."""

    def __init__(self, blocks: KVCacheCoordinator, runner: ModelRunner, metrics: ServeMetrics, config: ServeConfig,
                 tokens_per_step: int):
        self.blocks, self.runner, self.metrics, self.config = blocks, runner, metrics, config
        self.tokens_per_step = tokens_per_step

    @property
    def num_free_pages(self) -> int:
        return self.blocks.num_free_pages

    def allocate(self, context: list[int], need: int) -> Allocation | None:
        """Pages for a request of ``context`` tokens (``need`` at most), reusing cached pages of all but its last
        token; a hit is cut by whole pages while no compiled cached prefill runs the rest of the prompt within
        ``max_seq_len`` (the cached prefill's context: ``ModelRunner.cached_prefill_width``, which asks for the
        rest's own width; a request without a hit prefills on any compiled width). The window group's pages
        cover what its first prefill reads and writes (:meth:`window_slots`). None: the pool is full."""
        config = self.config
        limit = len(context) - 1
        num_slots = self.runner.lookahead(len(context), need)
        while True:
            queries, hits = self.blocks.prefix_queries_tokens, self.blocks.prefix_hits_tokens
            allocation = self.blocks.allocate(context[:limit], num_slots, drop_last_hit=config.drop_last_hit)
            if allocation is None:
                break
            cached = allocation.cached_tokens
            if cached:
                width = prompt_bucket(len(context) - cached, config.max_prompt_width, half_steps=False)
                if self.runner.cached_prefill_width(width, cached) is None:
                    self.blocks.free(allocation.pages, allocation.window_pages)
                    limit = cached - config.block_size
                    continue
            pieces = bool(config.piece_width) and len(context) - cached > config.piece_width
            # A whole prefill without a hit computes the prompt densely: its pages are written, never read.
            query = cached if cached or pieces else len(context) - 1
            if not self.blocks.advance(allocation.pages, allocation.window_pages, query,
                                       self.window_slots(num_slots, cached if pieces else None, len(context))):
                self.blocks.free(allocation.pages, allocation.window_pages)
                return None
            break
        if allocation is not None:
            self.metrics.prefix_queries.inc(self.blocks.prefix_queries_tokens - queries)
            self.metrics.prefix_hits.inc(self.blocks.prefix_hits_tokens - hits)
        return allocation

    def window_slots(self, num_slots: int, prefilled: int | None, context_len: int) -> int:
        """Slots the window group covers of a request holding ``num_slots`` in the full group: all of them, but
        for a prompt prefilled in pieces (``prefilled``: where its next piece starts, None: not in pieces) whose
        next piece is not its last, that piece's."""
        if prefilled is None or prefilled + self.config.piece_width >= context_len:
            return num_slots
        return prefilled + self.config.piece_width

    def window_query(self, running: Running) -> int:
        """The position of ``running``'s next query: its next piece's start, or its cache length."""
        return running.seq_len - 1 if running.prefilled is None else running.prefilled

    def hold(self, row: int, running: Running) -> None:
        """Row ``row`` reads and writes ``running``'s pages."""
        self.runner.set_table(row, running.pages, running.window_pages)

    def advance(self, row: int, running: Running) -> bool:
        """The window group's pages of ``running`` for its next piece of prompt (chunked prefill), those out of
        its window freed; False (nothing taken) when the pool cannot hold them."""
        slots = self.window_slots(len(running.pages) * self.config.block_size, running.prefilled,
                                  running.context_len)
        advanced = self.blocks.advance(running.pages, running.window_pages, self.window_query(running), slots)
        self.runner.set_table(row, running.pages, running.window_pages)
        return advanced

    def pages_wanted(self, rows: dict[int, Running], chunks: int) -> int:
        """Pages the requests in ``rows`` lack for ``chunks`` more chunks each."""
        return sum(max(0, pages_for(self.runner.lookahead(r.seq_len, r.need, chunks), self.config.block_size)
                          - len(r.pages)) for r in rows.values())

    def extend(self, row: int, running: Running, chunks: int) -> bool:
        """``running``'s pages for ``chunks`` more chunks, in its row's page table; False (nothing taken) when the
        pool cannot hold them."""
        slots = self.runner.lookahead(running.seq_len, running.need, chunks)
        if not self.blocks.full.extend(running.pages, slots):
            return False
        advanced = self.blocks.advance(running.pages, running.window_pages, self.window_query(running),
                                       self.window_slots(slots, running.prefilled, running.context_len))
        self.runner.set_table(row, running.pages, running.window_pages)
        return advanced

    def register(self, running: Running) -> None:
        """Keys the pages of ``running``'s context so far for prefix caching (after its prefill put them there)."""
        running.registered = self.blocks.register(running.pages, running.window_pages, running.pending.context,
                                                  running.registered)

    def release(self, row: int, running: Running) -> None:
        """Frees ``running``'s pages and clears its row's page table; with prefix caching the pages of its committed
        tokens stay keyed for reuse (all but the last step's: a drafter's cache may lag the target's by one
        step)."""
        if self.config.prefix_caching and running.prefilled is None:  # a prompt half prefilled keys nothing
            tokens = running.pending.context
            kept = max(len(tokens) - 1 - self.tokens_per_step, running.registered * self.config.block_size)
            self.blocks.register(running.pages, running.window_pages, tokens[:kept], running.registered)
        self.blocks.free(running.pages, running.window_pages)
        self.runner.clear_table(row)

    def observe_usage(self) -> None:
        self.metrics.kv_cache_usage.set(self.blocks.usage)
