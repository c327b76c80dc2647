"""The ``fork`` program: k new sequences from kept prefixes, sharing their KV pages (nothing recomputed).

``pack_fork`` does the host half: each child's page table points at the prefix's full pages (reference
counts) and gets a fresh page for the partly filled last one (``trace_jax.rollout.engine.pages.PagePool.fork``);
``fork_program`` copies those last pages on device and starts each child's turn from the prefix's banked
next-token logits and hidden state, with its own PRNG seed.

Packed layout (``[rows, 8]``): bank row, child slot, seed, copy-from page, copy-to page, greedy, turn limit,
length. Padding rows name child ``B`` (every scatter drops them) and copy the trash page onto itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from trace_jax.buckets import bucket
from trace_jax.rollout.engine import pages
from trace_jax.rollout.engine.append import seed_keys
from trace_jax.rollout.engine.config import EngineConfig
from trace_jax.rollout.engine.slots import DecodeState, Prefix, SlotState, StopReason

FIELDS = 8


def pack_fork(
    config: EngineConfig,
    state: SlotState,
    sources: Sequence[Prefix],
    children: Sequence[int],
    seeds: Sequence[int],
    greedy: bool,
    turn_limit: int | None,
) -> np.ndarray:
    """Host half of ``fork``: updates ``state``'s page tables and bookkeeping, returns int32 [rows, 8]."""
    cfg = config
    if not len(sources) == len(children) == len(seeds):
        raise ValueError(f"fork got {len(sources)} sources, {len(children)} children and {len(seeds)} seeds")
    if any(not 0 <= s < cfg.max_slots for s in children) or len(set(children)) != len(children):
        raise ValueError(f"slots {list(children)} must be distinct and in [0, {cfg.max_slots})")
    rows = bucket(len(children), cfg.rows, "fork rows")
    packed = np.zeros((rows, FIELDS), np.int32)
    packed[:, 1] = cfg.max_slots
    limit = cfg.max_turn_tokens if turn_limit is None else int(turn_limit)
    if any(source.row is None for source in sources):
        raise ValueError("a held prefix (no bank row) cannot be forked; start from it with AppendItem.start")
    for row, (source, child, seed) in enumerate(zip(sources, children, seeds, strict=True)):
        copy = state.pool.fork(source.pages, child, source.length)
        packed[row] = (source.row, child, seed, *copy, greedy, limit, source.length)
        state.lengths[child] = source.length
        state.running[child] = state.active[child] = True
    return packed


def fork_program(state: DecodeState, packed_kc) -> DecodeState:
    """Device half of ``fork`` (the state is donated)."""
    row_k, child_k, seed_k, copy_from_k, copy_to_k, greedy_k, limit_k, length_k = (
        packed_kc[:, i] for i in range(FIELDS)
    )
    put = lambda dst, src: dst.at[child_k].set(src.astype(dst.dtype), mode="drop")
    zeros = jnp.zeros_like(child_k)
    return state._replace(
        **pages.copy_pools(state, copy_from_k, copy_to_k),
        lengths_b=put(state.lengths_b, length_k),
        logits_bv=put(state.logits_bv, state.bank_logits_rv[row_k]),
        hidden_bd=put(state.hidden_bd, state.bank_hidden_rd[row_k]),
        keys_bk=put(state.keys_bk, seed_keys(seed_k)),
        sampled_b=put(state.sampled_b, zeros),
        turn_tokens_b=put(state.turn_tokens_b, zeros),
        turn_limit_b=put(state.turn_limit_b, limit_k),
        stop_reason_b=put(state.stop_reason_b, zeros + StopReason.RUNNING),
        greedy_b=put(state.greedy_b, greedy_k > 0),
        recent_bw=put(state.recent_bw, jnp.full((len(child_k), state.recent_bw.shape[1]), -1, jnp.int32)),
    )
