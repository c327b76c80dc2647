"""The ``append`` program: prefill and prefill-extend of many slots in one call.

Each ``AppendItem`` appends ids to a slot, either starting a fresh sequence there (``reset``: a prompt or an
anchor history) or continuing it (an observation). ``pack_append`` does the host half (page reservations,
lengths, kept prefixes) and packs the call into two int32 arrays; ``append_program`` is the device half (the
model runs on the named slots' pages; each slot's next-token logits, hidden state, key and turn counters are
set).

Packed layout (``[rows, width + 10]``): ids in the first ``width`` columns, then slot, number of new ids,
reset, seed, greedy, turn limit, prefix bank row, start length (a reset row continues a shared prefix of
this many positions), and the page to copy for that prefix's partly filled last page (from, to). Padding
rows name slot ``B`` (every scatter drops them) and their page tables point at the trash page.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax.buckets import bucket
from trace_jax.rollout import pages
from trace_jax.rollout.engine_config import EngineConfig
from trace_jax.rollout.slots import AppendItem, DecodeState, Prefix, SlotState, StopReason

APPEND_FIELDS = 10  # slot, num_new, reset, seed, greedy, limit, bank, start length, copy from, copy to


def pack_append(
    config: EngineConfig, state: SlotState, items: Sequence[AppendItem]
) -> tuple[np.ndarray, np.ndarray, list[Prefix | None], list[Prefix | None]]:
    """Host half of ``append``: updates ``state``'s bookkeeping and returns (page tables int32 [rows, P],
    packed int32 [rows, width + 10], the ``Prefix`` kept / held for each item or ``None``)."""
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
    longest = max(len(item.ids) - skip for item, skip in zip(items, skips, strict=True))
    width = cfg.length_bucket(max(longest, 1), "appended ids")
    rows = bucket(len(items), cfg.rows, "append rows")
    packed = np.zeros((rows, width + APPEND_FIELDS), np.int32)
    packed[:, width] = packed[:, width + 6] = cfg.max_slots  # padding targets row B: every scatter drops it
    kept: list[Prefix | None] = []
    held: list[Prefix | None] = []
    table = np.full((rows, cfg.pages_per_slot), pages.TRASH_PAGE, np.int32)
    for row, (item, skip) in enumerate(zip(items, skips, strict=True)):
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
        limit = cfg.max_turn_tokens if item.turn_limit is None else int(item.turn_limit)
        packed[row, : len(ids)] = ids
        table[row] = state.pool.table[item.slot]
        state.lengths[item.slot] = end
        state.running[item.slot] = state.active[item.slot] = True
        if item.keep and not state.bank_free:
            raise RuntimeError(f"all {cfg.max_slots} prefix bank rows are kept; drop_prefix the unused ones")
        kept.append(Prefix(state.bank_free.pop(), state.pool.hold(item.slot, end), end) if item.keep else None)
        held.append(Prefix(None, state.pool.hold(item.slot, end), end) if item.hold else None)
        bank = cfg.max_slots if kept[-1] is None else kept[-1].row
        fields = (item.slot, len(ids), item.reset, item.seed, item.greedy, limit, bank, skip, *copy)
        packed[row, width:] = fields
    return table, packed, kept, held


def seed_keys(seed_k: jax.Array) -> jax.Array:
    """uint32 [k, key_size] raw PRNG key data of each seed (a sequence's whole randomness)."""
    return jax.vmap(lambda s: jax.random.key_data(jax.random.key(s)))(seed_k.astype(jnp.uint32))


def append_program(
    graphdef: nnx.GraphDef, config: EngineConfig, params, state: DecodeState, table_kp, packed_kc
) -> tuple[DecodeState, jax.Array]:
    """Device half of ``append`` (the state is donated). Returns the new state and float32 [rows, D], the final
    hidden state at each row's last id."""
    model = nnx.merge(graphdef, params)
    cfg = config
    width = packed_kc.shape[1] - APPEND_FIELDS
    tokens_kt = packed_kc[:, :width]
    slot_k, num_new_k, reset_k, seed_k, greedy_k, limit_k, bank_k, start_k, copy_from_k, copy_to_k = (
        packed_kc[:, width + i] for i in range(APPEND_FIELDS)
    )
    k = tokens_kt.shape[0]
    rows_k = jnp.minimum(slot_k, cfg.max_slots - 1)  # padding rows compute on a copy, then drop
    reset_k = reset_k > 0
    lengths_k = jnp.where(reset_k, start_k, state.lengths_b[rows_k])
    # Copy-on-write of started rows' shared last pages first, then the model writes the new keys / values
    # straight into the named slots' pages and reads their whole history through the page tables (padding
    # rows' tables point at the trash page).
    k_pages = pages.copy_pages(state.k_pages, copy_from_k, copy_to_k)
    v_pages = pages.copy_pages(state.v_pages, copy_from_k, copy_to_k)
    cache = pages.PagedKVCache(k_pages, v_pages, table_kp, lengths_k, jnp.arange(cfg.max_len))
    hidden_ktd, cache = model.hidden(tokens_kt, cache, num_new_k)
    last_kd = hidden_ktd[jnp.arange(k), jnp.maximum(num_new_k - 1, 0)]
    grown_k1 = (num_new_k > 0)[:, None]
    hidden_kd = jnp.where(grown_k1, last_kd.astype(jnp.float32), state.hidden_bd[rows_k])
    logits_kv = jnp.where(grown_k1, model.logits(last_kd), state.logits_bv[rows_k])
    put = lambda dst, src: dst.at[slot_k].set(src.astype(dst.dtype), mode="drop")
    zeros = jnp.zeros_like(slot_k)
    state = state._replace(
        k_pages=cache.k_pages,
        v_pages=cache.v_pages,
        lengths_b=put(state.lengths_b, cache.lengths),
        logits_bv=put(state.logits_bv, logits_kv),
        hidden_bd=put(state.hidden_bd, hidden_kd),
        keys_bk=put(state.keys_bk, jnp.where(reset_k[:, None], seed_keys(seed_k), state.keys_bk[rows_k])),
        sampled_b=put(state.sampled_b, jnp.where(reset_k, 0, state.sampled_b[rows_k])),
        turn_tokens_b=put(state.turn_tokens_b, zeros),
        turn_limit_b=put(state.turn_limit_b, limit_k),
        stop_reason_b=put(state.stop_reason_b, zeros + StopReason.RUNNING),
        # Like the seed, greedy is the sequence's: set when it starts, kept when ids are appended.
        greedy_b=put(state.greedy_b, jnp.where(reset_k, greedy_k > 0, state.greedy_b[rows_k])),
        recent_bw=put(state.recent_bw, jnp.full((k, state.recent_bw.shape[1]), -1, jnp.int32)),
        bank_logits_rv=state.bank_logits_rv.at[bank_k].set(logits_kv, mode="drop"),
        bank_hidden_rd=state.bank_hidden_rd.at[bank_k].set(hidden_kd, mode="drop"),
    )
    return state, hidden_kd
