"""Paged KV: a pool of fixed-size pages, a page table per slot, shared prefix pages and copy-on-write forks.

The engine's keys and values live in a pool ``[kv_heads, layers, num_pages, page_size, head_dim]``. Slot b's
position p is page ``table[b, p // page_size]`` at offset ``p % page_size``, in every layer. Page 0 is the
*trash page*: table entries a slot does not own point at it, so writes of padding rows and of idle slots land
there and nothing reads them as valid (a slot attends only below its length).

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
page size, contiguous included, is the same code. Off TPU the pools hold the values' bits (an unsigned integer
of the cache dtype's width, ``attention.as_bits``): the scatter of new keys and values then runs in place
(XLA:CPU has no bf16 scatter and would scatter into a float32 copy of the whole pool at every layer of every
step), and a layer's window is viewed in the cache dtype after its gather. On TPU they hold the values
themselves (``pool_dtype``): XLA:TPU scatters bf16 in place, and the paged-attention kernel reads the pool
as it lies (a ``bitcast_convert_type`` of the whole pool compiles to a copy of it on TPU).

The int8 cache (``EngineConfig.cache_dtype="int8"``): the pools hold int8 values and two more pools, ``k_scales``
/ ``v_scales`` float32 ``[kv_heads, layers, pages, page_size]``, one scale per position and KV head (the row of
``head_dim`` values it quantizes): ``value = q * scale / QUANT_DIVISOR`` (``quantize`` / ``dequantize``), so each
position's error is at most half a step of its own row's largest magnitude, whatever the other rows hold. A
scale is set once, when its position is written, like its values: no page is ever re-quantized. The scale pools
follow the value pools everywhere pages move (``POOL_FIELDS``: forks' copies, appends, the decode loop); with a
float cache they are ``None``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from trace_jax.kernels import paged_attention, paged_attention_int8
from trace_jax.models import attention as attention_lib
from trace_jax.parallel.mesh import constrain

TRASH_PAGE = 0
# The pools a page lives in: values, and the int8 cache's scales (``None`` for a float cache).
POOL_FIELDS = ("k_pages", "v_pages", "k_scales", "v_scales")
# value = int8 * scale / QUANT_DIVISOR, the convention of jax's paged-attention quantization
# (``quantization_utils.from_int8``); ``quantize`` stores scale = row max * QUANT_DIVISOR / QUANT_MAX so that
# a row's largest value lands on +-QUANT_MAX exactly (never past int8's range).
QUANT_DIVISOR = 127.5
QUANT_MAX = 127


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

    def __init__(self, num_pages: int, page_size: int, max_slots: int, pages_per_slot: int, shards: int = 1):
        if num_pages % shards or max_slots % shards:
            raise ValueError(f"{num_pages} pages and {max_slots} slots do not split into {shards} shards")
        self.num_pages, self.page_size, self.pages_per_slot = num_pages, page_size, pages_per_slot
        # Shard-local pages (``shards`` > 1, the Pallas decode kernel under a mesh): slot b takes pages only
        # from its shard's range [s * P/n, (s + 1) * P/n), whose first page is that shard's trash page.
        self.shards, self.shard_pages, self.shard_slots = shards, num_pages // shards, max_slots // shards
        self.table = np.full((max_slots, pages_per_slot), TRASH_PAGE, np.int32)
        self.owned = np.zeros(max_slots, np.int32)  # slot b references table[b, :owned[b]]
        self.refcount = np.zeros(num_pages, np.int32)
        self.refcount[self.trash_pages] = 1  # never freed
        self._free = self._initial_free()
        self.stats = PageStats()
        # Owners of optional holds (a prefix cache): each call gives some pages back, True if it freed any.
        self.reclaimers: list[Callable[[], bool]] = []
        # (from, to) page copies a fork across shards needs beyond the one ``fork`` returns (the engine runs them
        # before the call that shares the pages: ``take_copies``).
        self.pending_copies: list[tuple[int, int]] = []

    @property
    def trash_pages(self) -> list[int]:
        return [s * self.shard_pages for s in range(self.shards)]

    def _initial_free(self) -> list[list[int]]:
        return [list(range((s + 1) * self.shard_pages - 1, s * self.shard_pages, -1)) for s in range(self.shards)]

    def shard_of_slot(self, slot: int) -> int:
        return int(slot) // self.shard_slots

    def shard_of_page(self, page: int) -> int:
        return int(page) // self.shard_pages

    @property
    def in_use(self) -> int:
        return self.num_pages - self.shards - sum(len(free) for free in self._free)

    def settle(self) -> None:
        """Once no page is in use: the free list back in its initial order, so which pages the next sequences
        get does not depend on what ran before (a resumed run hands out the pages an uninterrupted one does)."""
        if self.in_use == 0:
            self._free = self._initial_free()

    def take_copies(self) -> list[tuple[int, int]]:
        """The pending cross-shard page copies (cleared)."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def pages_for(self, length: int) -> int:
        return min(-(-int(length) // self.page_size), self.pages_per_slot)

    def _take(self, slot: int) -> int:
        free = self._free[self.shard_of_slot(slot)]
        while not free and any(reclaim() for reclaim in self.reclaimers):
            pass
        if not free:
            where = f" (shard {self.shard_of_slot(slot)} of {self.shards})" if self.shards > 1 else ""
            raise RuntimeError(
                f"the KV page pool is exhausted{where} ({self.num_pages} pages of {self.page_size}); raise "
                "EngineConfig.num_pages (0 = enough for every slot at max_len)"
            )
        page = free.pop()
        self.refcount[page] = 1
        self.stats.allocated += 1
        self.stats.peak_in_use = max(self.stats.peak_in_use, self.in_use)
        return page

    def reserve(self, slot: int, length: int) -> None:
        """Gives ``slot`` its own pages up to position ``length`` (exclusive); existing pages are kept."""
        need = self.pages_for(length)
        for column in range(self.owned[slot], need):
            self.table[slot, column] = self._take(slot)
        self.owned[slot] = max(self.owned[slot], need)

    def release(self, slot: int, length: int | None = None) -> None:
        """Drops every page reference of ``slot`` (a page nobody references returns to the free list);
        ``length`` (the slot's filled positions) lets the stats count reserved pages never written."""
        if length is not None:
            self.stats.unwritten += max(int(self.owned[slot]) - self.pages_for(length), 0)
        for page in self.table[slot, : self.owned[slot]]:
            self.refcount[page] -= 1
            if self.refcount[page] == 0:
                self._free[self.shard_of_page(page)].append(int(page))
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
                self._free[self.shard_of_page(page)].append(page)

    def fork(self, held: list[int], child: int, length: int) -> tuple[int, int]:
        """``child`` shares the held prefix's full pages below ``length``; returns the (held page, child page)
        pair to copy for the partly filled last page, or ``(TRASH_PAGE, TRASH_PAGE)`` when there is none."""
        self.release(child)
        full = int(length) // self.page_size
        if full and self.shard_of_page(held[0]) != self.shard_of_slot(child):
            # Another shard's pages cannot be read by this slot's shard: copy the full ones too (pending).
            for column in range(full):
                page = self._take(child)
                self.table[child, column] = page
                self.pending_copies.append((held[column], page))
            self.stats.fork_copies += full
        else:
            for column in range(full):
                self.refcount[held[column]] += 1
                self.table[child, column] = held[column]
            self.stats.shared_by_forks += full
        self.owned[child] = full
        if int(length) % self.page_size == 0:
            return TRASH_PAGE, TRASH_PAGE
        copy = self._take(child)
        self.table[child, full] = copy
        self.owned[child] = full + 1
        self.stats.fork_copies += 1
        return held[full], copy


# ------------------------------------------------------------------------------------------- device
def is_quantized(dtype: Any) -> bool:
    """Whether a cache of ``dtype`` holds int8 values with per-position scales (see the module docstring)."""
    return jnp.dtype(dtype) == jnp.int8


def pool_dtype(dtype: Any, platform: str) -> jnp.dtype:
    """The element type of a pool of ``dtype`` values on ``platform``'s devices: the values on TPU (and int8
    everywhere), their bits (``attention.bits_dtype``) elsewhere (see the module docstring)."""
    dtype = jnp.dtype(dtype)
    return dtype if platform == "tpu" or is_quantized(dtype) else attention_lib.bits_dtype(dtype)


def quantize(x_ne: jax.Array) -> tuple[jax.Array, jax.Array]:
    """int8 values [..., E] and float32 scales [...] of ``x_ne``: one scale per row of the last axis."""
    x_ne = x_ne.astype(jnp.float32)
    top_n = jnp.max(jnp.abs(x_ne), axis=-1)
    scale_n = jnp.where(top_n > 0, top_n, 1.0) * (QUANT_DIVISOR / QUANT_MAX)
    q_ne = jnp.clip(jnp.rint(x_ne * (QUANT_DIVISOR / scale_n[..., None])), -QUANT_MAX, QUANT_MAX)
    return q_ne.astype(jnp.int8), scale_n


def dequantize(q_ne: jax.Array, scale_n: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
    """The values int8 ``q_ne`` [..., E] with scales ``scale_n`` [...] stand for, in ``dtype``."""
    return (q_ne.astype(jnp.float32) * (scale_n[..., None] / QUANT_DIVISOR)).astype(dtype)


def store(pools: dict[str, Any], index: tuple, k_new: jax.Array, v_new: jax.Array, dtype: Any) -> dict[str, Any]:
    """``pools`` (``pool_of``) with new keys / values [..., E] written at ``index`` (an index of the pools'
    first four axes; out-of-bounds entries dropped) as a cache of ``dtype`` holds them: the values or their
    bits, or int8 values and their scales (``quantize``)."""
    out = dict(pools)
    for name, new in (("k", k_new), ("v", v_new)):
        pool = pools[f"{name}_pages"]
        if is_quantized(dtype):
            q, scale = quantize(new)
            out[f"{name}_pages"] = pool.at[index].set(q, mode="drop")
            out[f"{name}_scales"] = pools[f"{name}_scales"].at[index].set(scale, mode="drop")
        else:
            out[f"{name}_pages"] = pool.at[index].set(as_dtype(new.astype(dtype), pool.dtype), mode="drop")
    return out


def pool_of(x: Any) -> dict[str, Any]:
    """The pools of ``x`` (a ``DecodeState`` or ``PagedKVCache``) by field name (``POOL_FIELDS``)."""
    return {name: getattr(x, name) for name in POOL_FIELDS}


def copy_pools(x: Any, source_n: jax.Array, dest_n: jax.Array) -> dict[str, Any]:
    """``copy_pages`` applied to every pool of ``x`` (``pool_of``); a ``None`` pool stays ``None``."""
    return {name: None if pool is None else copy_pages(pool, source_n, dest_n) for name, pool in pool_of(x).items()}


def as_dtype(x: jax.Array, dtype: Any) -> jax.Array:
    """``x``'s bits viewed as ``dtype`` (of the same width); ``x`` itself where it already is ``dtype``."""
    return x if x.dtype == jnp.dtype(dtype) else jax.lax.bitcast_convert_type(x, dtype)


def position_index(table_bp: jax.Array, positions_bs: jax.Array, page_size: int) -> tuple[jax.Array, jax.Array]:
    """Page and offset int32 [b, s] of each slot's positions; positions outside the table map to page
    ``int32 max`` (out of bounds: a scatter drops them; a gather clamps and attention masks them)."""
    columns_bs = positions_bs // page_size
    inside_bs = (positions_bs >= 0) & (columns_bs < table_bp.shape[1])
    pages_bs = jnp.take_along_axis(table_bp, jnp.clip(columns_bs, 0, table_bp.shape[1] - 1), axis=1)
    return jnp.where(inside_bs, pages_bs, jnp.iinfo(jnp.int32).max), positions_bs % page_size


def copy_pages(pool_klpze: jax.Array, source_n: jax.Array, dest_n: jax.Array) -> jax.Array:
    """Copies pages ``source_n[i] -> dest_n[i]`` in every layer (the fork's copy of a partly filled page; a
    scatter in place). Any pool whose third axis is the page: values ``[K, L, P, Z, E]`` or scales ``[K, L, P, Z]``."""
    return pool_klpze.at[:, :, dest_n].set(pool_klpze[:, :, source_n])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """The KV cache the model sees when it runs on engine slots: the page pools plus the slots' page tables.

    k_pages / v_pages: [kv_heads, layers, pages, page_size, head_dim], ``dtype`` values or their bits
    (``pool_dtype``); a shard's block of it, reshaped to ``[kv_heads, layers * pages, page_size, head_dim]`` (a
    bitcast), is the page operand of the Pallas paged-attention kernel, every layer at once; table_bp: int32 [B,
    pages per slot]; lengths: int32 [B] valid positions per slot; window_w: int32 [W] = 0..W-1, the positions attention
    reads (its length is the static window); dtype (static): the cache's value dtype; k_scales / v_scales: float32
    [kv_heads, layers, pages, page_size] with an int8 ``dtype`` (see the module docstring), else ``None``.

    It has the two methods ``trace_jax.models.attention.attend_cached`` needs (``write_layer``,
    ``read_layer``: the gather-based reference path, any backend) and ``attend_layer``, which runs the TPU
    Pallas paged-attention kernel (``kernel``: the engine's ``DecodeKernel``, chosen for its mesh's devices
    when it is built; static) for one new token per slot and the reference otherwise.
    """

    k_pages: jax.Array
    v_pages: jax.Array
    table_bp: jax.Array
    lengths: jax.Array
    window_w: jax.Array
    dtype: Any = dataclasses.field(metadata={"static": True}, default=jnp.bfloat16)
    kernel: Any = dataclasses.field(metadata={"static": True}, default=None)  # a ``DecodeKernel`` or None
    k_scales: jax.Array | None = None
    v_scales: jax.Array | None = None

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
        heads_11k = jnp.arange(self.k_pages.shape[0])[None, None, :]
        index = (heads_11k, layer, pages_bt[..., None], offsets_bt[..., None])
        return self._replace(**store(pool_of(self), index, k_btke, v_btke, self.dtype))

    def read_layer(self, layer: jax.Array) -> tuple[jax.Array, jax.Array]:
        """One layer's keys and values of the window's positions 0..W-1, [B, W, kv_heads, head_dim] each, read
        through the page table (the gather-based reference path). It gathers whole pages (a table entry a
        slot does not own names the trash page, which attention masks as past the slot's length): a block
        of ``page_size * head_dim`` values per index, not one position at a time."""
        b, window = self.table_bp.shape[0], self.max_len
        columns = min(-(-window // self.page_size), self.table_bp.shape[1])
        table_bn = constrain(self.table_bp[:, :columns], ("batch", None))

        def read(pool_klpz_):
            # The layer's pool whole on each slot shard, then the shard's own slots (see ``layout``'s limit).
            tail = (None,) * (pool_klpz_.ndim - 2)
            blocks_kbnz_ = constrain(
                constrain(pool_klpz_[:, layer], (None, *tail))[:, table_bn], (None, "batch", *tail)
            )
            k, _, _, z = blocks_kbnz_.shape[:4]
            bits_bwk_ = jnp.moveaxis(
                blocks_kbnz_.reshape(k, b, columns * z, *blocks_kbnz_.shape[4:])[:, :, :window], 0, 2
            )
            return bits_bwk_

        if not is_quantized(self.dtype):
            return as_dtype(read(self.k_pages), self.dtype), as_dtype(read(self.v_pages), self.dtype)
        return dequantize(read(self.k_pages), read(self.k_scales)), dequantize(read(self.v_pages), read(self.v_scales))

    def attend_layer(
        self, layer: jax.Array, q_bthe: jax.Array, k_btke: jax.Array, v_btke: jax.Array, positions_bt, implementation
    ):
        """``attend_cached`` for this cache: single-token decoding through the Pallas paged-attention kernel when
        the engine chose it for its mesh (``kernel``), else write, then the gather-based reference path."""
        if self.kernel is not None and q_bthe.shape[1] == 1:
            return self.kernel.decode(self, layer, q_bthe, k_btke, v_btke, positions_bt)
        cache = self.write_layer(layer, positions_bt, k_btke, v_btke)
        keys_bske, values_bske = cache.read_layer(layer)
        dtype = q_bthe.dtype
        out = attention_lib.attention(
            q_bthe, keys_bske.astype(dtype), values_bske.astype(dtype), positions_bt, implementation=implementation
        )
        return out, cache


# ------------------------------------------------------------------------------ Pallas decode kernel
# Run the kernel in Pallas TPU interpret mode on any devices (tests on CPU): engines built while it is set
# decode through the kernel on CPU meshes too.
KERNEL_INTERPRET = False


@dataclasses.dataclass(frozen=True)
class DecodeKernel:
    """``generate``'s single-token attention through a Pallas TPU paged-attention kernel on the engine's mesh:
    jax's for a float cache (its block rules and cost: ``trace_jax.kernels.paged_attention``), ours for an int8
    cache, which reads the int8 pages and their scales (``trace_jax.kernels.paged_attention_int8``).

    Mosaic kernels cannot be partitioned by XLA, so the call runs in ``jax.shard_map`` with every mesh axis
    manual: slots (and the pool's pages) over ``slot_axes``, KV heads over ``head_axis``. Each shard reads
    only its own pages: the engine's ``PagePool`` is built with ``shards`` so a slot takes pages from its
    shard's range (a fork across shards copies its prefix's pages), and the tables are turned local here
    (global page - shard base; another shard's page, i.e. the global trash page of an idle slot, becomes the
    shard's own trash page 0). The new token's keys / values are written inside the same ``shard_map``.

    The kernel reads the pool in place: each shard's block ``[kv_heads, layers, pages, page_size, head_dim]`` is
    handed over whole as ``[kv_heads, layers * pages, page_size, head_dim]`` (merging two major axes: a bitcast,
    no copy), where layer ``l``'s page ``p`` is page ``l * pages + p``: the page tables are offset by the layer.
    (A layer's slice ``pool[:, l]`` as the operand would be a copy of the shard's layer of the pool at every
    layer and step: ``tests/kernels/test_tpu_kernels.py``.)
    """

    mesh: Any
    slot_axes: tuple[str, ...]
    head_axis: str | None
    pages_per_compute_block: int
    interpret: bool = False  # Pallas TPU interpret mode (tests on CPU)

    @property
    def shards(self) -> int:
        return int(np.prod([self.mesh.shape[a] for a in self.slot_axes], dtype=np.int64))

    def decode(self, cache: PagedKVCache, layer, q_bthe, k_btke, v_btke, positions_bt):
        b, _, h, e = q_bthe.shape
        slots = self.slot_axes or None
        heads = self.head_axis
        block = self.pages_per_compute_block
        dtype, page_size = cache.dtype, cache.page_size
        pools = {name: pool for name, pool in pool_of(cache).items() if pool is not None}
        specs = {name: P(heads, None, slots, *(None,) * (pool.ndim - 3)) for name, pool in pools.items()}

        def local(pools, table_bp, q_bhe, k_bke, v_bke, position_b, layer):
            heads_here, layers, num_local_pages = pools["k_pages"].shape[:3]
            shard = jnp.int32(0)
            for axis in self.slot_axes:  # major to minor, as a NamedSharding splits over an axis tuple
                shard = shard * self.mesh.shape[axis] + jax.lax.axis_index(axis)
            table_bp = table_bp - shard * num_local_pages
            table_bp = jnp.where((table_bp >= 0) & (table_bp < num_local_pages), table_bp, TRASH_PAGE)
            pages_b, offsets_b = position_index(table_bp, position_b[:, None], page_size)
            pages_b = jnp.minimum(pages_b[:, 0], num_local_pages)  # past the table: out of bounds, dropped
            heads_1k = jnp.arange(heads_here)[None, :]
            pools = store(pools, (heads_1k, layer, pages_b[:, None], offsets_b), k_bke, v_bke, dtype)
            # Every layer's pages in one page axis (layer-major, a bitcast): layer ``layer``'s page p is page
            # ``layer * num_local_pages + p``.
            merged = lambda pool: pool.reshape(heads_here, layers * num_local_pages, *pool.shape[3:])
            table_layer = table_bp + layer * num_local_pages
            # The new token sees itself and every earlier position; a slot past its table (a full one that is
            # not running) reads no column beyond it.
            lengths_b = jnp.minimum(position_b + 1, table_bp.shape[1] * page_size)
            if is_quantized(dtype):  # int8 pages and their scales, dequantized in VMEM
                k_view, v_view = merged(pools["k_pages"]), merged(pools["v_pages"])
                # One layer's scales (XLA lays the scale pool out pages-minor, the kernel reads it page-major:
                # the slice is relaid out, a layer's scales, not the pool's, each layer and step).
                scales = lambda name: paged_attention_int8.scale_groups(pools[f"{name}_scales"][:, layer, None])
                out_bhe = paged_attention_int8.paged_decode_int8(
                    q_bhe, k_view, scales("k"), v_view, scales("v"), lengths_b, table_layer,
                    pages_per_compute_block=block, interpret=self.interpret,
                )  # fmt: skip
            else:
                k_view, v_view = (as_dtype(merged(pools[f"{n}_pages"]), dtype) for n in "kv")
                out_bhe = paged_attention.paged_decode(
                    q_bhe, k_view, v_view, lengths_b, table_layer,
                    pages_per_compute_block=block, interpret=self.interpret,
                )  # fmt: skip
            return pools, out_bhe.astype(q_bhe.dtype)

        run = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(specs, P(slots), P(slots, heads), P(slots, heads), P(slots, heads), P(slots), P()),
            out_specs=(specs, P(slots, heads)),
            check_vma=False,
        )
        pools, out_bhe = run(
            pools, cache.table_bp, q_bthe[:, 0], k_btke[:, 0], v_btke[:, 0],
            positions_bt[:, 0].astype(jnp.int32), jnp.asarray(layer, jnp.int32),
        )  # fmt: skip
        return out_bhe.reshape(b, 1, h, e), cache._replace(**pools)


def choose_decode_kernel(
    model_config: Any, engine_config: Any, mesh: Any, state_shardings: Any, interpret: bool = False
) -> tuple[DecodeKernel | None, str]:
    """The engine's decode attention for the devices of ``mesh``: ``(DecodeKernel, "pallas_paged")`` where the
    Pallas paged-attention kernel applies (``"pallas_paged_int8"`` on an int8 cache), else
    ``(None, "reference: <why>")`` (the gather-based path).

    Decided from the platform of the mesh's devices (a TPU program from a CPU host gets the kernel, a CPU
    program never does), the model's ``attention`` setting and the kernel's constraints. Raises ``ValueError``
    naming the constraint where the kernel is asked for explicitly (``ModelConfig.attention="splash"``) and a
    constraint fails; "auto" falls back to the reference path instead (the engine logs it once and exposes it
    as ``Engine.decode_attention``)."""
    platform = mesh.devices.flat[0].platform
    interpret = interpret or KERNEL_INTERPRET
    if platform != "tpu" and not interpret:
        return None, f"reference: the engine's devices are {platform}, the paged-attention kernel is TPU-only"
    if model_config.attention not in ("auto", "splash"):
        return None, f"reference: ModelConfig.attention={model_config.attention!r}"
    head_dim = model_config.head_dim
    kv_dtype = jnp.dtype(engine_config.kv_dtype(model_config.compute_dtype))
    pages_per_slot = engine_config.pages_per_slot
    block = paged_attention.pages_per_compute_block(pages_per_slot)
    pool_spec = tuple(state_shardings.k_pages.spec) + (None,) * 5
    slot_spec = (*state_shardings.lengths_b.spec, None)
    as_axes = lambda entry: () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    # The int8 kernel's blocks are whole pages (``paged_attention_int8``): no block rule of its own.
    problems = [] if is_quantized(kv_dtype) else paged_attention.problems(head_dim, kv_dtype.name, engine_config.page)
    if as_axes(pool_spec[2]) != as_axes(slot_spec[0]):
        problems.append(
            f"the pool's pages are split over {as_axes(pool_spec[2])} but the slots over {as_axes(slot_spec[0])} "
            f"(EngineConfig.num_pages={engine_config.pool_pages} must split like max_slots={engine_config.max_slots})"
        )
    if problems:
        if model_config.attention == "splash":
            raise ValueError("the Pallas paged-attention kernel cannot decode this engine: " + "; ".join(problems))
        return None, "reference: " + "; ".join(problems)
    head_axes = as_axes(pool_spec[0])
    kernel = DecodeKernel(mesh, as_axes(slot_spec[0]), head_axes[0] if head_axes else None, block, interpret)
    return kernel, "pallas_paged_int8" if is_quantized(kv_dtype) else "pallas_paged"
