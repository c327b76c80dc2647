"""A hand-computable mock engine and a toy environment, for testing the runner without a model.

``MockEngine`` has the host API of ``trace_jax.rollout.engine.Engine`` (prefill / insert / bulk_insert /
extend / generate / free_resource, the same stop rules and ``GenerateOutput``) but its "model" is a plain
Python ``policy(history, turn, seed) -> token``, every token's log-probabilities are fixed constants and the
"hidden state" after a history is ``[len(history), sum(history)]``. A test can therefore predict every
token, every stop and every anchor feature by hand.

``ToyEnv`` is a tiny stateless ``AgentEnv``: a turn is a *move* token followed by the stop pair
``</act> = [2, 3]``; non-final turns get the observation ``[OBS, FILLER + depth]``; the final turn
(``depth == max_turns``) is rewarded 1 when its move is odd. ``toy_policy`` plays move ``GOOD`` (5) or
``BAD`` (6) at depth ``d`` according to bit ``d`` of the continuation's seed, so a rollout's reward is bit
``max_turns - 1`` of the seed of the continuation that played its last turn.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from trace_jax.envs.base import TurnResult
from trace_jax.rollout.engine import EngineConfig, GenerateOutput, StopReason

Policy = Callable[[np.ndarray, list[int], int], int]

# Fixed per-token numbers the mock reports, so tests can check they reach the trees unchanged.
MOCK_LOGPROB, MOCK_SAMPLE_LOGPROB, MOCK_ENTROPY = -0.5, -0.25, 0.75


def sum_policy(history: np.ndarray, turn: list[int], seed: int, vocab: int = 32) -> int:
    """Default mock policy: ``(sum(history) + seed) % vocab``."""
    return int((int(np.sum(history)) + seed) % vocab)


def mock_hidden(history: Sequence[int]) -> np.ndarray:
    """The mock's "final hidden state" after ``history``: float32 ``[len, sum]``."""
    return np.asarray([len(history), int(np.sum(history))], np.float32)


@dataclasses.dataclass
class MockPrefix:
    """Prefilled rows (host lists) and their hidden states float32 [n, 2]."""

    rows: list[list[int]]
    hidden_nd: np.ndarray


@dataclasses.dataclass
class _Slot:
    history: list[int]
    seed: int
    turn: list[int] = dataclasses.field(default_factory=list)
    turn_limit: int = 0
    reason: int = StopReason.RUNNING


@dataclasses.dataclass
class MockState:
    slots: list[_Slot | None]
    stop_sequences: list[list[int]]
    eos_ids: list[int]


class MockEngine:
    """Host-only engine with ``Engine``'s API and stop rules; see the module docstring."""

    def __init__(self, config: EngineConfig | None = None, policy: Policy = sum_policy):
        self.config = config or EngineConfig(max_slots=4, max_len=256, steps_per_call=8, max_turn_tokens=16)
        self.policy = policy
        self.counters: collections.Counter[str] = collections.Counter()

    @property
    def max_concurrent_decodes(self) -> int:
        return self.config.max_slots

    @property
    def hidden_size(self) -> int:
        return 2

    def init_decode_state(self, stop_sequences: Sequence[Sequence[int]] = (), eos_ids: Sequence[int] = ()) -> MockState:
        return MockState([None] * self.config.max_slots, [list(s) for s in stop_sequences], list(eos_ids))

    def prefill(self, params: Any, tokens: Sequence[int], true_length: int | None = None) -> MockPrefix:
        tokens = list(tokens)[: len(tokens) if true_length is None else true_length]
        return self.prefill_many(params, [tokens])

    def prefill_many(self, params: Any, sequences: Sequence[Sequence[int]]) -> MockPrefix:
        rows = [[int(t) for t in seq] for seq in sequences]
        if any(len(r) > self.config.max_len for r in rows):
            raise ValueError(f"prefill sequence longer than EngineConfig.max_len={self.config.max_len}")
        self.counters["prefill_calls"] += 1
        self.counters["prefill_sequences"] += len(rows)
        self.counters["prefill_tokens"] += sum(len(r) for r in rows)
        return MockPrefix(rows, np.stack([mock_hidden(r) for r in rows]))

    def insert(self, prefix: MockPrefix, state: MockState, slot: int, seed: int = 0, turn_limit=None) -> MockState:
        return self.insert_rows(prefix, state, [0], [slot], [seed], turn_limit)

    def bulk_insert(self, prefix: MockPrefix, state: MockState, slots, seeds=None, turn_limit=None) -> MockState:
        seeds = list(range(len(slots))) if seeds is None else seeds
        return self.insert_rows(prefix, state, [0] * len(slots), slots, seeds, turn_limit)

    def insert_rows(self, prefix, state, rows, slots, seeds, turn_limit=None) -> MockState:
        limit = self.config.max_turn_tokens if turn_limit is None else turn_limit
        for row, slot, seed in zip(rows, slots, seeds, strict=True):
            state.slots[slot] = _Slot(list(prefix.rows[row]), int(seed), turn_limit=limit)
        return state

    def extend(
        self, params: Any, state: MockState, tokens_by_slot: Mapping[int, Sequence[int]], turn_limit=None
    ) -> tuple[MockState, np.ndarray]:
        hidden = np.zeros((self.config.max_slots, 2), np.float32)
        for slot, ids in tokens_by_slot.items():
            current = state.slots[slot]
            current.history += [int(t) for t in ids]
            current.turn, current.reason = [], StopReason.RUNNING
            current.turn_limit = self.config.max_turn_tokens if turn_limit is None else turn_limit
            hidden[slot] = mock_hidden(current.history)
            self.counters["extend_tokens"] += len(ids)
        return state, hidden

    def _end_reason(self, state: MockState, slot: _Slot) -> int:
        if any(len(s) <= len(slot.turn) and slot.turn[-len(s) :] == s for s in state.stop_sequences):
            return StopReason.STOP_SEQUENCE
        if slot.turn[-1] in state.eos_ids:
            return StopReason.EOS
        if len(slot.turn) >= slot.turn_limit:
            return StopReason.TURN_LIMIT
        if len(slot.history) >= self.config.max_len:
            return StopReason.CONTEXT_FULL
        return StopReason.RUNNING

    def generate(
        self, params: Any, state: MockState, refill_after: int | None = None
    ) -> tuple[MockState, GenerateOutput]:
        b, n = self.config.max_slots, self.config.steps_per_call
        tokens = np.zeros((b, n), np.int32)
        num = np.zeros(b, np.int32)
        after = b + 1 if refill_after is None else max(refill_after, 1)
        ended = steps = 0
        running = lambda s: s is not None and s.reason == StopReason.RUNNING
        while steps < n and ended < after and any(running(s) for s in state.slots):
            for i, slot in enumerate(state.slots):
                if not running(slot):
                    continue
                token = int(self.policy(np.asarray(slot.history, np.int32), list(slot.turn), slot.seed))
                slot.history.append(token)
                slot.turn.append(token)
                tokens[i, num[i]] = token
                num[i] += 1
                slot.reason = self._end_reason(state, slot)
                ended += slot.reason != StopReason.RUNNING
            steps += 1
        self.counters["decode_tokens"] += int(num.sum())
        reasons = [StopReason.IDLE if s is None else s.reason for s in state.slots]
        hidden = np.stack([np.zeros(2, np.float32) if s is None else mock_hidden(s.history) for s in state.slots])
        full = lambda value: np.full((b, n), value, np.float32)
        out = GenerateOutput(
            tokens, full(MOCK_LOGPROB), full(MOCK_SAMPLE_LOGPROB), full(MOCK_ENTROPY), num,
            np.asarray(reasons, np.int32), hidden, steps,
        )  # fmt: skip
        return state, out

    def free_resource(self, state: MockState, slot: int) -> MockState:
        state.slots[slot] = None
        return state


# ----------------------------------------------------------------------------------------- toy env
EOS, STOP_A, STOP_B, OBS, GOOD, BAD, FILLER = 1, 2, 3, 4, 5, 6, 7


@dataclasses.dataclass
class ToyEnv:
    """A stateless ``AgentEnv`` whose rewards follow from the turn ids alone (see the module docstring).

    Task ``t`` renders the prompt ``[FILLER + t % 8] * (1 + t % 3)``. A turn containing EOS ends the rollout
    with reward 0 (``info["format_error"]``); a truncated turn does too when ``truncation_ends``.
    """

    max_turns: int = 2
    truncation_ends: bool = True
    stop_sequences: tuple[tuple[int, ...], ...] = ((STOP_A, STOP_B),)

    def prompt_ids(self, task: Any) -> np.ndarray:
        t = int(task)
        return np.full(1 + t % 3, FILLER + t % 8, np.int32)

    def step(self, task: Any, depth: int, turn_ids: np.ndarray, truncated: bool = False) -> TurnResult:
        turn_ids = np.asarray(turn_ids, np.int32)
        if EOS in turn_ids or (truncated and self.truncation_ends) or turn_ids.size == 0:
            return TurnResult(np.zeros(0, np.int32), True, 0.0, {"format_error": True})
        if depth >= self.max_turns:
            return TurnResult(np.zeros(0, np.int32), True, float(turn_ids[0] % 2 == 1), {"move": int(turn_ids[0])})
        return TurnResult(np.asarray([OBS, FILLER + depth], np.int32), False, 0.0, {"move": int(turn_ids[0])})


def toy_policy(history: np.ndarray, turn: list[int], seed: int) -> int:
    """Plays ``[move, STOP_A, STOP_B]`` per turn; the move at depth d (= observations so far) is seed bit d."""
    if not turn:
        depth = int(np.sum(np.asarray(history) == OBS))
        return GOOD if (seed >> depth) & 1 else BAD
    return STOP_A if len(turn) == 1 else STOP_B
