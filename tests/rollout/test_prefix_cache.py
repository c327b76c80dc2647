"""The runner's cache of held histories: least recently used holds go back to the pool when it runs dry; a taken
entry cannot be reclaimed."""

import pytest

from trace_jax.rollout.engine.pages import PagePool
from trace_jax.rollout.engine.prefix_cache import PrefixCache
from trace_jax.rollout.engine.slots import Prefix


def _held(pool: PagePool, slot: int, length: int) -> Prefix:
    pool.reserve(slot, length)
    prefix = Prefix(None, pool.hold(slot, length), length)
    pool.release(slot)  # only the hold keeps the pages now
    return prefix


def test_the_pool_reclaims_the_oldest_holds_only_when_it_runs_dry():
    pool = PagePool(num_pages=7, page_size=4, max_slots=2, pages_per_slot=4)  # 6 usable pages
    cache = PrefixCache()
    cache.attach(pool)
    trees = [object(), object(), object()]
    for tree in trees:
        cache.put(tree, 0, _held(pool, 0, 8))  # two pages each: the pool is full
    assert pool.in_use == 6 and len(cache) == 3
    newest = cache.take(trees[2], 0)  # taken: not reclaimable while its pages are being shared
    pool.reserve(1, 12)  # three pages: the two oldest holds go back, the taken one stays
    assert len(cache) == 0 and cache.take(trees[0], 0) is None and cache.take(trees[1], 0) is None
    assert set(newest.pages).isdisjoint(pool.table[1, :3].tolist())
    cache.put(trees[2], 0, newest)
    with pytest.raises(RuntimeError, match="num_pages"):
        pool.reserve(0, 16)  # 4 more pages: reclaiming the last hold frees 2, not enough
    assert len(cache) == 0


def test_pool_reclaims_are_counted_and_an_idle_pool_hands_out_pages_in_its_initial_order():
    """Catches a free list whose order carries the pool's history into the next phase (a resumed run, starting from
    a fresh pool, would place its sequences in other pages), and a reclaim count that also counts ``clear``."""
    fresh = PagePool(num_pages=7, page_size=4, max_slots=2, pages_per_slot=4)
    fresh.reserve(0, 12)
    first_pages = fresh.table[0, :3].tolist()
    pool = PagePool(num_pages=7, page_size=4, max_slots=2, pages_per_slot=4)
    cache = PrefixCache()
    cache.attach(pool)
    trees = [object(), object(), object()]
    for tree in trees:
        cache.put(tree, 0, _held(pool, 0, 8))
    pool.reserve(1, 4)  # one page: the oldest hold goes back
    assert cache.evicted == 1
    pool.release(1)
    cache.clear()  # dropped on purpose: not a reclaim
    assert cache.evicted == 1 and pool.in_use == 0
    pool.reserve(0, 12)
    assert pool.table[0, :3].tolist() != first_pages  # the premise: history reordered the free list
    pool.release(0)
    pool.settle()
    pool.reserve(0, 12)
    assert pool.table[0, :3].tolist() == first_pages
    pool.reserve(1, 4)
    pool.settle()  # pages in use: nothing moves
    assert pool.table[0, :3].tolist() == first_pages
