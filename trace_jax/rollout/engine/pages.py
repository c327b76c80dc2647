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

Device side: ``PagedKVCache`` is the cache type the model runs on (``write_layer`` / ``read_layer`` behind
``trace_jax.models.attention.attend_cached``): a layer's new keys and values are scattered straight into
their pages, and attention reads a slot's positions through its table, one layer at a time (the gather-
based reference path, every backend), or with the TPU Pallas paged-attention kernel where it applies. Any
page size, contiguous included, is the same code. The pools hold the values' bits (an unsigned integer of
the cache dtype's width, ``attention.as_bits``): the scatter of new keys and values then runs in place on
every backend (XLA:CPU has no bf16 scatter and would scatter into a float32 copy of the whole pool at every
layer of every step), and a layer's window is viewed in the cache dtype after its gather.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.models import attention as attention_lib
from trace_jax.parallel.mesh import constrain

TRASH_PAGE = 0


@dataclasses.dataclass
class PageStats:
    """Pages taken from the free list over the pool's life, the most in use at once, and copied by forks."""

    allocated: int = 0
    peak_in_use: int = 0
    fork_copies: int = 0
    shared_by_forks: int = 0
    unwritten: int = 0  # pages reserved ahead of decoding that were released holding no position


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
        # Owners of optional holds (a prefix cache): each call gives some pages back, True if it freed any.
        self.reclaimers: list[Callable[[], bool]] = []

    @property
    def in_use(self) -> int:
        return self.num_pages - 1 - len(self._free)

    def settle(self) -> None:
        """Once no page is in use: the free list back in its initial order, so which pages the next sequences
        get does not depend on what ran before (a resumed run hands out the pages an uninterrupted one does)."""
        if self.in_use == 0:
            self._free = list(range(self.num_pages - 1, TRASH_PAGE, -1))

    def pages_for(self, length: int) -> int:
        return min(-(-int(length) // self.page_size), self.pages_per_slot)

    def _take(self) -> int:
        while not self._free and any(reclaim() for reclaim in self.reclaimers):
            pass
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

    def release(self, slot: int, length: int | None = None) -> None:
        """Drops every page reference of ``slot`` (a page nobody references returns to the free list);
        ``length`` (the slot's filled positions) lets the stats count reserved pages never written."""
        if length is not None:
            self.stats.unwritten += max(int(self.owned[slot]) - self.pages_for(length), 0)
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
    ``int32 max`` (out of bounds: a scatter drops them; a gather clamps and attention masks them)."""
    columns_bs = positions_bs // page_size
    inside_bs = (positions_bs >= 0) & (columns_bs < table_bp.shape[1])
    pages_bs = jnp.take_along_axis(table_bp, jnp.clip(columns_bs, 0, table_bp.shape[1] - 1), axis=1)
    return jnp.where(inside_bs, pages_bs, jnp.iinfo(jnp.int32).max), positions_bs % page_size


def copy_pages(pool_lkpze: jax.Array, source_n: jax.Array, dest_n: jax.Array) -> jax.Array:
    """Copies pages ``source_n[i] -> dest_n[i]`` in every layer (the fork's copy of a partly filled page; the
    pool holds bits, so the scatter runs in place)."""
    return pool_lkpze.at[:, :, dest_n].set(pool_lkpze[:, :, source_n])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """The KV cache the model sees when it runs on engine slots: the page pools plus the slots' page tables.

    k_pages / v_pages: [layers, kv_heads, pages, page_size, head_dim] (the layout of the Pallas paged-
    attention kernel), the bits of ``dtype`` values (``attention.bits_dtype``); table_bp: int32 [B, pages per
    slot]; lengths: int32 [B] valid positions per slot; window_w: int32 [W] = 0..W-1, the positions attention
    reads (its length is the static window); dtype (static): the cache's value dtype.

    It has the two methods ``trace_jax.models.attention.attend_cached`` needs (``write_layer``,
    ``read_layer``: the gather-based reference path, any backend) and ``attend_layer``, which runs the TPU
    Pallas paged-attention kernel where it applies (one new token per slot) and the reference otherwise.
    """

    k_pages: jax.Array
    v_pages: jax.Array
    table_bp: jax.Array
    lengths: jax.Array
    window_w: jax.Array
    dtype: Any = dataclasses.field(metadata={"static": True}, default=jnp.bfloat16)

    def _replace(self, **fields: Any) -> PagedKVCache:
        """A copy with ``fields`` replaced (the interface the model's caches share)."""
        return dataclasses.replace(self, **fields)

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[3]

    @property
    def max_len(self) -> int:
        return self.window_w.shape[0]

    def write_layer(self, layer: jax.Array, positions_bt: jax.Array, k_btke: jax.Array, v_btke: jax.Array):
        """Stores one layer's new keys / values at each slot's positions, through its page table (positions
        past the table, i.e. padding past ``max_len``, are dropped)."""
        pages_bt, offsets_bt = position_index(self.table_bp, positions_bt, self.page_size)
        # Every index an array broadcasting to [B, T, K]: the written block is [B, T, K, E] whether ``layer``
        # is a traced scalar or a Python int.
        heads_11k = jnp.arange(self.k_pages.shape[1])[None, None, :]
        index = (layer, heads_11k, pages_bt[..., None], offsets_bt[..., None])
        bits = lambda new_btke: attention_lib.as_bits(new_btke.astype(self.dtype))
        write = lambda pool, new_btke: pool.at[index].set(bits(new_btke), mode="drop")
        return self._replace(k_pages=write(self.k_pages, k_btke), v_pages=write(self.v_pages, v_btke))

    def read_layer(self, layer: jax.Array) -> tuple[jax.Array, jax.Array]:
        """One layer's keys and values of the window's positions 0..W-1, [B, W, kv_heads, head_dim] each, read
        through the page table (the gather-based reference path). It gathers whole pages (a table entry a
        slot does not own names the trash page, which attention masks as past the slot's length): a block
        of ``page_size * head_dim`` values per index, not one position at a time."""
        b, window = self.table_bp.shape[0], self.max_len
        columns = min(-(-window // self.page_size), self.table_bp.shape[1])
        table_bn = constrain(self.table_bp[:, :columns], ("batch", None))

        def read(pool_lkpze):
            # The layer's pool whole on each slot shard, then the shard's own slots (see ``layout``'s limit).
            blocks_kbnze = constrain(pool_lkpze[layer], (None, None, None, None))[:, table_bn]
            blocks_kbnze = constrain(blocks_kbnze, (None, "batch", None, None, None))
            k, _, _, z, e = blocks_kbnze.shape
            bits_bwke = jnp.moveaxis(blocks_kbnze.reshape(k, b, columns * z, e)[:, :, :window], 0, 2)
            return jax.lax.bitcast_convert_type(bits_bwke, self.dtype)

        return read(self.k_pages), read(self.v_pages)

    def attend_layer(
        self, layer: jax.Array, q_bthe: jax.Array, k_btke: jax.Array, v_btke: jax.Array, positions_bt, implementation
    ):
        """``attend_cached`` for this cache: write, then the Pallas kernel on TPU for single-token decoding,
        else the gather-based reference path."""

        cache = self.write_layer(layer, positions_bt, k_btke, v_btke)
        if q_bthe.shape[1] == 1 and _pallas_paged_attention_applies(implementation):
            return cache._pallas_decode(layer, q_bthe, positions_bt), cache
        keys_bske, values_bske = cache.read_layer(layer)
        dtype = q_bthe.dtype
        out = attention_lib.attention(
            q_bthe, keys_bske.astype(dtype), values_bske.astype(dtype), positions_bt, implementation=implementation
        )
        return out, cache

    def _pallas_decode(self, layer: jax.Array, q_bthe: jax.Array, positions_bt: jax.Array) -> jax.Array:
        """TPU only, untested here (no TPU on the development machines): one query per slot against its pages.
        Heads must be whole inside the call (wrap in ``shard_map`` when they are split over ``tensor``)."""
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention  # TPU-only kernel

        b, _, h, e = q_bthe.shape
        pages_per_slot = self.table_bp.shape[1]
        block = max(d for d in (8, 4, 2, 1) if pages_per_slot % d == 0)
        out_bhe = paged_attention(
            (q_bthe[:, 0] / jnp.sqrt(jnp.float32(e))).astype(q_bthe.dtype),
            jax.lax.bitcast_convert_type(self.k_pages[layer], self.dtype),
            jax.lax.bitcast_convert_type(self.v_pages[layer], self.dtype),
            positions_bt[:, 0] + 1,  # the new token sees itself and every earlier position
            self.table_bp,
            pages_per_compute_block=block,
        )
        return out_bhe.reshape(b, 1, h, e).astype(q_bthe.dtype)


def _pallas_paged_attention_applies(implementation: str) -> bool:
    """On TPU, unless a specific non-TPU implementation was asked for, and only if the kernel imports."""
    if jax.default_backend() != "tpu" or implementation not in ("auto", "splash"):
        return False
    try:
        from jax.experimental.pallas.ops.tpu import paged_attention  # noqa: F401 (a probe: does the TPU kernel import)
    except ImportError:
        return False
    return True
