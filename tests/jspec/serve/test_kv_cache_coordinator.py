"""The KV cache coordinator's window group (vLLM's hybrid allocator): a request holds only the window pages its next
queries read, out-of-window pages go back to the pool (cached where keyed), and a prefix hit needs the window
pages of its first query's window."""

from __future__ import annotations

import pytest

from jspec.serve.block_manager import BlockManager
from jspec.serve.kv_cache_coordinator import KVCacheCoordinator

PAGE, WINDOW = 4, 6


def coordinator(full_pages: int = 40, window_pages: int = 12, prefix_caching: bool = True) -> KVCacheCoordinator:
    return KVCacheCoordinator(BlockManager(full_pages, PAGE, enable_prefix_caching=prefix_caching),
                              BlockManager(window_pages, PAGE, enable_prefix_caching=prefix_caching), WINDOW)


def held_indices(window_pages: list[int]) -> list[int]:
    return [index for index, page in enumerate(window_pages) if page]


def test_a_request_holds_only_the_window_its_next_queries_read():
    kv = coordinator()
    allocation = kv.allocate([], 12)
    pages, window = allocation.pages, allocation.window_pages
    assert window == [0, 0, 0] and len(pages) == 3
    assert kv.advance(pages, window, 0, 12) and held_indices(window) == [0, 1, 2]
    for query in range(12, 80, 5):  # decoding on: each step needs positions query - WINDOW + 1 .. query + 4
        assert kv.extend(pages, window, query + 5, query)
        first = max(0, query - WINDOW + 1) // PAGE
        assert held_indices(window) == list(range(first, -(-(query + 5) // PAGE))), query
        assert kv.window.num_used_pages == len(held_indices(window)) <= -(-(WINDOW - 1 + 5) // PAGE) + 1
    assert kv.full.num_used_pages == len(pages) == 21  # the full group keeps every position: 82 slots
    kv.free(pages, window)
    assert kv.full.num_used_pages == kv.window.num_used_pages == 0
    assert kv.window.num_free_pages == 11 and kv.num_free_pages == 39


def test_a_window_group_too_small_refuses_without_losing_pages():
    kv = coordinator(window_pages=4)  # 3 usable window pages
    allocation = kv.allocate([], 8)
    assert kv.advance(allocation.pages, allocation.window_pages, 0, 8)
    assert not kv.advance(allocation.pages, allocation.window_pages, 1, 20)  # 4 pages of window, 3 in the pool
    assert kv.window.num_used_pages == 2  # nothing new taken; pages 0 and 1 still in its window
    assert kv.advance(allocation.pages, allocation.window_pages, 16, 20)  # pages 0, 1 out of the window: room for 3
    assert held_indices(allocation.window_pages) == [2, 3, 4]
    kv.free(allocation.pages, allocation.window_pages)
    assert kv.window.num_used_pages == 0


def run_request(kv: KVCacheCoordinator, tokens: list[int], *, register_before_decoding: bool) -> None:
    """A request over ``tokens`` (the prompt its first 12): prefilled, decoded to the end, registered, freed."""
    allocation = kv.allocate(tokens[:11], len(tokens) + 4)
    pages, window = allocation.pages, allocation.window_pages
    assert kv.advance(pages, window, 11, len(tokens) + 4)
    registered = kv.register(pages, window, tokens[:12]) if register_before_decoding else 0
    for query in range(12, len(tokens)):
        assert kv.extend(pages, window, len(tokens) + 4, query)
    kv.register(pages, window, tokens, registered)
    kv.free(pages, window)


@pytest.mark.parametrize("register_before_decoding", [True, False])
def test_a_prefix_hit_needs_the_pages_of_its_first_querys_window(register_before_decoding):
    kv = coordinator()
    tokens = list(range(100, 140))
    run_request(kv, tokens, register_before_decoding=register_before_decoding)
    # the whole sequence again: its last window's pages were kept, keyed, when it ended
    whole = kv.allocate(tokens, 48)
    assert whole.cached_tokens == 40
    first = (40 - WINDOW + 1) // PAGE
    assert held_indices(whole.window_pages) == list(range(first, 10))
    kv.free(whole.pages, whole.window_pages)
    # the prompt's 12 tokens and another continuation: a hit at 12 needs window pages 1 and 2, cached only where
    # the prompt's pages were keyed before decoding let them go
    other = kv.allocate(tokens[:12] + [7] * 8, 24)
    assert other.cached_tokens == (12 if register_before_decoding else 0)
    if register_before_decoding:
        assert held_indices(other.window_pages) == [1, 2]
    kv.free(other.pages, other.window_pages)
    assert kv.full.num_used_pages == kv.window.num_used_pages == 0


def test_a_hit_is_cut_to_the_longest_whose_window_is_cached():
    kv = coordinator()
    tokens = list(range(200, 224))
    allocation = kv.allocate([], 24)
    pages, window = allocation.pages, allocation.window_pages
    assert kv.advance(pages, window, 0, 24)
    kv.register(pages, window, tokens)
    kv.window._page_of_key.pop(kv.window.key_of(window[5]))  # page 5's window copy forgotten (as if evicted)
    kv.free(pages, window)
    again = kv.allocate(tokens + [1], 28)
    assert again.cached_tokens == 20  # a hit at 24 reads positions 19..23 (pages 4, 5); at 20, 15..19 (3, 4)
    assert held_indices(again.window_pages) == [3, 4]
    kv.free(again.pages, again.window_pages)


def test_without_a_window_it_is_the_block_manager():
    kv = KVCacheCoordinator(BlockManager(10, PAGE))
    allocation = kv.allocate([1, 2, 3, 4, 5], 8)
    assert allocation.window_pages is None and kv.advance(allocation.pages, None, 0, 100)
    assert kv.extend(allocation.pages, None, 12, 8) and len(allocation.pages) == 3
    kv.register(allocation.pages, None, [1, 2, 3, 4, 5])
    kv.free(allocation.pages, None)
    assert kv.num_free_pages == 9


def test_groups_of_other_page_sizes_are_refused():
    with pytest.raises(ValueError, match="page_size"):
        KVCacheCoordinator(BlockManager(10, 4), BlockManager(10, 8), 6)
