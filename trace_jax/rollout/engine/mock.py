"""A hand-computable mock engine and a toy environment, for testing the runner without a model.

``MockEngine`` has the host API of ``trace_jax.rollout.engine.engine.Engine`` (append / insert / extend / fork /
generate / generate_async / free_resource, the same stop rules and ``GenerateOutput``) but its "model" is a plain
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
from trace_jax.models import lora
from trace_jax.rollout.engine.engine import AppendItem, AppendResult, EngineConfig, GenerateOutput, Prefix, StopReason

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

    @property
    def running(self) -> np.ndarray:
        return np.asarray([s is not None and s.reason == StopReason.RUNNING for s in self.slots])

    @property
    def lengths(self) -> np.ndarray:
        return np.asarray([0 if s is None else len(s.history) for s in self.slots], np.int32)


@dataclasses.dataclass
class _Done:
    """An already finished ``generate_async`` (the mock decodes synchronously)."""

    decoded: np.ndarray
    out: GenerateOutput

    def result(self) -> GenerateOutput:
        return self.out


class MockEngine:
    """Host-only engine with ``Engine``'s API and stop rules; see the module docstring."""

    def __init__(self, config: EngineConfig | None = None, policy: Policy = sum_policy):
        self.config = config or EngineConfig(max_slots=4, max_len=256, steps_per_call=8, max_turn_tokens=16)
        self.policy = policy
        self.params: Any = None
        self.counters: collections.Counter[str] = collections.Counter()

    @property
    def max_concurrent_decodes(self) -> int:
        return self.config.max_slots

    @property
    def hidden_size(self) -> int:
        return 2

    def set_params(self, params: Any) -> Any:
        self.params = lora.received(self.params, params)
        return self.params

    def init_decode_state(self, stop_sequences: Sequence[Sequence[int]] = (), eos_ids: Sequence[int] = ()) -> MockState:
        return MockState([None] * self.config.max_slots, [list(s) for s in stop_sequences], list(eos_ids))

    def acquire_state(self, stop_sequences: Sequence[Sequence[int]] = (), eos_ids: Sequence[int] = ()) -> MockState:
        return self.init_decode_state(stop_sequences, eos_ids)

    def release_state(self, state: MockState) -> None:
        if any(s is not None for s in state.slots):
            raise ValueError("slots are still active; free them first")

    def append(self, params: Any, state: MockState, items: Sequence[AppendItem]) -> tuple[MockState, AppendResult]:
        hidden = np.zeros((len(items), 2), np.float32)
        kept, held = [], []  # a kept prefix is its history; a held one its length (``start``: ids are the history)
        for row, item in enumerate(items):
            ids = [int(t) for t in item.ids]
            limit = self.config.max_turn_tokens if item.turn_limit is None else item.turn_limit
            if item.reset:
                state.slots[item.slot] = _Slot(ids, int(item.seed), turn_limit=limit)
                self.counters["started_sequences"] += 1
            else:
                current = state.slots[item.slot]
                current.history += ids
                current.turn, current.reason, current.turn_limit = [], StopReason.RUNNING, limit
            if len(state.slots[item.slot].history) > self.config.max_len:
                raise ValueError(f"slot {item.slot} longer than EngineConfig.max_len={self.config.max_len}")
            hidden[row] = mock_hidden(state.slots[item.slot].history)
            kept.append(list(state.slots[item.slot].history) if item.keep else None)
            held.append(Prefix(None, [], len(state.slots[item.slot].history)) if item.hold else None)
            self.counters["append_tokens"] += len(ids)
        self.counters["append_calls"] += 1
        return state, AppendResult(hidden, kept, held)

    def insert(self, params, state, sequences, slots, seeds, *, greedy=False, turn_limit=None):
        items = [
            AppendItem(sl, seq, True, sd, greedy, turn_limit)
            for seq, sl, sd in zip(sequences, slots, seeds, strict=True)
        ]
        return self.append(params, state, items)

    def extend(self, params, state, tokens_by_slot: Mapping[int, Sequence[int]], turn_limit=None):
        return self.append(
            params, state, [AppendItem(s, ids, turn_limit=turn_limit) for s, ids in tokens_by_slot.items()]
        )

    def fork(self, state: MockState, sources, children, seeds, *, greedy=False, turn_limit=None) -> MockState:
        limit = self.config.max_turn_tokens if turn_limit is None else turn_limit
        for source, child, seed in zip(sources, children, seeds, strict=True):
            state.slots[child] = _Slot(list(source), int(seed), turn_limit=limit)
        self.counters["fork_calls"] += 1
        self.counters["forked_sequences"] += len(children)
        return state

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

    def generate_async(self, params: Any, state: MockState, refill_after: int | None = None):
        decoded = state.running
        state, out = self.generate(params, state, refill_after)
        return state, _Done(decoded, out)

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
        self.counters["generate_calls"] += 1
        self.counters["decode_tokens"] += int(num.sum())
        reasons = [StopReason.IDLE if s is None else s.reason for s in state.slots]
        hidden = np.stack([np.zeros(2, np.float32) if s is None else mock_hidden(s.history) for s in state.slots])
        full = lambda value: np.full((b, n), value, np.float32)
        out = GenerateOutput(
            tokens, full(MOCK_LOGPROB), full(MOCK_SAMPLE_LOGPROB), full(MOCK_ENTROPY), num,
            np.asarray(reasons, np.int32), hidden, steps,
        )  # fmt: skip
        return state, out

    def drop_prefix(self, state: MockState, prefix: list[int]) -> MockState:
        return state

    def free_resource(self, state: MockState, slots) -> MockState:
        for slot in [slots] if isinstance(slots, int) else slots:
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
