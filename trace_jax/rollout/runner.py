"""The rollout runner: drives engine slots through multi-turn episodes and records them into trees.

Given requests "continue anchor A of tree T k times" (roots included), the runner

1. prefills each distinct anchor history once (several per call) and forks it into k slots
   (``insert_rows``: one prefix row into many slots, on device);
2. runs ``generate`` for all live slots; a slot's turn ends on a stop sequence, EOS, the per-turn token
   limit or a full cache;
3. hands every finished turn to the environment: ``done`` makes the turn a leaf with its reward and frees
   the slot; otherwise the observation ids are appended to the slot (``extend``) and a new turn starts;
4. refills freed slots with the next queued continuation at once (continuous batching), until every
   continuation has reached a leaf.

Turn nodes carry the sampled ids with their untempered / sampling log-probabilities and entropies, the
observation ids (loss mask 0) and, as anchor feature, the policy's final hidden state at the last token of
the history that ends with the node (after its observation). The root's feature is set from its prefill.

Seeds: the i-th continuation this runner starts (counting across calls, in request order) samples with
seed ``RunnerConfig.seed + i``; the engine derives each sequence's randomness from its seed alone.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from trace_jax.envs.base import AgentEnv
from trace_jax.rollout.backend import ContinuationRequest, RolloutStats
from trace_jax.rollout.engine import EngineConfig, GenerateOutput, StopReason
from trace_jax.rollout.tree import ROOT, RolloutTree

_TRUNCATED = (StopReason.TURN_LIMIT, StopReason.CONTEXT_FULL)


class DecodeEngine(Protocol):
    """What the runner needs of an engine (``Engine`` and ``MockEngine`` both provide it)."""

    config: EngineConfig

    def init_decode_state(self, stop_sequences: Sequence[Sequence[int]] = (), eos_ids: Sequence[int] = ()) -> Any: ...

    def prefill_many(self, params: Any, sequences: Sequence[Sequence[int]]) -> Any: ...

    def insert_rows(self, prefix: Any, state: Any, rows, slots, seeds, turn_limit: int | None = None) -> Any: ...

    def extend(
        self, params: Any, state: Any, tokens_by_slot: Mapping[int, Sequence[int]], turn_limit: int | None = None
    ) -> tuple[Any, np.ndarray]: ...

    def generate(self, params: Any, state: Any, refill_after: int | None = None) -> tuple[Any, GenerateOutput]: ...

    def free_resource(self, state: Any, slot: int) -> Any: ...


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """Knobs of the turn loop.

    seed: first sampling seed (continuation i of the runner's life uses ``seed + i``).
    max_turn_tokens: per-turn token limit (``None``: the engine's ``max_turn_tokens``).
    refill_after: a ``generate`` call returns to the host once this many turns have ended, so their slots
      are refilled / extended at once (1 = most eager; larger = fewer host round trips).
    eos_ids: token ids that end a turn (and, by the environment's rules, usually the rollout).
    """

    seed: int = 0
    max_turn_tokens: int | None = None
    refill_after: int = 1
    eos_ids: tuple[int, ...] = ()


@dataclasses.dataclass
class _Continuation:
    """One live rollout in a slot: where its next turn attaches and the turn sampled so far."""

    tree: RolloutTree
    parent: int
    length: int  # tokens in the slot's cache (host mirror, to catch a full context before extending)
    parts: list[tuple[np.ndarray, ...]] = dataclasses.field(default_factory=list)

    def add(self, out: GenerateOutput, slot: int) -> None:
        n = int(out.num_tokens[slot])
        if n:
            self.parts.append(
                tuple(a[slot, :n] for a in (out.tokens, out.logprobs, out.sample_logprobs, out.entropies))
            )
            self.length += n

    def take_turn(self) -> tuple[np.ndarray, ...]:
        if not self.parts:
            return np.zeros(0, np.int32), *(np.zeros(0, np.float32) for _ in range(3))
        turn = tuple(np.concatenate(column) for column in zip(*self.parts, strict=True))
        self.parts = []
        return turn


class RolloutRunner:
    """Implements ``RolloutBackend`` on a decode engine and an ``AgentEnv``.

    Args:
      engine: an ``Engine`` (or ``MockEngine``).
      params: the policy parameters passed to every engine call (replace with ``set_params``).
      env: the environment judging turns.
      config: turn-loop knobs.
    """

    def __init__(self, engine: DecodeEngine, params: Any, env: AgentEnv, config: RunnerConfig | None = None):
        self.engine = engine
        self.params = params
        self.env = env
        self.config = config or RunnerConfig()
        self._next_seed = self.config.seed
        self._state = engine.init_decode_state([list(s) for s in env.stop_sequences], list(self.config.eos_ids))

    def set_params(self, params: Any) -> None:
        """New policy weights for the next rollouts (same shapes: nothing recompiles)."""
        self.params = params

    def state_dict(self) -> dict[str, int]:
        """What a resumed run needs to draw the same seeds: the next continuation's seed."""
        return {"next_seed": self._next_seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._next_seed = int(state["next_seed"])

    # -------------------------------------------------------------------------------------------- api
    def featurize_roots(self, trees: Sequence[RolloutTree]) -> None:
        """Sets every featureless root's anchor feature from batched prefills, so stage 1 of the allocation
        predicts from the prompt itself (the scheduler calls this before it allocates roots)."""
        todo = [tree for tree in trees if tree.root.feature is None]
        chunk = self.engine.config.max_slots
        for start in range(0, len(todo), chunk):
            batch = todo[start : start + chunk]
            prefix = self.engine.prefill_many(self.params, [tree.prefix_ids(ROOT) for tree in batch])
            hidden = np.asarray(prefix.hidden_nd)
            for row, tree in enumerate(batch):
                tree.root.feature = hidden[row].astype(np.float32)

    def continue_anchors(self, requests: Sequence[ContinuationRequest]) -> RolloutStats:
        """Samples every request to completion, adding turns and leaves to the requests' trees."""
        stats = RolloutStats()
        pending, remaining, histories = self._enqueue(requests)
        prefixes: dict[tuple[int, int], tuple[Any, int]] = {}  # key -> (prefix, row), dropped when used up
        live: dict[int, _Continuation] = {}
        free = list(range(self.engine.config.max_slots))[::-1]
        while pending or live:
            if pending and free:
                self._fill(pending, free, live, prefixes, remaining, histories, stats)
            self._state, out = self.engine.generate(self.params, self._state, refill_after=self.config.refill_after)
            decoded = int(out.num_tokens[list(live)].sum())
            stats.generated_tokens += decoded
            stats.forward_tokens += decoded
            extends: dict[int, np.ndarray] = {}
            for slot, rollout in list(live.items()):
                rollout.add(out, slot)
                reason = int(out.stop_reason[slot])
                if reason == StopReason.RUNNING:
                    continue
                observation = self._finish_turn(rollout, reason)
                if observation is None:
                    del live[slot]
                    free.append(slot)
                    self._state = self.engine.free_resource(self._state, slot)
                    stats.rollouts += 1
                else:
                    extends[slot] = observation
            if extends:
                self._state, hidden = self.engine.extend(
                    self.params, self._state, extends, turn_limit=self.config.max_turn_tokens
                )
                for slot, observation in extends.items():
                    rollout = live[slot]
                    rollout.length += len(observation)
                    stats.forward_tokens += len(observation)
                    rollout.tree[rollout.parent].feature = np.asarray(hidden[slot], np.float32)
        return stats

    # -------------------------------------------------------------------------------------- internals
    def _enqueue(self, requests: Sequence[ContinuationRequest]):
        """One queue entry (anchor key, tree, node, seed) per continuation; each anchor's history once."""
        max_len = self.engine.config.max_len
        histories: dict[tuple[int, int], np.ndarray] = {}
        pending: collections.deque[tuple[tuple[int, int], RolloutTree, int, int]] = collections.deque()
        remaining: collections.Counter[tuple[int, int]] = collections.Counter()
        for request in requests:
            if request.tree[request.node_id].is_leaf:
                raise ValueError(f"node {request.node_id} is a leaf; only anchors can be continued")
            key = (id(request.tree), request.node_id)
            if key not in histories:
                histories[key] = request.tree.prefix_ids(request.node_id)
                if len(histories[key]) >= max_len:
                    raise ValueError(
                        f"anchor {request.node_id} has a {len(histories[key])}-token history; it does not fit "
                        f"EngineConfig.max_len={max_len} with room to generate; raise max_len"
                    )
            for _ in range(request.k):
                pending.append((key, request.tree, request.node_id, self._next_seed))
                self._next_seed += 1
                remaining[key] += 1
        return pending, remaining, histories

    def _fill(self, pending, free, live, prefixes, remaining, histories, stats: RolloutStats) -> None:
        """Moves queued continuations into free slots, prefilling each anchor history not yet prefilled."""
        batch = [pending.popleft() for _ in range(min(len(free), len(pending)))]
        new_keys = list(dict.fromkeys(key for key, *_ in batch if key not in prefixes))
        if new_keys:
            prefix = self.engine.prefill_many(self.params, [histories[k] for k in new_keys])
            hidden = np.asarray(prefix.hidden_nd)
            for row, key in enumerate(new_keys):
                prefixes[key] = (prefix, row)
                stats.forward_tokens += len(histories[key])
            for key, tree, node_id, _ in batch:
                if key in new_keys and tree[node_id].feature is None:  # roots get their feature here
                    tree[node_id].feature = hidden[new_keys.index(key)].astype(np.float32)
        by_prefix: dict[int, tuple[Any, list[int], list[int], list[int]]] = {}
        for key, tree, node_id, seed in batch:
            prefix, row = prefixes[key]
            slot = free.pop()
            entry = by_prefix.setdefault(id(prefix), (prefix, [], [], []))
            entry[1].append(row)
            entry[2].append(slot)
            entry[3].append(seed)
            live[slot] = _Continuation(tree, node_id, len(histories[key]))
            remaining[key] -= 1
            if remaining[key] == 0:
                del prefixes[key]  # the last fork of this anchor: let its prefix buffers go
        for prefix, rows, slots, seeds in by_prefix.values():
            self._state = self.engine.insert_rows(
                prefix, self._state, rows, slots, seeds, turn_limit=self.config.max_turn_tokens
            )

    def _finish_turn(self, rollout: _Continuation, reason: int) -> np.ndarray | None:
        """Judges the ended turn, adds its node; returns the observation to append, or None for a leaf."""
        tokens, logprobs, sample_logprobs, entropies = rollout.take_turn()
        tree, parent = rollout.tree, rollout.parent
        depth = tree[parent].depth + 1
        result = self.env.step(tree.task, depth, tokens, truncated=reason in _TRUNCATED)
        turn = dict(logprobs=logprobs, sample_logprobs=sample_logprobs, entropies=entropies)
        info = dict(result.info, stop_reason=StopReason(reason).name.lower())
        if result.done:
            tree.add_turn(parent, tokens, **turn, reward=result.reward, info=info)
            return None
        observation = np.asarray(result.observation_ids, np.int32)
        forced = None
        if depth >= self.env.max_turns:
            forced = "max_turns"  # the environment broke its contract; end the rollout rather than loop
        elif rollout.length + len(observation) >= self.engine.config.max_len:
            forced = "context_exhausted"
        if forced:
            tree.add_turn(parent, tokens, **turn, reward=0.0, info=dict(info, forced_end=forced))
            return None
        rollout.parent = tree.add_turn(parent, tokens, **turn, observation_ids=observation, info=info)
        return observation
