"""The host block manager of the paged KV cache against a plain model of who holds which page: refcounts and the
page accounting hold after every operation of a random run; allocate and extend are all-or-nothing; prefix hits
reuse only full registered pages whose whole prefix matches; eviction is least recently freed first."""

from __future__ import annotations

import collections
import random

import pytest

from jspec.serve import block_manager as bm_module
from jspec.serve.block_manager import BlockManager, pages_for


def snapshot(bm: BlockManager):
    """Everything allocate/extend must leave alone when they fail."""
    return ([bm.ref_count(p) for p in range(bm.num_pages)], bm.num_free_pages, bm.num_used_pages,
            bm.prefix_queries_tokens, bm.prefix_hits_tokens)


def check_accounting(bm: BlockManager, live_pages):
    """Refcounts equal the number of live sequences holding each page; free + used == usable."""
    held = collections.Counter(p for pages in live_pages for p in pages)
    assert 0 not in held
    assert [bm.ref_count(p) for p in range(1, bm.num_pages)] == [held[p] for p in range(1, bm.num_pages)]
    assert bm.num_used_pages == len(held)
    assert bm.num_free_pages + bm.num_used_pages == bm.num_pages - 1
    assert bm.usage == pytest.approx(len(held) / (bm.num_pages - 1))


@pytest.mark.parametrize("num_slots,page_size,expected", [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (127, 16, 8),
                                                          (513, 1, 513)])
def test_pages_for(num_slots, page_size, expected):
    assert pages_for(num_slots, page_size) == expected


def test_allocate_free_accounting():
    bm = BlockManager(9, 4)
    a = bm.allocate([], 10)
    b = bm.allocate([], 1)
    assert len(a.pages) == 3 and len(b.pages) == 1 and a.cached_tokens == b.cached_tokens == 0
    assert len(set(a.pages + b.pages)) == 4 and 0 not in a.pages + b.pages
    check_accounting(bm, [a.pages, b.pages])
    assert bm.usage == 0.5 and bm.can_allocate(4) and not bm.can_allocate(5)
    assert bm.extend(a.pages, 13) and len(a.pages) == 4
    assert bm.extend(a.pages, 2) and len(a.pages) == 4  # never shrinks
    bm.free(a.pages)
    check_accounting(bm, [b.pages])
    bm.free(b.pages)
    check_accounting(bm, [])
    assert bm.usage == 0.0


def test_allocate_and_extend_are_all_or_nothing():
    bm = BlockManager(6, 2)  # 5 usable pages
    prefix = [1, 2, 3, 4]
    a = bm.allocate(prefix, 4)
    bm.register(a.pages, prefix)
    bm.free(a.pages)  # 2 evictable cached pages
    b = bm.allocate([], 4)  # 2 of the 3 free pages: 1 free and 2 evictable pages left
    before = snapshot(bm)
    assert bm.allocate(prefix, 12) is None  # 2 evictable hits + 4 fresh pages > 3
    assert snapshot(bm) == before
    assert bm.allocate([], 8) is None
    assert snapshot(bm) == before
    pages = list(b.pages)
    assert not bm.extend(pages, 11)
    assert pages == b.pages and snapshot(bm) == before
    assert bm.extend(pages, 10) and len(pages) == 5 and bm.num_free_pages == 0
    assert bm.allocate([], 1) is None and bm.allocate([], 0).pages == []


def test_prefix_hit_shares_full_pages_only():
    bm = BlockManager(16, 4)
    prompt = list(range(10, 20))  # 10 tokens: 2 full pages and a partial one
    a = bm.allocate(prompt[:-1], 12)
    assert a.cached_tokens == 0 and bm.prefix_queries_tokens == 9 and bm.prefix_hits_tokens == 0
    assert bm.register(a.pages, prompt) == 2
    b_tokens = prompt + [20, 21]  # the same 10 tokens, then 2 more: a full third page, but A never filled it
    b = bm.allocate(b_tokens, 16)
    assert b.cached_tokens == 8 and b.pages[:2] == a.pages[:2] and b.pages[2] != a.pages[2]
    assert [bm.ref_count(p) for p in b.pages] == [2, 2, 1, 1]
    assert bm.prefix_queries_tokens == 9 + 12 and bm.prefix_hits_tokens == 8
    check_accounting(bm, [a.pages, b.pages])
    bm.free(a.pages)
    assert [bm.ref_count(p) for p in b.pages] == [1, 1, 1, 1]
    check_accounting(bm, [b.pages])


def test_dropping_the_last_hit_recomputes_that_page():
    """EAGLE's rule: of the pages found, the last is handed out fresh (its K/V computed again); no hit, nothing."""
    bm = BlockManager(16, 4)
    prompt = list(range(10, 22))  # 3 full pages
    a = bm.allocate(prompt[:-1], 12)
    assert bm.register(a.pages, prompt) == 3
    b = bm.allocate(prompt + [30], 16, drop_last_hit=True)
    assert b.cached_tokens == 8 and b.pages[:2] == a.pages[:2] and a.pages[2] not in b.pages
    assert bm.prefix_hits_tokens == 8
    c = bm.allocate([1, 2, 3, 4, 5], 8, drop_last_hit=True)
    assert c.cached_tokens == 0
    check_accounting(bm, [a.pages, b.pages, c.pages])


def test_registering_as_the_sequence_grows_hashes_each_page_once(monkeypatch):
    calls, real = [], bm_module.chain_key
    monkeypatch.setattr(bm_module, "chain_key", lambda parent, toks: calls.append(1) or real(parent, toks))
    bm = BlockManager(16, 3)
    tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    a = bm.allocate([], 12)
    registered = 0
    for n in range(len(tokens) + 1):
        registered = bm.register(a.pages, tokens[:n], registered)
        assert registered == n // 3
    assert len(calls) == 3
    calls.clear()
    b = bm.allocate(tokens, 12)
    assert b.cached_tokens == 9 and b.pages[:3] == a.pages[:3] and len(calls) == 3
    assert bm.register(b.pages, tokens, b.cached_tokens // 3) == 3 and len(calls) == 3


def test_a_miss_stops_the_chain():
    bm = BlockManager(16, 4)
    a_tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    a = bm.allocate(a_tokens, 12)
    bm.register(a.pages, a_tokens)
    b = bm.allocate([1, 2, 3, 4, 0, 0, 0, 0, 9, 10, 11, 12], 12)  # third page equal, but after a miss
    assert b.cached_tokens == 4 and b.pages[0] == a.pages[0] and set(b.pages[1:]).isdisjoint(a.pages)
    c = bm.allocate([0, 0, 0, 0, 5, 6, 7, 8], 8)  # A's second page content after a different first page
    assert c.cached_tokens == 0 and set(c.pages).isdisjoint(a.pages)
    bm.register(b.pages, [1, 2, 3, 4, 0, 0, 0, 0, 9, 10, 11, 12])
    d = bm.allocate([1, 2, 3, 4, 0, 0, 0, 0, 9, 10, 11, 12], 13)
    assert d.cached_tokens == 12 and d.pages[:3] == b.pages and bm.ref_count(b.pages[0]) == 3


def test_lru_eviction_least_recently_freed_first_and_a_hit_revives():
    bm = BlockManager(5, 2)  # 4 usable pages
    x_tokens, y_tokens = [1, 2, 3, 4], [5, 6, 7, 8]
    x = bm.allocate(x_tokens, 4)
    y = bm.allocate(y_tokens, 4)
    bm.register(x.pages, x_tokens)
    bm.register(y.pages, y_tokens)
    bm.free(x.pages)
    bm.free(y.pages)  # LRU: x tail, x head, y tail, y head
    assert bm.num_free_pages == 4 and bm.num_used_pages == 0
    revived = bm.allocate(x_tokens, 4)  # a hit takes x's pages out of the LRU
    assert revived.pages == x.pages and revived.cached_tokens == 4 and bm.num_free_pages == 2
    fresh = bm.allocate([], 2)
    assert fresh.pages == [y.pages[1]]  # the least recently freed cached page not revived
    head = bm.allocate(y_tokens[:2], 2)  # y's head outlived its tail
    assert head.pages == [y.pages[0]] and head.cached_tokens == 2 and bm.num_free_pages == 0
    check_accounting(bm, [revived.pages, fresh.pages, head.pages])


def test_eviction_order_across_sequences():
    bm = BlockManager(5, 2)
    x_tokens, y_tokens = [1, 2, 3, 4], [5, 6, 7, 8]
    x, y = bm.allocate(x_tokens, 4), bm.allocate(y_tokens, 4)
    bm.register(x.pages, x_tokens)
    bm.register(y.pages, y_tokens)
    bm.free(x.pages)
    bm.free(y.pages)
    taken = [bm.allocate([], 1).pages[0] for _ in range(4)]
    assert taken == [x.pages[1], x.pages[0], y.pages[1], y.pages[0]]
    check_accounting(bm, [[p] for p in taken])
    bm.free(taken)
    assert bm.allocate(x_tokens, 4).cached_tokens == 0  # evicted keys are forgotten


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    tokens = list(range(12))
    a = bm.allocate(tokens, 13)
    assert bm.register(a.pages, tokens) == 3
    b = bm.allocate(tokens, 13)
    assert b.cached_tokens == 0 and set(a.pages).isdisjoint(b.pages)
    assert bm.prefix_queries_tokens == 0 and bm.prefix_hits_tokens == 0
    bm.free(a.pages)
    bm.free(b.pages)
    assert bm.allocate(tokens, 13).cached_tokens == 0


def test_bad_frees_raise_and_change_nothing():
    bm = BlockManager(8, 4)
    a = bm.allocate([], 8)
    with pytest.raises(ValueError, match="page 0"):
        bm.free([0])
    with pytest.raises(ValueError, match=f"page {a.pages[0]} x2"):
        bm.free([a.pages[1], a.pages[0], a.pages[0]])
    with pytest.raises(ValueError, match="page 8"):
        bm.free([8])
    check_accounting(bm, [a.pages])
    bm.free(a.pages)
    with pytest.raises(ValueError, match=f"page {a.pages[0]} x1"):
        bm.free(a.pages)
    check_accounting(bm, [])


@pytest.mark.parametrize("kwargs,bad", [
    (dict(num_pages=1, page_size=4), "num_pages=1"), (dict(num_pages=-3, page_size=4), "num_pages=-3"),
    (dict(num_pages=8, page_size=0), "page_size=0"), (dict(num_pages=8.0, page_size=4), "num_pages=8.0"),
    (dict(num_pages=8, page_size="4"), "page_size='4'"), (dict(num_pages=8, page_size=True), "page_size=True"),
    (dict(num_pages=8, page_size=4, enable_prefix_caching=1), "enable_prefix_caching=1")])
def test_bad_constructor_arguments(kwargs, bad):
    with pytest.raises(ValueError, match=bad):
        BlockManager(**kwargs)


def test_bad_call_arguments():
    bm = BlockManager(8, 4)
    with pytest.raises(ValueError, match="num_slots=3: expected at least len"):
        bm.allocate([1, 2, 3, 4], 3)
    with pytest.raises(ValueError, match="num_slots=-1"):
        bm.allocate([], -1)
    a = bm.allocate([], 8)
    with pytest.raises(ValueError, match="len.tokens.=9"):
        bm.register(a.pages, list(range(9)))
    with pytest.raises(ValueError, match="num_registered=3"):
        bm.register(a.pages, list(range(8)), 3)
    with pytest.raises(ValueError, match="num_registered=1"):
        bm.register(a.pages, list(range(8)), 1)  # page 0 of the sequence was never registered
    bm.register(a.pages, list(range(4)))
    with pytest.raises(ValueError, match="registered with other tokens"):
        bm.register(a.pages, [9, 9, 9, 9])


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("seed,page_size", [(0, 1), (1, 3), (2, 4), (3, 2)])
def test_random_operations_match_the_model(seed, page_size, prefix_caching):
    rng = random.Random(seed)
    bm = BlockManager(13, page_size, enable_prefix_caching=prefix_caching)
    live = {}  # sequence id -> [pages, committed tokens, pages registered]
    prefix_of_page = {}  # page -> the committed tokens from position 0 to the end of that page, when registered
    queries = hits = failures = 0
    for step in range(600):
        op = rng.choice(["allocate", "allocate", "extend", "register", "register", "free"] if live else ["allocate"])
        held = collections.Counter(p for pages, _, _ in live.values() for p in pages)
        before = snapshot(bm)
        if op == "allocate":
            tokens = [rng.randint(0, 1) for _ in range(rng.randint(0, 3 * page_size + 1))]
            num_slots = len(tokens) + rng.randint(0, page_size + 1)
            result = bm.allocate(tokens, num_slots)
            if result is None:
                assert snapshot(bm) == before and pages_for(num_slots, page_size) > before[1]
                failures += 1
            else:
                k = result.cached_tokens // page_size
                assert len(result.pages) == pages_for(num_slots, page_size) and 0 not in result.pages
                assert len(set(result.pages)) == len(result.pages) and (prefix_caching or k == 0)
                for i, page in enumerate(result.pages[:k]):  # a hit holds exactly this prefix's KV
                    assert prefix_of_page[page] == tuple(tokens[:(i + 1) * page_size])
                for page in result.pages[k:]:
                    assert held[page] == 0
                    prefix_of_page.pop(page, None)
                if prefix_caching:
                    queries, hits = queries + len(tokens), hits + result.cached_tokens
                live[step] = [result.pages, tokens, k]
        else:
            seq_id = rng.choice(sorted(live))
            pages, tokens, registered = seq = live[seq_id]
            if op == "extend":
                old = list(pages)
                if bm.extend(pages, len(pages) * page_size + rng.randint(0, 2 * page_size)):
                    assert pages[:len(old)] == old and all(held[p] == 0 for p in pages[len(old):])
                    for page in pages[len(old):]:
                        prefix_of_page.pop(page, None)
                else:
                    assert pages == old and snapshot(bm) == before
                    failures += 1
            elif op == "register":
                tokens.extend(rng.randint(0, 1) for _ in range(rng.randint(0, len(pages) * page_size - len(tokens))))
                seq[2] = bm.register(pages, tokens, registered)
                assert seq[2] == len(tokens) // page_size
                for i in range(seq[2]):
                    assert prefix_of_page.setdefault(pages[i], tuple(tokens[:(i + 1) * page_size])) == \
                        tuple(tokens[:(i + 1) * page_size])
            else:
                bm.free(pages)
                del live[seq_id]
        check_accounting(bm, [pages for pages, _, _ in live.values()])
        assert (bm.prefix_queries_tokens, bm.prefix_hits_tokens) == (queries, hits)
    assert failures > 0 and (hits > 0) == prefix_caching
