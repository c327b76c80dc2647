"""What the engine's calls take and return: the device state, the host's view of the slots, kept prefixes,
append items and the one packed ``generate`` output (see ``trace_jax.rollout.engine.engine``)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from trace_jax.rollout.engine import pages


class StopReason(enum.IntEnum):
    """Why a slot's turn ended (``RUNNING`` while it goes on; ``IDLE`` for a free slot)."""

    RUNNING = 0
    STOP_SEQUENCE = 1
    EOS = 2
    TURN_LIMIT = 3
    CONTEXT_FULL = 4
    IDLE = 5


class DecodeState(NamedTuple):
    """Everything the decode slots carry between calls (device pytree; donated by every program).

    k_pages / v_pages: the KV page pool [kv_heads, layers, pages, page_size, head_dim], the cache dtype's
      values or their bits (``trace_jax.rollout.engine.pages.pool_dtype``); int8 values with an int8 cache.
    lengths_b: int32 [B] valid cache positions of each slot.
    logits_bv: float32 [B, V] next-token logits of each slot (from its last forward).
    hidden_bd: float32 [B, D] final hidden state at each slot's last token.
    keys_bk: uint32 [B, key_size] raw PRNG key data of each slot's sequence.
    sampled_b: int32 [B] tokens sampled since the sequence started (the step of its key stream).
    turn_tokens_b / turn_limit_b: int32 [B] tokens sampled in the current turn / its limit.
    stop_reason_b: int32 [B] ``StopReason`` of the current turn. greedy_b: bool [B] argmax decoding.
    recent_bw: int32 [B, W] the turn's last W sampled ids (-1 before the turn's first), for stop matching.
    stops_sw: int32 [S, W] stop sequences right-aligned, left-padded with -1; stop_len_s: int32 [S] (0 unused).
    eos_e: int32 [E] EOS ids (-1 unused).
    bank_logits_rv / bank_hidden_rd: float32 [R, V] / [R, D] next-token logits and hidden state of kept
      prefixes (``Prefix``), the rows forks start from; R = max_slots.
    k_scales / v_scales: float32 [kv_heads, layers, pages, page_size], the int8 cache's scales (``None`` for a
      float cache; ``trace_jax.rollout.engine.pages``).
    """

    k_pages: jax.Array
    v_pages: jax.Array
    lengths_b: jax.Array
    logits_bv: jax.Array
    hidden_bd: jax.Array
    keys_bk: jax.Array
    sampled_b: jax.Array
    turn_tokens_b: jax.Array
    turn_limit_b: jax.Array
    stop_reason_b: jax.Array
    greedy_b: jax.Array
    recent_bw: jax.Array
    stops_sw: jax.Array
    stop_len_s: jax.Array
    eos_e: jax.Array
    bank_logits_rv: jax.Array
    bank_hidden_rd: jax.Array
    k_scales: jax.Array | None = None
    v_scales: jax.Array | None = None


@dataclasses.dataclass
class SlotState:
    """The engine's state as the host holds it: the device pytree plus host bookkeeping that never needs a
    device->host copy (lengths and running flags are updated from ``generate``'s one packed result)."""

    device: DecodeState
    pool: pages.PagePool
    lengths: np.ndarray  # int32 [B]
    running: np.ndarray  # bool [B]
    active: np.ndarray  # bool [B]: holds a sequence (not freed)
    bank_free: list[int] = dataclasses.field(default_factory=list)  # unused prefix bank rows
    stop_tables: tuple[np.ndarray, ...] = ()  # host copy of (stops_sw, stop_len_s, eos_e)


@dataclasses.dataclass
class Prefix:
    """A kept prefix (host handle): its bank row, its held KV pages and its length. Fork from it any number of
    times, while or after its slot decodes on; ``Engine.drop_prefix`` gives its pages and row back.

    A *held* prefix (``AppendItem.hold``) has pages but no bank row (``row is None``): it cannot be forked
    directly, but an ``AppendItem.start`` reuses its pages, so a sequence that extends it computes only the
    ids past it (and its last id again, for the next-token logits)."""

    row: int | None
    pages: list[int]
    length: int


class AppendResult(NamedTuple):
    """padded_hidden: float32 [rows >= k, D] device array, row i (< k) the final hidden state at ``items[i]``'s
    last id (rows past k are padding; index it on the host after one fetch, not on the device per call);
    prefixes: the ``Prefix`` of each item appended with ``keep=True`` (``None`` for the others);
    held: the pages-only ``Prefix`` of each item appended with ``hold=True`` (``None`` for the others);
    routing: with ``EngineConfig.routing_replay``, int32 [rows, width, sparse layers, top-k] device array, the
    experts each appended id went to in every sparse layer (None without); routing_spans: where it holds each
    item's ids (``trace_jax.rollout.engine.append.routing_spans``; read with ``item_routing`` after one fetch)."""

    padded_hidden: jax.Array
    prefixes: list[Prefix | None]
    held: list[Prefix | None] | None = None
    routing: jax.Array | None = None
    routing_spans: list[tuple[int, list[tuple[int, int]]]] | None = None

    @staticmethod
    def item_routing(routing: np.ndarray, span: tuple[int, list[tuple[int, int]]]) -> tuple[int, np.ndarray]:
        """(index in the item's ids of its first computed id, int32 [computed ids, sparse layers, top-k]) from
        a host copy of ``routing`` and the item's entry of ``routing_spans``."""
        first, rows = span
        parts = [routing[row, :count] for row, count in rows]
        return first, np.concatenate(parts, axis=0) if parts else np.zeros((0, *routing.shape[2:]), np.int32)

    @property
    def hidden(self) -> jax.Array:
        """float32 [k, D]: the items' rows of ``padded_hidden`` (a device slice: one more dispatch)."""
        return self.padded_hidden[: len(self.prefixes)]


@dataclasses.dataclass(frozen=True)
class AppendItem:
    """Append ``ids`` to ``slot``; ``reset`` starts a fresh sequence there with PRNG ``seed`` and decoding
    mode ``greedy`` (both ignored when continuing: a sequence keeps its own); ``keep`` keeps the resulting
    history as a ``Prefix`` to fork from; ``hold`` holds its pages as a pages-only ``Prefix``.

    ``start`` (with ``reset``): a held or kept ``Prefix`` whose ids are the first ``start.length`` of ``ids``;
    the slot shares its pages (the last partly filled one copied) and computes only ``ids[start.length - 1:]``.
    """

    slot: int
    ids: Sequence[int] | np.ndarray
    reset: bool = False
    seed: int = 0
    greedy: bool = False
    turn_limit: int | None = None
    keep: bool = False
    hold: bool = False
    start: Prefix | None = None


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """Host copy of one ``generate`` call. Row b's tokens of this call are ``tokens[b, :num_tokens[b]]``.

    tokens: int32 [B, N]; logprobs (untempered policy), sample_logprobs, entropies: float32 [B, N].
    num_tokens: int32 [B] tokens each slot sampled in this call. stop_reason: int32 [B] ``StopReason``
    after the call (``RUNNING``: the turn goes on at the next call). hidden: float32 [B, D] final hidden
    state at each slot's last token. steps: decode steps the loop ran. routing: int32 [B, N, sparse layers,
    top-k] the experts each sampled token went to (``EngineConfig.routing_replay``; None without).
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    sample_logprobs: np.ndarray
    entropies: np.ndarray
    num_tokens: np.ndarray
    stop_reason: np.ndarray
    hidden: np.ndarray
    steps: int
    routing: np.ndarray | None = None

    @classmethod
    def unpack(
        cls, packed: np.ndarray, hidden_size: int, routing_shape: tuple[int, int] | None = None
    ) -> GenerateOutput:
        """Reads the ``[B, 4N + 3 + D (+ N x R)]`` float32 array ``generate`` returns (ints travel as bit
        patterns); ``routing_shape`` (sparse layers, top-k) when the engine records routing (R their product)."""
        packed = np.asarray(packed, np.float32)
        as_int = packed.view(np.int32)
        per_token = 4 + (int(np.prod(routing_shape)) if routing_shape else 0)
        n = (packed.shape[1] - 3 - hidden_size) // per_token
        routing = None
        if routing_shape:
            routing = as_int[:, 4 * n + 3 + hidden_size :].reshape(-1, n, *routing_shape).copy()
        return cls(
            tokens=as_int[:, :n].copy(),
            logprobs=packed[:, n : 2 * n].copy(),
            sample_logprobs=packed[:, 2 * n : 3 * n].copy(),
            entropies=packed[:, 3 * n : 4 * n].copy(),
            num_tokens=as_int[:, 4 * n].copy(),
            stop_reason=as_int[:, 4 * n + 1].copy(),
            hidden=packed[:, 4 * n + 3 : 4 * n + 3 + hidden_size].copy(),
            steps=int(as_int[0, 4 * n + 2]),
            routing=routing,
        )


class PendingGenerate:
    """A dispatched ``generate`` call; ``result()`` fetches its one packed array and updates the host state."""

    def __init__(self, engine: Any, state: SlotState, packed: jax.Array):
        self._engine, self._state, self._packed = engine, state, packed
        self.decoded = state.running.copy()  # bool [B]: the slots this call decodes
        self._out: GenerateOutput | None = None

    def result(self) -> GenerateOutput:
        """The call's output; host lengths and running flags of the slots it decoded are updated. Slots
        appended to or forked while it ran keep their new state (its output rows for them are stale)."""
        if self._out is None:
            engine = self._engine
            out = GenerateOutput.unpack(np.asarray(self._packed), engine.hidden_size, engine.routing_shape)
            state, decoded = self._state, self.decoded
            state.lengths[decoded] += out.num_tokens[decoded]
            state.running[decoded] &= out.stop_reason[decoded] == StopReason.RUNNING
            out.stop_reason[~state.active] = StopReason.IDLE
            counters = self._engine.counters
            counters["decode_steps"] += out.steps
            counters["decode_tokens"] += int(out.num_tokens.sum())
            self._out, self._packed = out, None
        return self._out
