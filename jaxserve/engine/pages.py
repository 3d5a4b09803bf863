"""Host-side KV page allocator: reference counts and a prefix cache of full pages.

Plain Python (no jax): the device holds the KV pages, this module only decides which page ids hold
which tokens. Page 0 is the NULL PAGE: the padding rows of a bucketed device step point their page
tables at it, so it is written with garbage every step and must never hold a sequence's tokens. It
is never handed out; the usable pages are 1 .. num_pages - 1.

A page is in exactly one of three states:
  used       ref_count > 0, held by one or more sequences (shared pages come from the prefix cache)
  free       ref_count == 0, holds nothing worth keeping
  evictable  ref_count == 0, holds a registered full page: still found by `match_prefix`, reclaimed
             least-recently-used first when the free list runs dry

Prefix cache: a full page is keyed by a chained SHA-256, hash_i = sha256(hash_{i-1} || tokens of page
i), so a page matches only when every token before it matches too (same contents after a different
prefix have different K/V and must not match).
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence as SequenceABC

from jaxserve.engine.request import Sequence

NULL_PAGE = 0
_ROOT_HASH = hashlib.sha256(b"jaxserve prefix cache v1").digest()


def page_hash(parent: bytes | None, token_ids: SequenceABC[int]) -> bytes:
    """Chained key of one full page; `parent` is the previous page's key (None for the first page)."""
    return hashlib.sha256((parent or _ROOT_HASH) + array("q", token_ids).tobytes()).digest()


def salted_root(salt: str | None, lora: str | None = None, long_rope: bool = False) -> bytes | None:
    """The parent of a request's first page under vLLM's cache_salt, its LoRA adapter's load
    (Sequence.lora_key) and, for a LongRoPE model, its long factors (Sequence.long_rope):
    requests share cached pages only with requests that carry the same salt, decode with the same
    adapter and rotate alike, whose K/V the pages hold (None for all: the common cache of the base
    model)."""
    if salt is None and lora is None and not long_rope:
        return None
    root = _ROOT_HASH
    if salt is not None:
        root = hashlib.sha256(root + b"\x00cache_salt\x00" + salt.encode()).digest()
    if lora is not None:
        root = hashlib.sha256(root + b"\x00lora\x00" + lora.encode()).digest()
    if long_rope:
        root = hashlib.sha256(root + b"\x00long_rope\x00").digest()
    return root


class PageAllocator:
    """Reference-counted KV pages with an LRU prefix cache. Not thread-safe: the engine loop owns it."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is the reserved null page), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_pages
        self._free: deque[int] = deque(range(1, num_pages))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._page_hash: dict[int, bytes] = {}  # every registered page (may be a duplicate of another)
        self._hash_to_page: dict[bytes, int] = {}  # the one page `match_prefix` returns for a key
        self.num_queried_tokens = 0  # prefix-cache statistics, in tokens
        self.num_hit_tokens = 0

    # -- sizes --------------------------------------------------------------------------------------

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        """Pages `allocate` can hand out now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_unused_pages(self) -> int:
        """Free pages that hold nothing: allocating up to this many evicts no cached prefix."""
        return len(self._free)

    @property
    def num_evictable_pages(self) -> int:
        return len(self._evictable)

    @property
    def num_cached_pages(self) -> int:
        """Pages findable by `match_prefix`, used or evictable."""
        return len(self._hash_to_page)

    @property
    def num_used_pages(self) -> int:
        return self.num_usable_pages - self.num_free_pages

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def ref_count(self, page: int) -> int:
        return self._ref_counts[page]

    # -- allocation ---------------------------------------------------------------------------------

    def can_allocate(self, num_pages: int, reusing: Iterable[int] = ()) -> bool:
        """Whether `num_pages` new pages fit after also taking the cached pages `reusing` (from
        `peek_prefix`): reviving an evictable page uses up one free slot too."""
        revived = sum(1 for p in reusing if self._ref_counts[p] == 0)
        return num_pages + revived <= self.num_free_pages

    def allocate(self, num_pages: int) -> list[int]:
        """Take pages from the free list first, then evict least-recently-used cached pages."""
        if not self.can_allocate(num_pages):
            raise RuntimeError(f"cannot allocate {num_pages} pages: only {self.num_free_pages} free")
        pages = []
        for _ in range(num_pages):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)
                self._unregister(page)
            self._ref_counts[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: SequenceABC[int]) -> None:
        """Drop one reference to each page. Registered full pages stay findable (evictable)."""
        # Reversed so that a sequence's tail pages become least recently used: the chained keys make
        # a page useless once any page before it is evicted, so evict from the end of a prefix.
        for page in reversed(pages):
            count = self._ref_counts[page] - 1
            if count < 0 or page == NULL_PAGE:
                raise RuntimeError(f"page {page} freed more often than allocated")
            self._ref_counts[page] = count
            if count > 0:
                continue
            if self._is_canonical(page):
                self._evictable[page] = None
            else:
                self._page_hash.pop(page, None)
                self._free.append(page)

    def share(self, pages: SequenceABC[int]) -> None:
        """Take one more reference to pages already held (a beam forked from another shares its pages)."""
        for page in pages:
            if self._ref_counts[page] <= 0 or page == NULL_PAGE:
                raise RuntimeError(f"page {page} is shared but not held")
            self._ref_counts[page] += 1

    # -- prefix cache -------------------------------------------------------------------------------

    def peek_prefix(self, token_ids: SequenceABC[int], root: bytes | None = None) -> tuple[list[int], int]:
        """Cached full pages covering the longest prefix of `token_ids[:-1]`, without taking them.
        `root`: the salted parent of the first page (salted_root), None for the common cache.

        The last token is never covered so that a sequence always computes at least one token and
        gets logits to sample from.
        """
        if not self.enable_prefix_caching:
            return [], 0
        pages: list[int] = []
        parent = root
        size = self.page_size
        for i in range((len(token_ids) - 1) // size):
            key = page_hash(parent, token_ids[i * size : (i + 1) * size])
            page = self._hash_to_page.get(key)
            if page is None:
                break
            pages.append(page)
            parent = key
        return pages, len(pages) * size

    def match_prefix(self, token_ids: SequenceABC[int], count_stats: bool = True,
                     root: bytes | None = None) -> tuple[list[int], int]:
        """Like `peek_prefix`, but takes a reference to each matched page (reviving evictable ones).

        Returns (pages, num_cached_tokens). `count_stats=False` keeps recomputes after preemption
        out of the hit-rate metric.
        """
        pages, num_tokens = self.peek_prefix(token_ids, root)
        for page in pages:
            if self._ref_counts[page] == 0:
                del self._evictable[page]
            self._ref_counts[page] += 1
        if count_stats and self.enable_prefix_caching:
            self.num_queried_tokens += len(token_ids)
            self.num_hit_tokens += num_tokens
        return pages, num_tokens

    def register_full_pages(self, seq: Sequence) -> int:
        """Make the seq's full, computed pages findable by later requests; returns how many were new.

        Call after a step advanced `seq.num_computed_tokens`. Amortized O(1) per call: the seq's
        pages are registered front to back, so only the pages after the last registered one hash.
        """
        if not self.enable_prefix_caching:
            return 0
        num_full = min(seq.num_computed_tokens // self.page_size, len(seq.pages))
        first = num_full
        while first > 0 and seq.pages[first - 1] not in self._page_hash:
            first -= 1
        parent = (self._page_hash[seq.pages[first - 1]] if first
                  else salted_root(seq.params.cache_salt, seq.lora_key, seq.long_rope))
        size = self.page_size
        for i in range(first, num_full):
            page = seq.pages[i]
            key = page_hash(parent, seq.cache_keys(i * size, (i + 1) * size))
            self._page_hash[page] = key
            # Two sequences that computed the same prefix at once both register; the first page
            # stays the one that is found, the other returns to the free list when released.
            self._hash_to_page.setdefault(key, page)
            parent = key
        return num_full - first

    def reset_prefix_cache(self) -> int:
        """Forget every evictable cached page (used pages stay); returns how many were dropped."""
        dropped = len(self._evictable)
        while self._evictable:
            page, _ = self._evictable.popitem(last=False)
            self._unregister(page)
            self._free.append(page)
        return dropped

    def _is_canonical(self, page: int) -> bool:
        key = self._page_hash.get(page)
        return key is not None and self._hash_to_page.get(key) == page

    def _unregister(self, page: int) -> None:
        key = self._page_hash.pop(page, None)
        if key is not None and self._hash_to_page.get(key) == page:
            del self._hash_to_page[key]

    # -- invariants ---------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise RuntimeError if the bookkeeping is inconsistent. Valid at any time."""
        problems = []
        free, evictable = set(self._free), set(self._evictable)
        if len(free) != len(self._free):
            problems.append("the free list holds duplicates")
        if NULL_PAGE in free or NULL_PAGE in evictable or self._ref_counts[NULL_PAGE] != 0:
            problems.append("the null page 0 was handed out")
        if NULL_PAGE in self._page_hash:
            problems.append("the null page 0 is registered in the prefix cache")
        if free & evictable:
            problems.append(f"pages both free and evictable: {sorted(free & evictable)}")
        for page in range(1, self.num_pages):
            count = self._ref_counts[page]
            idle = page in free or page in evictable
            if count < 0:
                problems.append(f"page {page} has ref_count {count}")
            elif count > 0 and idle:
                problems.append(f"page {page} is referenced ({count}) but also free/evictable")
            elif count == 0 and not idle:
                problems.append(f"page {page} is unreferenced but neither free nor evictable (leaked)")
        for page in free:
            if page in self._page_hash:
                problems.append(f"free page {page} is still registered in the prefix cache")
        for page in evictable:
            if not self._is_canonical(page):
                problems.append(f"evictable page {page} cannot be found in the prefix cache")
        for key, page in self._hash_to_page.items():
            if self._page_hash.get(page) != key:
                problems.append(f"prefix-cache entry for page {page} disagrees with the page's key")
        if problems:
            raise RuntimeError("page allocator integrity: " + "; ".join(problems))

    def check_idle(self) -> None:
        """With no sequence alive: free + cached (evictable) pages == all usable pages."""
        self.check_invariants()
        if self.num_free_pages != self.num_usable_pages:
            used = [p for p in range(1, self.num_pages) if self._ref_counts[p] > 0]
            raise RuntimeError(
                f"page allocator integrity when idle: {len(self._free)} free + {len(self._evictable)} cached "
                f"!= {self.num_usable_pages} usable pages; still referenced: {used[:16]}"
                + (" ..." if len(used) > 16 else "")
            )
