"""The scheduler's KV cache manager (vLLM v1's name): which pages each running request holds. It allocates a new
request's pages (reusing a cached prefix where one is found and its prefill can run), extends a running request's
pages a chunk or two ahead, keys the pages of committed tokens for prefix caching, and frees a request's pages,
writing each row's page table on the model runner as it goes. Host only: the pages themselves are the runner's
store (``jspec.serve.kv_store``); the block manager (``jspec.serve.block_manager``) keeps the free list, reference
counts and prefix keys."""

from __future__ import annotations

from jspec.batching import prompt_bucket
from jspec.serve.block_manager import Allocation, BlockManager, pages_for
from jspec.serve.metrics import ServeMetrics
from jspec.serve.model_runner import ModelRunner
from jspec.serve.requests import Running
from jspec.serve.serve_config import ServeConfig


class KVCacheManager:
    """blocks: the pool's pages; runner: whose page tables and lookahead are used; metrics: the prefix-cache
    counters and ``kv_cache_usage`` it keeps; config: block size, prefix caching, the widths a prefill takes."""

    def __init__(self, blocks: BlockManager, runner: ModelRunner, metrics: ServeMetrics, config: ServeConfig,
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
        rest's own width; a request without a hit prefills on any compiled width). None: the pool is full."""
        config = self.config
        limit = len(context) - 1
        while True:
            queries, hits = self.blocks.prefix_queries_tokens, self.blocks.prefix_hits_tokens
            allocation = self.blocks.allocate(context[:limit], self.runner.lookahead(len(context), need),
                                              drop_last_hit=config.drop_last_hit)
            if allocation is None or not allocation.cached_tokens:
                break
            width = prompt_bucket(len(context) - allocation.cached_tokens, config.max_prompt_width, half_steps=False)
            if self.runner.cached_prefill_width(width, allocation.cached_tokens) is not None:
                break
            self.blocks.free(allocation.pages)
            limit = allocation.cached_tokens - config.block_size
        if allocation is not None:
            self.metrics.prefix_queries.inc(self.blocks.prefix_queries_tokens - queries)
            self.metrics.prefix_hits.inc(self.blocks.prefix_hits_tokens - hits)
        return allocation

    def hold(self, row: int, running: Running) -> None:
        """Row ``row`` reads and writes ``running``'s pages."""
        self.runner.set_table(row, running.pages)

    def pages_wanted(self, rows: dict[int, Running], chunks: int) -> int:
        """Pages the requests in ``rows`` lack for ``chunks`` more chunks each."""
        return sum(max(0, pages_for(self.runner.lookahead(r.seq_len, r.need, chunks), self.config.block_size)
                          - len(r.pages)) for r in rows.values())

    def extend(self, row: int, running: Running, chunks: int) -> bool:
        """``running``'s pages for ``chunks`` more chunks, in its row's page table; False (nothing taken) when the
        pool cannot hold them."""
        if not self.blocks.extend(running.pages, self.runner.lookahead(running.seq_len, running.need, chunks)):
            return False
        self.runner.set_table(row, running.pages)
        return True

    def register(self, running: Running) -> None:
        """Keys the pages of ``running``'s context so far for prefix caching (after its prefill put them there)."""
        running.registered = self.blocks.register(running.pages, running.pending.context, running.registered)

    def release(self, row: int, running: Running) -> None:
        """Frees ``running``'s pages and clears its row's page table; with prefix caching the pages of its committed
        tokens stay keyed for reuse (all but the last step's: a drafter's cache may lag the target's by one
        step)."""
        if self.config.prefix_caching and running.prefilled is None:  # a prompt half prefilled keys nothing
            tokens = running.pending.context
            kept = max(len(tokens) - 1 - self.tokens_per_step, running.registered * self.config.block_size)
            self.blocks.register(running.pages, tokens[:kept], running.registered)
        self.blocks.free(running.pages)
        self.runner.clear_table(row)

    def observe_usage(self) -> None:
        self.metrics.kv_cache_usage.set(self.blocks.usage)
