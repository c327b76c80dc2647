"""The ``append`` program: prefill and prefill-extend of many slots in one call, in fixed-width chunks.

Each ``AppendItem`` appends ids to a slot, either starting a fresh sequence there (``reset``: a prompt or an
anchor history) or continuing it (an observation). ``pack_append`` does the host half (page reservations,
lengths, kept prefixes) and packs the call into two int32 arrays; ``append_program`` is the device half (the
model runs on the named slots' pages; each slot's next-token logits, hidden state, key and turn counters are
set).

Chunks. An item's ids are cut into chunks of ``EngineConfig.append_width`` ids, one row each, and the rows
are padded to a row bucket (``EngineConfig.append_rows``), so a call runs about as many positions as it
appends (a long prompt is several rows, a short observation one) from a handful of compiled shapes. The
chunks of one item run in the same call: the model writes every row's keys and values of a layer into the
pages before any row reads them, and a chunk attends through its slot's page table to every position below
its own, so chunk j sees chunks 0..j-1 of that layer exactly as one long row would.

Packed layout (``[rows, width + 12]``): ids in the first ``width`` columns, then slot, number of new ids,
reset, seed, greedy, turn limit, prefix bank row, start length (a reset row continues a shared prefix of
this many positions), the page to copy for that prefix's partly filled last page (from, to), the chunk's
offset in the item's ids and whether it is the item's last chunk. Row i < len(items) is item i's last chunk
(the only row that sets the slot's state); earlier chunks follow. Padding rows name slot ``B`` (every
scatter drops them) and their page tables point at the trash page.

Routing record (``EngineConfig.routing_replay``): the program also returns the experts every appended id went
to in each sparse layer, per row and column (``[rows, width, sparse layers, top-k]``); ``routing_spans`` says
which rows and columns hold each item's ids, so the host reads them after one fetch. Without the record the
program and its outputs are what they are for a dense model.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax.buckets import bucket
from trace_jax.rollout.engine import pages
from trace_jax.rollout.engine.config import EngineConfig
from trace_jax.rollout.engine.slots import AppendItem, DecodeState, Prefix, SlotState, StopReason

# slot, num_new, reset, seed, greedy, limit, bank, start length, copy from, copy to, chunk offset, last chunk
APPEND_FIELDS = 12


def pack_append(
    config: EngineConfig, state: SlotState, items: Sequence[AppendItem]
) -> tuple[np.ndarray, np.ndarray, int, list[Prefix | None], list[Prefix | None]]:
    """Host half of ``append``: updates ``state``'s bookkeeping and returns (page tables int32 [rows, P],
    packed int32 [rows, width + 12], the attention window (an ``append_window_buckets`` entry >= every
    item's new length), the ``Prefix`` kept / held for each item or ``None``)."""
    if not items:
        raise ValueError("append needs at least one item")
    cfg = config
    slots = [int(item.slot) for item in items]
    if any(not 0 <= s < cfg.max_slots for s in slots) or len(set(slots)) != len(slots):
        raise ValueError(f"slots {slots} must be distinct and in [0, {cfg.max_slots})")
    for item in items:
        if item.start is not None and not (item.reset and 0 < item.start.length <= len(item.ids)):
            raise ValueError(
                f"slot {item.slot}: AppendItem.start needs reset=True and a prefix of at most {len(item.ids)} ids, "
                f"got {item.start.length}"
            )
    # A started item recomputes its prefix's last id (the next-token logits are not kept with held pages).
    skips = [0 if item.start is None else item.start.length - 1 for item in items]
    width = cfg.append_width
    chunks = [max(-(-(len(item.ids) - skip) // width), 1) for item, skip in zip(items, skips, strict=True)]
    rows = bucket(sum(chunks), cfg.append_rows, "append rows (chunks)")
    packed = np.zeros((rows, width + APPEND_FIELDS), np.int32)
    packed[:, width] = packed[:, width + 6] = cfg.max_slots  # padding targets row B: every scatter drops it
    kept: list[Prefix | None] = []
    held: list[Prefix | None] = []
    table = np.full((rows, cfg.pages_per_slot), pages.TRASH_PAGE, np.int32)
    extra = len(items)  # the next row for a chunk before an item's last
    longest = 0
    for row, (item, skip, count) in enumerate(zip(items, skips, chunks, strict=True)):
        ids = np.asarray(item.ids, np.int32).reshape(-1)[skip:]
        copy = (pages.TRASH_PAGE, pages.TRASH_PAGE)
        if item.reset:
            if not len(ids):
                raise ValueError(f"cannot start slot {item.slot} from an empty sequence")
            state.pool.release(item.slot)
            if item.start is not None:
                copy = state.pool.fork(item.start.pages, item.slot, skip)
            state.lengths[item.slot] = skip
        end = int(state.lengths[item.slot]) + len(ids)
        if end > cfg.max_len:
            raise ValueError(
                f"slot {item.slot} would hold {end} tokens but EngineConfig.max_len={cfg.max_len}; raise max_len"
            )
        state.pool.reserve(item.slot, end)
        longest = max(longest, end)
        limit = cfg.max_turn_tokens if item.turn_limit is None else int(item.turn_limit)
        state.lengths[item.slot] = end
        state.running[item.slot] = state.active[item.slot] = True
        if item.keep and not state.bank_free:
            raise RuntimeError(f"all {cfg.max_slots} prefix bank rows are kept; drop_prefix the unused ones")
        kept.append(Prefix(state.bank_free.pop(), state.pool.hold(item.slot, end), end) if item.keep else None)
        held.append(Prefix(None, state.pool.hold(item.slot, end), end) if item.hold else None)
        bank = cfg.max_slots if kept[-1] is None else kept[-1].row
        for chunk in range(count):
            last = chunk == count - 1
            target = row if last else extra
            extra += 0 if last else 1
            piece = ids[chunk * width : (chunk + 1) * width]
            packed[target, : len(piece)] = piece
            table[target] = state.pool.table[item.slot]
            fields = (item.seed, item.greedy, limit, bank if last else cfg.max_slots, skip)
            move = copy if last else (pages.TRASH_PAGE, pages.TRASH_PAGE)
            packed[target, width:] = (item.slot, len(piece), item.reset, *fields, *move, chunk * width, last)
    window = bucket(longest, cfg.append_window_buckets, "append window")
    return table, packed, window, kept, held


def routing_spans(packed: np.ndarray, items: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """Where an append's routing record (``append_program``'s third output) holds each item's ids, read from the
    packed call (``pack_append``): per item, (index in ``item.ids`` of its first computed id, [(row, ids in that
    row)] in id order). A started item (``AppendItem.start``) computes its ids from its prefix's last one on;
    the ids before it were computed (and recorded) by the append that filled the shared pages."""
    width = packed.shape[1] - APPEND_FIELDS
    slot, num_new, skip, offset = (packed[:, width + i] for i in (0, 1, 7, 10))
    spans = []
    for i in range(items):
        rows = sorted(np.flatnonzero(slot == slot[i]).tolist(), key=lambda r: offset[r])
        spans.append((int(skip[i]), [(r, int(num_new[r])) for r in rows]))
    return spans


def seed_keys(seed_k: jax.Array) -> jax.Array:
    """uint32 [k, key_size] raw PRNG key data of each seed (a sequence's whole randomness)."""
    return jax.vmap(lambda s: jax.random.key_data(jax.random.key(s)))(seed_k.astype(jnp.uint32))


def append_program(
    graphdef: nnx.GraphDef, config: EngineConfig, window: int, params, state: DecodeState, table_kp, packed_kc
) -> tuple[DecodeState, jax.Array] | tuple[DecodeState, jax.Array, jax.Array]:
    """Device half of ``append`` (the state is donated); attention reads each row's first ``window`` positions
    (static). Returns the new state and float32 [h, D], the final hidden state at the last id of rows
    ``0..h-1`` (``h = min(rows, max_slots)``: row i < len(items) is item i's); with ``routing_replay``, also
    int32 [rows, width, sparse layers, top-k], the experts of every row's ids (``routing_spans``)."""
    model = nnx.merge(graphdef, params)
    cfg = config
    width = packed_kc.shape[1] - APPEND_FIELDS
    tokens_kt = packed_kc[:, :width]
    fields = (packed_kc[:, width + i] for i in range(APPEND_FIELDS))
    slot_k, num_new_k, reset_k, seed_k, greedy_k, limit_k, bank_k, start_k, copy_from_k, copy_to_k, offset_k, _ = fields
    rows_k = jnp.minimum(slot_k, cfg.max_slots - 1)  # padding rows compute on a copy, then drop
    reset_k = reset_k > 0
    lengths_k = jnp.where(reset_k, start_k, state.lengths_b[rows_k]) + offset_k
    # Copy-on-write of started rows' shared last pages first, then the model writes the new keys / values
    # straight into the named slots' pages and reads their whole history through the page tables (padding
    # rows' tables point at the trash page).
    pools = pages.copy_pools(state, copy_from_k, copy_to_k)
    dtype = cfg.kv_dtype(model.config.compute_dtype)
    cache = pages.PagedKVCache(table_bp=table_kp, lengths=lengths_k, window_w=jnp.arange(window), dtype=dtype, **pools)
    if cfg.routing_replay:
        hidden_ktd, cache, extra = model.forward_hidden(tokens_kt, cache, num_new_k, record_routing=True)
    else:
        hidden_ktd, cache = model.hidden(tokens_kt, cache, num_new_k)
    # Only the first h rows can be an item's last chunk (items <= slots): the slot state is set from them.
    h = min(tokens_kt.shape[0], cfg.max_slots)
    last_k = packed_kc[:h, -1] > 0
    target_h = jnp.where(last_k, slot_k[:h], cfg.max_slots)
    num_new_h, rows_h, reset_h = num_new_k[:h], rows_k[:h], reset_k[:h]
    last_hd = hidden_ktd[jnp.arange(h), jnp.maximum(num_new_h - 1, 0)]
    grown_h1 = (num_new_h > 0)[:, None]
    hidden_hd = jnp.where(grown_h1, last_hd.astype(jnp.float32), state.hidden_bd[rows_h])
    logits_hv = jnp.where(grown_h1, model.logits(last_hd), state.logits_bv[rows_h])
    put = lambda dst, src: dst.at[target_h].set(src.astype(dst.dtype), mode="drop")
    zeros = jnp.zeros_like(target_h)
    state = state._replace(
        **pages.pool_of(cache),
        lengths_b=put(state.lengths_b, cache.lengths[:h]),
        logits_bv=put(state.logits_bv, logits_hv),
        hidden_bd=put(state.hidden_bd, hidden_hd),
        keys_bk=put(state.keys_bk, jnp.where(reset_h[:, None], seed_keys(seed_k[:h]), state.keys_bk[rows_h])),
        sampled_b=put(state.sampled_b, jnp.where(reset_h, 0, state.sampled_b[rows_h])),
        turn_tokens_b=put(state.turn_tokens_b, zeros),
        turn_limit_b=put(state.turn_limit_b, limit_k[:h]),
        stop_reason_b=put(state.stop_reason_b, zeros + StopReason.RUNNING),
        # Like the seed, greedy is the sequence's: set when it starts, kept when ids are appended.
        greedy_b=put(state.greedy_b, jnp.where(reset_h, greedy_k[:h] > 0, state.greedy_b[rows_h])),
        recent_bw=put(state.recent_bw, jnp.full((h, state.recent_bw.shape[1]), -1, jnp.int32)),
        bank_logits_rv=state.bank_logits_rv.at[bank_k[:h]].set(logits_hv, mode="drop"),
        bank_hidden_rd=state.bank_hidden_rd.at[bank_k[:h]].set(hidden_hd, mode="drop"),
    )
    if cfg.routing_replay:
        return state, hidden_hd, extra.experts_btlk
    return state, hidden_hd
