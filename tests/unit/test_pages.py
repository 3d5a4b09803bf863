"""PageAllocator: reference counts, the null page, the prefix cache (chained keys, LRU eviction)."""

import pytest

from jaxserve.engine.pages import NULL_PAGE, PageAllocator, page_hash
from jaxserve.engine.request import SamplingParams, Sequence

PS = 4  # tokens per page


def computed_seq(alloc: PageAllocator, tokens: list[int]) -> Sequence:
    """A sequence whose tokens all have K/V in freshly allocated pages, registered in the cache."""
    seq = Sequence("r", list(tokens), len(tokens), SamplingParams(), len(tokens) + 1)
    seq.pages = alloc.allocate(alloc.pages_for(len(tokens)))
    seq.num_computed_tokens = len(tokens)
    alloc.register_full_pages(seq)
    return seq


def test_null_page_is_never_handed_out():
    alloc = PageAllocator(num_pages=5, page_size=PS)
    pages = alloc.allocate(4)
    assert sorted(pages) == [1, 2, 3, 4] and NULL_PAGE not in pages
    assert alloc.num_usable_pages == 4 and alloc.num_free_pages == 0 and alloc.num_used_pages == 4
    assert not alloc.can_allocate(1)
    with pytest.raises(RuntimeError, match="cannot allocate 1 pages"):
        alloc.allocate(1)
    alloc.free(pages)
    alloc.check_idle()
    with pytest.raises(ValueError, match="null page"):
        PageAllocator(num_pages=1, page_size=PS)


def test_reference_counts():
    alloc = PageAllocator(num_pages=8, page_size=PS)
    a, b = alloc.allocate(2)
    assert alloc.ref_count(a) == alloc.ref_count(b) == 1
    alloc.free([a])
    assert alloc.ref_count(a) == 0 and alloc.num_free_pages == 6
    with pytest.raises(RuntimeError, match="freed more often"):
        alloc.free([a])
    with pytest.raises(RuntimeError, match="freed more often"):
        alloc.free([NULL_PAGE])
    alloc.free([b])
    alloc.check_idle()


def test_match_shares_pages_and_counts_hits():
    alloc = PageAllocator(num_pages=16, page_size=PS)
    tokens = list(range(10))  # two full pages + 2 tokens
    seq = computed_seq(alloc, tokens)
    assert alloc.num_cached_pages == 2
    pages, num_tokens = alloc.match_prefix(tokens + [99])
    assert pages == seq.pages[:2] and num_tokens == 8
    assert [alloc.ref_count(p) for p in pages] == [2, 2]
    assert alloc.num_queried_tokens == 11 and alloc.num_hit_tokens == 8
    assert alloc.prefix_cache_hit_rate == pytest.approx(8 / 11)
    alloc.free(pages)
    alloc.free(seq.pages)
    alloc.check_idle()
    assert alloc.num_evictable_pages == 2  # the two full pages stay cached; the partial one is free


def test_match_never_covers_the_last_token():
    alloc = PageAllocator(num_pages=16, page_size=PS)
    tokens = list(range(8))  # exactly two pages
    seq = computed_seq(alloc, tokens)
    pages, num_tokens = alloc.match_prefix(tokens)
    assert pages == seq.pages[:1] and num_tokens == 4  # the second page holds the last token
    assert alloc.peek_prefix(tokens[:4]) == ([], 0)
    assert alloc.peek_prefix(tokens[:5]) == (seq.pages[:1], 4)


def test_same_page_after_a_different_prefix_does_not_match():
    alloc = PageAllocator(num_pages=16, page_size=PS)
    computed_seq(alloc, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    # Second page's contents are identical, the first page differs: its K/V differ, so no hit.
    assert alloc.peek_prefix([9, 9, 9, 9, 5, 6, 7, 8, 0]) == ([], 0)
    assert page_hash(None, [5, 6, 7, 8]) != page_hash(page_hash(None, [1, 2, 3, 4]), [5, 6, 7, 8])
    pages, num_tokens = alloc.peek_prefix([1, 2, 3, 4, 5, 6, 7, 9, 0])
    assert num_tokens == 4 and len(pages) == 1


def test_match_revives_evictable_pages():
    alloc = PageAllocator(num_pages=4, page_size=PS)
    seq = computed_seq(alloc, list(range(9)))  # 3 pages: two full (cached), one partial
    alloc.free(seq.pages)
    assert alloc.num_free_pages == 3 and alloc.num_evictable_pages == 2
    assert alloc.can_allocate(1, reusing=seq.pages[:2]) and not alloc.can_allocate(2, reusing=seq.pages[:2])
    pages, num_tokens = alloc.match_prefix(list(range(9)))
    assert pages == seq.pages[:2] and num_tokens == 8
    assert alloc.num_evictable_pages == 0 and alloc.num_free_pages == 1
    assert [alloc.ref_count(p) for p in pages] == [1, 1]
    alloc.check_invariants()
    alloc.free(pages)
    alloc.check_idle()


def test_free_list_is_used_before_evicting_cached_pages():
    alloc = PageAllocator(num_pages=6, page_size=PS)
    seq = computed_seq(alloc, list(range(8)))  # 2 cached pages
    alloc.free(seq.pages)
    fresh = alloc.allocate(3)
    assert not set(fresh) & set(seq.pages)
    assert alloc.peek_prefix(list(range(9)))[1] == 8  # both cached pages survived
    (evicted,) = alloc.allocate(1)
    assert evicted in seq.pages and alloc.num_cached_pages == 1


def test_eviction_is_least_recently_used_and_tail_first():
    alloc = PageAllocator(num_pages=5, page_size=PS)
    a = computed_seq(alloc, [1] * 8)  # pages a0 a1
    b = computed_seq(alloc, [2] * 8)  # pages b0 b1
    alloc.free(a.pages)
    alloc.free(b.pages)
    # Touch a: matching then releasing makes its pages most recently used.
    pages, _ = alloc.match_prefix([1] * 9)
    alloc.free(pages)
    # b is older; within b the tail page goes first because it is useless without its prefix.
    assert alloc.allocate(1) == [b.pages[1]]
    assert alloc.peek_prefix([2] * 9)[1] == 4
    assert alloc.allocate(1) == [b.pages[0]]
    assert alloc.allocate(1) == [a.pages[1]]
    assert alloc.peek_prefix([1] * 9)[1] == 4
    alloc.check_invariants()


def test_register_is_incremental_and_only_covers_computed_full_pages():
    alloc = PageAllocator(num_pages=16, page_size=PS)
    seq = Sequence("r", list(range(12)), 12, SamplingParams(), 20)
    seq.pages = alloc.allocate(3)
    seq.num_computed_tokens = 3
    assert alloc.register_full_pages(seq) == 0
    seq.num_computed_tokens = 9
    assert alloc.register_full_pages(seq) == 2
    assert alloc.register_full_pages(seq) == 0
    seq.num_computed_tokens = 12
    assert alloc.register_full_pages(seq) == 1
    assert alloc.peek_prefix(list(range(12)) + [0]) == (seq.pages, 12)


def test_duplicate_pages_computed_concurrently_stay_consistent():
    alloc = PageAllocator(num_pages=8, page_size=PS)
    first = computed_seq(alloc, [7] * 5)
    second = computed_seq(alloc, [7] * 5)  # same content, computed without a hit
    assert alloc.num_cached_pages == 1
    assert alloc.peek_prefix([7] * 5)[0] == first.pages[:1]
    alloc.free(second.pages)  # the duplicate is not findable, so it is simply free
    assert alloc.num_evictable_pages == 0
    alloc.free(first.pages)
    assert alloc.num_evictable_pages == 1
    alloc.check_idle()


def test_disabled_prefix_caching_registers_and_matches_nothing():
    alloc = PageAllocator(num_pages=8, page_size=PS, enable_prefix_caching=False)
    seq = computed_seq(alloc, list(range(9)))
    assert alloc.num_cached_pages == 0
    assert alloc.match_prefix(list(range(9))) == ([], 0)
    assert alloc.num_queried_tokens == 0
    alloc.free(seq.pages)
    assert alloc.num_evictable_pages == 0
    alloc.check_idle()


def test_reset_prefix_cache_drops_only_evictable_pages():
    alloc = PageAllocator(num_pages=8, page_size=PS)
    kept = computed_seq(alloc, [1] * 5)
    dropped = computed_seq(alloc, [2] * 5)
    alloc.free(dropped.pages)
    assert alloc.reset_prefix_cache() == 1
    assert alloc.peek_prefix([2] * 5) == ([], 0) and alloc.peek_prefix([1] * 5)[1] == 4
    alloc.free(kept.pages)
    alloc.check_idle()


def test_integrity_errors_are_detected():
    alloc = PageAllocator(num_pages=8, page_size=PS)
    seq = computed_seq(alloc, list(range(9)))
    alloc.check_invariants()
    with pytest.raises(RuntimeError, match="free \\+ 0 cached != 7 usable pages"):
        alloc.check_idle()

    alloc._ref_counts[seq.pages[2]] = 0  # leaked: unreferenced yet neither free nor cached
    with pytest.raises(RuntimeError, match=f"page {seq.pages[2]} is unreferenced .* \\(leaked\\)"):
        alloc.check_invariants()
    alloc._ref_counts[seq.pages[2]] = -1
    with pytest.raises(RuntimeError, match="ref_count -1"):
        alloc.check_invariants()
    alloc._ref_counts[seq.pages[2]] = 1

    alloc._free.append(seq.pages[0])  # referenced and free at once
    with pytest.raises(RuntimeError, match="referenced .* but also free"):
        alloc.check_invariants()
    alloc._free.pop()

    alloc._free.append(NULL_PAGE)
    with pytest.raises(RuntimeError, match="null page 0 was handed out"):
        alloc.check_invariants()
    alloc._free.pop()

    alloc.free(seq.pages)
    alloc.check_idle()
    alloc._hash_to_page.clear()  # evictable pages no longer findable
    with pytest.raises(RuntimeError, match="evictable page .* cannot be found"):
        alloc.check_idle()


def test_a_salted_prefix_is_found_only_with_its_salt():
    """vLLM's cache_salt: pages registered under a salt serve requests with that salt only, and
    unsalted pages serve no salted request."""
    from jaxserve.engine.pages import salted_root

    alloc = PageAllocator(num_pages=16, page_size=PS)
    tokens = list(range(9))
    salted = Sequence("s", list(tokens), len(tokens), SamplingParams(cache_salt="tenant-a"), len(tokens) + 1)
    salted.pages = alloc.allocate(alloc.pages_for(len(tokens)))
    salted.num_computed_tokens = len(tokens)
    alloc.register_full_pages(salted)
    assert alloc.peek_prefix(tokens) == ([], 0)
    assert alloc.peek_prefix(tokens, salted_root("tenant-b")) == ([], 0)
    assert alloc.peek_prefix(tokens, salted_root("tenant-a")) == (salted.pages[:2], 8)
    plain = computed_seq(alloc, tokens)
    assert alloc.peek_prefix(tokens) == (plain.pages[:2], 8)
    assert alloc.peek_prefix(tokens, salted_root("tenant-a"))[0] == salted.pages[:2]
