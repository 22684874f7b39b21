"""The KV cache coordinator (vLLM v1's name): the page groups of a server whose target has layers with a binding
sliding window (gpt-oss, Gemma-3, Mistral past its window), as vLLM's hybrid allocator keeps them.

Group 0 (full) holds every paged leaf but the window layers' K/V: a request holds a page for each of its
positions, as :class:`~jspec.serve.block_manager.BlockManager` hands them out. Group 1 (window) holds the K/V of
the layers of window W in a pool of its own pages, numbered apart, through a page table of the same width. A query
at position q reads positions > q - W only, and a request's next queries are at its committed length or later, so
it holds window pages only from the page of ``query - W + 1`` on: a page that falls out of the window is freed
(kept in the prefix cache where its content is keyed) and its page-table entry becomes the null page, which reads
and writes garbage nobody attends to. A long request thus costs W + a lookahead of K/V in those layers::

    positions            0..15 16..31 32..47 48..63 64..79        (page_size 16, W = 20, next query at 70)
    full group pages     [ 3  |  9   |  4   |  12  |  7  ]
    window group pages   [ 0  |  0   |  0   |   5  |  2  ]        70 - 20 + 1 = 51 lies in the fourth page

Prefix caching: both groups key a page by the same chained key (the full group's). A hit of c cached tokens needs,
beyond the full group's pages, the window group's pages of positions c - W + 1 .. c - 1 (the window of the first
query to run): the longest hit whose window pages are all cached is taken (vLLM's sliding-window lookup).

Without a binding window there is one group and every call is the full group's.
"""

from __future__ import annotations

from typing import Sequence

from jspec.serve.block_manager import Allocation, BlockManager, pages_for


class KVCacheCoordinator:
    """full: the block manager of group 0; window: group 1's (None: no window binds); window_size: W, the widest
    binding window (positions a query reads, itself included)."""

    def __init__(self, full: BlockManager, window: BlockManager | None = None, window_size: int = 0):
        if window is not None and (window.page_size != full.page_size or window_size < 1
                                   or window.enable_prefix_caching != full.enable_prefix_caching):
            raise ValueError(f"window group of page_size {window.page_size} (window_size={window_size}): expected "
                             f"the full group's page_size {full.page_size}, its prefix caching and a window >= 1")
        self.full, self.window, self.window_size = full, window, window_size

    # The full group's figures are the pool's (admission, kv_cache_usage, the prefix-cache counters).
    @property
    def page_size(self) -> int:
        return self.full.page_size

    @property
    def num_pages(self) -> int:
        return self.full.num_pages

    @property
    def enable_prefix_caching(self) -> bool:
        return self.full.enable_prefix_caching

    @property
    def num_free_pages(self) -> int:
        return self.full.num_free_pages

    @property
    def num_used_pages(self) -> int:
        return self.full.num_used_pages

    @property
    def usage(self) -> float:
        return self.full.usage

    @property
    def prefix_queries_tokens(self) -> int:
        return self.full.prefix_queries_tokens

    @property
    def prefix_hits_tokens(self) -> int:
        return self.full.prefix_hits_tokens

    def first_window_page(self, query: int) -> int:
        """The first page a query at position ``query`` (or later) reads in the window group."""
        return max(0, query - self.window_size + 1) // self.page_size

    def allocate(self, tokens: Sequence[int], num_slots: int, *, drop_last_hit: bool = False) -> Allocation | None:
        """``BlockManager.allocate`` over both groups: the full group's pages for ``num_slots`` slots and the
        cached window pages the hit's first query reads (``Allocation.window_pages``; the fresh ones come from
        :meth:`advance`). A hit whose window pages are not all cached is cut to the longest that has them. None,
        changing nothing, when the full group cannot hand out the pages."""
        if self.window is None:
            return self.full.allocate(tokens, num_slots, drop_last_hit=drop_last_hit)
        found = self.full.lookup(tokens) if self.enable_prefix_caching else []
        keys = [self.full.key_of(page) for page in found]
        hit = len(found)
        while hit and not self._window_cached(keys, hit - 1 if drop_last_hit else hit):
            hit -= 1
        allocation = self.full.allocate(tokens, num_slots, drop_last_hit=drop_last_hit, max_hit_pages=hit)
        if allocation is None:
            return None
        table = [0] * pages_for(num_slots, self.page_size)
        cached = allocation.cached_tokens // self.page_size
        for index in range(self.first_window_page(allocation.cached_tokens), cached):
            table[index] = self.window.page_of(keys[index])
            self.window.acquire(table[index])
        return Allocation(allocation.pages, allocation.cached_tokens, table)

    def _window_cached(self, keys: list[bytes], cached: int) -> bool:
        """Whether the window group caches every page a hit of ``cached`` pages reads (its first query's window)."""
        return all(self.window.page_of(keys[index]) is not None
                   for index in range(self.first_window_page(cached * self.page_size), cached))

    def advance(self, pages: Sequence[int], window_pages: list[int] | None, query: int, num_slots: int) -> bool:
        """A request's window group for its next programs (in place): the pages before the window of a query at
        ``query`` are freed (keyed for the prefix cache where the full group keys that page), fresh ones cover
        the window's pages up to ``num_slots`` slots. False where the window group cannot hand them out (the
        out-of-window pages freed all the same: nobody reads them again). pages: the full group's page table."""
        if self.window is None:
            return True
        first = self.first_window_page(query)
        for index in range(min(first, len(window_pages))):
            if window_pages[index]:
                key = self.full.key_of(pages[index]) if index < len(pages) else None
                if key is not None and self.window.key_of(window_pages[index]) is None:
                    self.window.register_key(window_pages[index], key, index)
                self.window.free([window_pages[index]])
                window_pages[index] = 0
        end = pages_for(num_slots, self.page_size)
        window_pages.extend([0] * (end - len(window_pages)))
        wanted = [index for index in range(first, end) if not window_pages[index]]
        if len(wanted) > self.window.num_free_pages:
            return False
        for index in wanted:
            window_pages[index] = self.window.take_fresh()
        return True

    def extend(self, pages: list[int], window_pages: list[int] | None, num_slots: int, query: int) -> bool:
        """Both groups cover ``num_slots`` slots for queries from ``query`` on (``BlockManager.extend``, then
        :meth:`advance`); False where either cannot (the full group's pages taken stay: they are the request's)."""
        return self.full.extend(pages, num_slots) and self.advance(pages, window_pages, query, num_slots)

    def register(self, pages: Sequence[int], window_pages: Sequence[int] | None, tokens: Sequence[int],
                 num_registered: int = 0) -> int:
        """``BlockManager.register`` over both groups: the window pages held at the newly registered indices get
        the full group's keys of the same positions."""
        num_full = self.full.register(pages, tokens, num_registered)
        if self.window is not None and self.enable_prefix_caching:
            for index in range(num_registered, min(num_full, len(window_pages))):
                if window_pages[index]:
                    self.window.register_key(window_pages[index], self.full.key_of(pages[index]), index)
        return num_full

    def flush_cache(self) -> int:
        """Forgets every cached page no request holds, in both groups -> the full group's count."""
        if self.window is not None:
            self.window.flush_cache()
        return self.full.flush_cache()

    def free(self, pages: Sequence[int], window_pages: Sequence[int] | None) -> None:
        """Releases a request's pages in both groups (``BlockManager.free``), tail first."""
        self.full.free(pages)
        if self.window is not None:
            self.window.free([page for page in window_pages if page])
