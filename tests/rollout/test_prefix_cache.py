"""The runner's cache of held histories: least recently used holds go back to the pool when it runs dry; a taken
entry cannot be reclaimed."""

import pytest

from trace_jax.rollout.pages import PagePool
from trace_jax.rollout.prefix_cache import PrefixCache
from trace_jax.rollout.slots import Prefix


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
