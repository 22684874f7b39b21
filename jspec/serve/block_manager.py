"""BlockManager: the host side of the paged KV cache (free list, reference counts, chained prefix keys, LRU eviction).

The device holds one pool of ``num_pages`` pages of ``page_size`` token slots each. A sequence's page table lists
its pages; position ``p`` lives in ``pages[p // page_size]`` at offset ``p % page_size``. Page 0 is the null page:
never handed out, so padded page-table entries point at it instead of at -1::

    pool    | 0 null | 1 | 2 | 3 | 4 | 5 | ... | num_pages-1 |
    seq A   pages [3, 1, 4]   positions 0..3 in page 3, 4..7 in page 1, 8..  in page 4   (page_size 4)
    seq B   pages [3, 5]      same first 4 committed tokens as A: page 3 shared, refcount 2

Every usable page (1 .. num_pages-1) is exactly one of

* free: refcount 0 and no key, in ``_free``;
* in use: refcount > 0 (held by that many sequences), keyed or not;
* evictable: refcount 0 and keyed, in ``_evictable`` (least recently freed first). Its KV stays valid until it is
  evicted, so a later sequence with the same prefix can reuse it.

So ``num_free_pages + num_used_pages == num_pages - 1`` always; ``num_free_pages`` counts free and evictable pages,
since both can be handed out now. Fresh pages come from the free list first, then by evicting the least recently
freed evictable page (its key forgotten).

Prefix caching (vLLM's scheme): a full page of committed tokens gets the chained key
``key(i) = blake2b(key(i - 1) || int64 bytes of tokens[i * page_size:(i + 1) * page_size])``, ``key(-1) = ROOT``.
A key thus names the page's tokens and every token before them: one page content after two different prefixes
gets two keys. ``_page_of_key`` maps a key to the one page whose KV it names; ``_digest`` records, for each
registered page, the key of its content. A page *carries* its key when ``_page_of_key[_digest[page]] == page``;
when another page already carried that key, the first mapping is kept and this page's digest only chains its
sequence's next page. Only pages the caller registers as committed get keys, never pages holding draft tokens.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import hashlib
import numbers
from typing import Sequence

ROOT = bytes(32)  # the parent key of a sequence's first page


def pages_for(num_slots: int, page_size: int) -> int:
    """Pages needed to hold ``num_slots`` token slots: ceil(num_slots / page_size)."""
    return -(-num_slots // page_size)


def chain_key(parent: bytes, page_tokens: Sequence[int]) -> bytes:
    """Key of a full page: blake2b (32 bytes) over its parent page's key and its token ids as int64."""
    return hashlib.blake2b(parent + array.array("q", page_tokens).tobytes(), digest_size=32).digest()


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name}={value!r}: expected an int >= {minimum}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class Allocation:
    """A new sequence's page table (``pages``, owned by the caller, grown in place by ``extend``) and how many of
    its leading tokens already have KV in the reused cached pages (``cached_tokens``, a multiple of page_size);
    window_pages: where a sliding window binds, its page table in the window group
    (``jspec.serve.kv_cache_coordinator``: 0 where it holds no page), else None."""
    pages: list[int]
    cached_tokens: int
    window_pages: list[int] | None = None


class BlockManager:
    """Page pool of ``num_pages`` pages of ``page_size`` token slots; page 0 is the null page (see module doc)."""

    def __init__(self, num_pages: int, page_size: int, *, enable_prefix_caching: bool = True):
        self.num_pages = _check_int("num_pages", num_pages, 2)
        self.page_size = _check_int("page_size", page_size, 1)
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching={enable_prefix_caching!r}: expected a bool")
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * self.num_pages  # refcount per page; page 0 stays 0
        self._num_used = 0  # pages with refcount > 0
        self._free = collections.deque(range(1, self.num_pages))
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._digest: dict[int, bytes] = {}
        self._page_of_key: dict[bytes, int] = {}
        self._queries_tokens = 0
        self._hits_tokens = 0

    @property
    def num_free_pages(self) -> int:
        """Pages that can be handed out now: the free list and the evictable cached pages."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        """Pages held by at least one sequence (refcount > 0)."""
        return self._num_used

    @property
    def usage(self) -> float:
        """Fraction of usable pages in use, in [0, 1] (the kv_cache_usage_perc metric)."""
        return self._num_used / (self.num_pages - 1)

    @property
    def prefix_queries_tokens(self) -> int:
        """Tokens offered for reuse by successful ``allocate`` calls so far (0 with prefix caching off)."""
        return self._queries_tokens

    @property
    def prefix_hits_tokens(self) -> int:
        """Tokens found in cached pages by successful ``allocate`` calls so far."""
        return self._hits_tokens

    def can_allocate(self, num_pages: int) -> bool:
        """Whether ``num_pages`` fresh pages can be handed out now."""
        return num_pages <= self.num_free_pages

    def ref_count(self, page: int) -> int:
        """Sequences holding ``page`` now."""
        return self._ref[page]

    def allocate(self, tokens: Sequence[int], num_slots: int, *, drop_last_hit: bool = False,
                 max_hit_pages: int | None = None) -> Allocation | None:
        """Pages for a new sequence of ``num_slots`` token slots, reusing cached pages for a prefix of ``tokens``.

        tokens: the token ids whose KV may be reused, positions 0..len(tokens)-1. Pass the prompt without its last
        token: the last prompt token must be run again to get the logits of the first new token. With prefix
        caching on, the full pages of ``tokens`` are looked up by chained key and reused in order up to the first
        miss; the rest of the ``pages_for(num_slots, page_size)`` pages are fresh. drop_last_hit: the last page
        found is not reused but computed again (vLLM's rule for EAGLE: a drafter whose slot p pairs the token at
        p + 1 wrote the last slot of a page with a next token its key does not cover; the next page's hit vouches
        for that token in the pages before it); max_hit_pages: at most this many pages found are looked at (before
        drop_last_hit). The caller computes KV from position ``cached_tokens`` on. Counts
        ``prefix_queries_tokens += len(tokens)`` and ``prefix_hits_tokens += cached_tokens``.

        Returns None, changing nothing (no refcount, no counter), when too few pages can be handed out.
        """
        num_slots = _check_int("num_slots", num_slots, 0)
        if num_slots < len(tokens):
            raise ValueError(f"num_slots={num_slots}: expected at least len(tokens)={len(tokens)}")
        cached = self.lookup(tokens) if self.enable_prefix_caching else []
        if max_hit_pages is not None:
            cached = cached[:max_hit_pages]
        if drop_last_hit:
            cached = cached[:-1]
        revived = sum(self._ref[page] == 0 for page in cached)  # evictable hits leave the pool of free pages too
        num_fresh = pages_for(num_slots, self.page_size) - len(cached)
        if num_fresh > self.num_free_pages - revived:
            return None
        for page in cached:
            self.acquire(page)
        pages = cached + [self.take_fresh() for _ in range(num_fresh)]
        cached_tokens = len(cached) * self.page_size
        if self.enable_prefix_caching:
            self._queries_tokens += len(tokens)
            self._hits_tokens += cached_tokens
        return Allocation(pages, cached_tokens)

    def extend(self, pages: list[int], num_slots: int) -> bool:
        """Appends fresh pages to ``pages`` (in place) so it covers ``num_slots`` token slots; False, changing
        nothing, when too few pages can be handed out. Never shrinks ``pages``."""
        num_fresh = pages_for(_check_int("num_slots", num_slots, 0), self.page_size) - len(pages)
        if num_fresh > self.num_free_pages:
            return False
        pages.extend(self.take_fresh() for _ in range(num_fresh))
        return True

    def register(self, pages: Sequence[int], tokens: Sequence[int], num_registered: int = 0) -> int:
        """Records the chained keys of the full pages of a sequence's committed ``tokens`` (position = index).

        pages: the sequence's page table. tokens: its committed token ids, never draft tokens. num_registered: the
        value this call returned last time for this sequence (0 at first, or ``cached_tokens // page_size`` right
        after ``allocate``); pages before it are skipped, so calling this as the sequence grows hashes each page
        once. Returns ``len(tokens) // page_size``, the number of leading pages now registered. A key already
        carried by another page keeps that page. With prefix caching off, records nothing.
        """
        num_full = len(tokens) // self.page_size
        if len(tokens) > len(pages) * self.page_size:
            raise ValueError(f"len(tokens)={len(tokens)}: expected at most len(pages) * page_size = "
                             f"{len(pages) * self.page_size}")
        if not 0 <= num_registered <= num_full:
            raise ValueError(f"num_registered={num_registered}: expected 0..{num_full} (len(tokens) // page_size)")
        if not self.enable_prefix_caching:
            return num_full
        key = ROOT
        if num_registered:
            key = self._digest.get(pages[num_registered - 1])
            if key is None:
                raise ValueError(f"num_registered={num_registered}, but page {pages[num_registered - 1]} at index "
                                 f"{num_registered - 1} was never registered: expected what register returned")
        for i in range(num_registered, num_full):
            page = pages[i]
            if self._ref[page] == 0:
                raise ValueError(f"page {page} at index {i} is not in use: expected a page of a live sequence")
            key = chain_key(key, tokens[i * self.page_size:(i + 1) * self.page_size])
            self.register_key(page, key, i)
        return num_full

    def register_key(self, page: int, key: bytes, index: int = 0) -> None:
        """Records that ``page`` (in use) holds the tokens ``key`` names (:func:`chain_key`); a key already carried
        by another page keeps that page. index: the page's place in its sequence (for the error)."""
        if self._digest.setdefault(page, key) != key:
            raise ValueError(f"page {page} at index {index} was registered with other tokens: expected committed "
                             f"tokens, which never change")
        self._page_of_key.setdefault(key, page)

    def key_of(self, page: int) -> bytes | None:
        """The key a registered page's content has (None: never registered since it was last handed out)."""
        return self._digest.get(page)

    def page_of(self, key: bytes) -> int | None:
        """The cached page carrying ``key`` (in use or evictable), None if none does."""
        return self._page_of_key.get(key)

    def free(self, pages: Sequence[int]) -> None:
        """Releases a sequence's pages, tail first (so its tail is evicted before its head). A page no sequence
        holds any more becomes evictable if it carries a key, else free. Raises, changing nothing, when a page is
        the null page or is freed more times than it is held."""
        for page, count in collections.Counter(pages).items():
            held = self._ref[page] if isinstance(page, numbers.Integral) and 1 <= page < self.num_pages else 0
            if held < count:
                raise ValueError(f"free of page {page!r} x{count}: expected a page in 1..{self.num_pages - 1} "
                                 f"held at least that often (held {held})")
        for page in reversed(pages):
            self._ref[page] -= 1
            if self._ref[page]:
                continue
            self._num_used -= 1
            key = self._digest.get(page)
            if key is not None and self._page_of_key.get(key) == page:
                self._evictable[page] = None
            else:
                self._digest.pop(page, None)
                self._free.append(page)

    def flush_cache(self) -> int:
        """Forgets every cached page no sequence holds (they become free, their keys gone) -> how many; the pages
        of running sequences keep theirs (SGLang's /flush_cache)."""
        flushed = len(self._evictable)
        for page in self._evictable:
            del self._page_of_key[self._digest.pop(page)]
            self._free.append(page)
        self._evictable.clear()
        return flushed

    def lookup(self, tokens: Sequence[int]) -> list[int]:
        """Cached pages holding the leading full pages of ``tokens``, up to the first miss."""
        pages, key = [], ROOT
        for start in range(0, len(tokens) - self.page_size + 1, self.page_size):
            key = chain_key(key, tokens[start:start + self.page_size])
            page = self._page_of_key.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def acquire(self, page: int) -> None:
        """One more sequence holds cached ``page`` (an evictable one leaves the evictable pages)."""
        if self._ref[page] == 0:
            del self._evictable[page]
            self._num_used += 1
        self._ref[page] += 1

    def take_fresh(self) -> int:
        """A page with refcount 1 and no key: from the free list, else the least recently freed evictable page."""
        if self._free:
            page = self._free.popleft()
        else:
            page, _ = self._evictable.popitem(last=False)
            del self._page_of_key[self._digest.pop(page)]
        self._ref[page] = 1
        self._num_used += 1
        return page
