"""The runner's cache of tree-node histories held in the engine's KV pages.

Every history the runner appends (a prompt, an anchor history, a turn's observation) ends at a tree node. The
runner holds its pages (``AppendItem.hold``) under that node, so a later continuation from the node (stage 2
of the allocation, or a root whose prompt was featurized) starts from the held pages (``AppendItem.start``)
and computes only its last id instead of re-prefilling the whole history; the continuations' KV shares the
held pages.

Holds cost pool pages only while nothing else needs them: the cache registers itself with the pool as a
reclaimer, and the pool drops the least recently used holds when it runs out of free pages. Entries keep
their tree alive, so a tree's ``id`` is never reused while it is a key.
"""

from __future__ import annotations

import collections
from typing import Any

from trace_jax.rollout.engine.slots import Prefix


class PrefixCache:
    """Held histories keyed by ``(tree, node id)``, least recently used first."""

    def __init__(self):
        self._entries: collections.OrderedDict[tuple[int, int], tuple[Any, Prefix]] = collections.OrderedDict()
        self._pool: Any = None
        self.evicted = 0  # holds the pool reclaimed to make room (each costs a later re-prefill if continued)

    def __len__(self) -> int:
        return len(self._entries)

    def attach(self, pool: Any) -> None:
        """Registers with ``pool`` (a ``PagePool``; ``None`` for engines without pages) as a reclaimer."""
        if pool is None or pool is self._pool:
            return
        if self._entries:  # holds of another pool cannot be given back to this one
            self.clear()
        self._pool = pool
        pool.reclaimers.append(self._reclaim)

    def put(self, tree: Any, node_id: int, prefix: Prefix | None) -> None:
        if prefix is None:
            return
        key = (id(tree), node_id)
        if key in self._entries:
            self._drop(self._entries.pop(key)[1])
        self._entries[key] = (tree, prefix)

    def take(self, tree: Any, node_id: int) -> Prefix | None:
        """Removes and returns the node's held prefix (the caller ``put``s it back once its pages are shared:
        while taken, the pool cannot reclaim it)."""
        entry = self._entries.pop((id(tree), node_id), None)
        return None if entry is None else entry[1]

    def evict_oldest(self) -> bool:
        if not self._entries:
            return False
        self._drop(self._entries.popitem(last=False)[1][1])
        return True

    def _reclaim(self) -> bool:
        evicted = self.evict_oldest()
        self.evicted += evicted
        return evicted

    def clear(self) -> None:
        while self.evict_oldest():
            pass

    def _drop(self, prefix: Prefix) -> None:
        if self._pool is not None:
            self._pool.drop(prefix.pages)
