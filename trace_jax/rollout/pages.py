"""Paged KV: a pool of fixed-size pages, a page table per slot, shared prefix pages and copy-on-write forks.

The engine's keys and values live in a pool ``[layers, num_pages, page_size, kv_heads, head_dim]``. Slot b's
position p is page ``table[b, p // page_size]`` at offset ``p % page_size``. Page 0 is the *trash page*:
table entries a slot does not own point at it, so writes of padding rows and of idle slots land there and
nothing reads them as valid (a slot attends only below its length).

Host side (``PagePool``, numpy): the table, a reference count per page and a free list. A prefix to fork
from is *held* (its pages referenced, so they outlive the slot that computed them). A fork points the
child's table at the held *full* pages (count + 1) and copies only the last, partly filled page into a
fresh page of the child's own (copy-on-write done at the fork: both sequences write their next token into
that page). A slot only ever writes at positions >= its length, i.e. into its own last page or new pages, so
a full page with count > 1 is never written. Releasing a slot decrements its pages; a page at 0 returns to the
free list. ``page_size = max_len`` is the contiguous cache: one page per slot, a fork copies the whole row.

Device side: ``gather_positions`` reads slots' positions through the table into a contiguous
``[layers, b, s, kv_heads, head_dim]`` view (the gather-based reference path that works on every backend);
``scatter_positions`` writes a view's positions back. Both take per-position page / offset indices, so any
page size, contiguous included, is the same code.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

TRASH_PAGE = 0


@dataclasses.dataclass
class PageStats:
    """Pages taken from the free list over the pool's life, the most in use at once, and copied by forks."""

    allocated: int = 0
    peak_in_use: int = 0
    fork_copies: int = 0
    shared_by_forks: int = 0


class PagePool:
    """Host bookkeeping of the page pool (see the module docstring).

    Args:
      num_pages: pages in the pool, the trash page included.
      page_size: positions per page.
      max_slots: rows of the table.
      pages_per_slot: columns of the table (``max_len // page_size``).
    """

    def __init__(self, num_pages: int, page_size: int, max_slots: int, pages_per_slot: int):
        self.num_pages, self.page_size, self.pages_per_slot = num_pages, page_size, pages_per_slot
        self.table = np.full((max_slots, pages_per_slot), TRASH_PAGE, np.int32)
        self.owned = np.zeros(max_slots, np.int32)  # slot b references table[b, :owned[b]]
        self.refcount = np.zeros(num_pages, np.int32)
        self.refcount[TRASH_PAGE] = 1  # never freed
        self._free = list(range(num_pages - 1, TRASH_PAGE, -1))
        self.stats = PageStats()

    @property
    def in_use(self) -> int:
        return self.num_pages - 1 - len(self._free)

    def pages_for(self, length: int) -> int:
        return min(-(-int(length) // self.page_size), self.pages_per_slot)

    def _take(self) -> int:
        if not self._free:
            raise RuntimeError(
                f"the KV page pool is exhausted ({self.num_pages} pages of {self.page_size}); raise "
                "EngineConfig.num_pages (0 = enough for every slot at max_len)"
            )
        page = self._free.pop()
        self.refcount[page] = 1
        self.stats.allocated += 1
        self.stats.peak_in_use = max(self.stats.peak_in_use, self.in_use)
        return page

    def reserve(self, slot: int, length: int) -> None:
        """Gives ``slot`` its own pages up to position ``length`` (exclusive); existing pages are kept."""
        need = self.pages_for(length)
        for column in range(self.owned[slot], need):
            self.table[slot, column] = self._take()
        self.owned[slot] = max(self.owned[slot], need)

    def release(self, slot: int) -> None:
        """Drops every page reference of ``slot`` (a page nobody references returns to the free list)."""
        for page in self.table[slot, : self.owned[slot]]:
            self.refcount[page] -= 1
            if self.refcount[page] == 0:
                self._free.append(int(page))
        self.table[slot] = TRASH_PAGE
        self.owned[slot] = 0

    def hold(self, slot: int, length: int) -> list[int]:
        """References the pages of ``slot``'s first ``length`` positions (a prefix to fork from later, even
        after the slot moved on or was freed); give them back with ``drop``. The slot may keep writing into
        its last held page, but only at positions >= ``length``, which a fork never reads from the hold."""
        held = [int(p) for p in self.table[slot, : self.pages_for(length)]]
        for page in held:
            self.refcount[page] += 1
        return held

    def drop(self, held: list[int]) -> None:
        for page in held:
            self.refcount[page] -= 1
            if self.refcount[page] == 0:
                self._free.append(page)

    def fork(self, held: list[int], child: int, length: int) -> tuple[int, int]:
        """``child`` shares the held prefix's full pages below ``length``; returns the (held page, child page)
        pair to copy for the partly filled last page, or ``(TRASH_PAGE, TRASH_PAGE)`` when there is none."""
        self.release(child)
        full = int(length) // self.page_size
        for column in range(full):
            self.refcount[held[column]] += 1
            self.table[child, column] = held[column]
        self.stats.shared_by_forks += full
        self.owned[child] = full
        if int(length) % self.page_size == 0:
            return TRASH_PAGE, TRASH_PAGE
        copy = self._take()
        self.table[child, full] = copy
        self.owned[child] = full + 1
        self.stats.fork_copies += 1
        return held[full], copy


# ------------------------------------------------------------------------------------------- device
def position_index(table_bp: jax.Array, positions_bs: jax.Array, page_size: int) -> tuple[jax.Array, jax.Array]:
    """Page and offset int32 [b, s] of each slot's positions; positions outside the table map to page
    ``num_pages`` (out of bounds: a scatter drops them, a gather clamps and the caller masks)."""
    columns_bs = positions_bs // page_size
    inside_bs = (positions_bs >= 0) & (columns_bs < table_bp.shape[1])
    pages_bs = jnp.take_along_axis(table_bp, jnp.clip(columns_bs, 0, table_bp.shape[1] - 1), axis=1)
    return jnp.where(inside_bs, pages_bs, jnp.iinfo(jnp.int32).max), positions_bs % page_size


def gather_positions(pool_lpske: jax.Array, table_bp: jax.Array, positions_bs: jax.Array, page_size: int) -> jax.Array:
    """``[layers, b, s, kv_heads, head_dim]``: slot b's positions ``positions_bs[b]`` read through the table."""
    pages_bs, offsets_bs = position_index(table_bp, positions_bs, page_size)
    return pool_lpske[:, jnp.minimum(pages_bs, pool_lpske.shape[1] - 1), offsets_bs]


def scatter_positions(
    pool_lpske: jax.Array, table_bp: jax.Array, positions_bs: jax.Array, values_lbske: jax.Array, page_size: int
) -> jax.Array:
    """Writes ``values_lbske[:, b, i]`` at slot b's position ``positions_bs[b, i]``; out-of-table positions
    are dropped. Donate the pool so XLA writes in place."""
    pages_bs, offsets_bs = position_index(table_bp, positions_bs, page_size)
    return pool_lpske.at[:, pages_bs, offsets_bs].set(values_lbske.astype(pool_lpske.dtype), mode="drop")


def copy_pages(pool_lpske: jax.Array, source_k: jax.Array, dest_k: jax.Array) -> jax.Array:
    """Copies pages ``source_k[i] -> dest_k[i]`` (the fork's copy-on-write of a partly filled page)."""
    return pool_lpske.at[:, dest_k].set(pool_lpske[:, source_k])
