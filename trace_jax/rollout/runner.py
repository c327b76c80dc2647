"""The rollout runner: drives engine slots through multi-turn episodes and records them into trees.

Given requests "continue anchor A of tree T k times" (roots included), the runner

1. starts each distinct anchor history once in a free slot and forks it into the other k - 1 slots
   (shared KV pages, nothing recomputed); all new histories and all pending observations of one refill go
   to the engine in one ``append`` call, all forks in one ``fork`` call;
2. runs ``generate`` for the live slots; a slot's turn ends on a stop sequence, EOS, the per-turn token
   limit or a full cache; after each call, a turn whose decoded text holds a stop string the id table missed
   (the environment's ``text_stops``) ends at the id that completed it (its cache is rebuilt from the kept
   history if the rollout goes on);
3. hands every finished turn to the environment: ``done`` makes the turn a leaf with its reward and frees
   the slot; otherwise the observation ids are appended to the slot at the next refill and a new turn starts;
4. refills freed slots with the next queued continuations (continuous batching), until every continuation
   has reached a leaf, or its request's ``max_turns``: then its last observation is appended (the node gets
   its anchor feature and, with ``reuse_prefixes``, its held pages) and the slot is freed.

With ``overlap_env`` (default), step 3 runs while the device already decodes the next ``generate`` call for
the slots still mid-turn: the environment's work (retrieval, rewards) hides behind decoding, and the
refill is queued on the device behind that call. The host syncs with the device once per ``generate``
(its packed output); the anchor features of appended histories are fetched once, at the end of a batch.

Turn nodes carry the sampled ids with their untempered / sampling log-probabilities and entropies, the
observation ids (loss mask 0) and, as anchor feature, the policy's final hidden state at the last token of
the history that ends with the node (after its observation). The root's feature is set when it is started.
With ``EngineConfig.routing_replay`` every token's experts go on its node (``Node.routed_experts``): sampled
tokens' from ``generate``, prompt and observation tokens' from the ``append`` that first computed them
(fetched with the features); a token computed again (a restart, a held prefix's last id) keeps its first.

Seeds: the i-th continuation this runner starts (counting across calls, in request order) samples with
seed ``RunnerConfig.seed + i``; the engine derives each sequence's randomness from its seed alone.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import numpy as np

from trace_jax.config_utils import documented
from trace_jax.envs.base import AgentEnv
from trace_jax.envs.stops import TextStops
from trace_jax.rollout.backend import ContinuationRequest, RolloutStats
from trace_jax.rollout.engine.engine import AppendItem, AppendResult, EngineConfig, GenerateOutput, StopReason
from trace_jax.rollout.engine.prefix_cache import PrefixCache
from trace_jax.rollout.tree import ROOT, RolloutTree

_TRUNCATED = (StopReason.TURN_LIMIT, StopReason.CONTEXT_FULL)


class DecodeEngine(Protocol):
    """What the runner needs of an engine (``Engine`` and ``MockEngine`` both provide it)."""

    config: EngineConfig

    def set_params(self, params: Any) -> Any: ...

    def acquire_state(self, stop_sequences: Sequence[Sequence[int]] = (), eos_ids: Sequence[int] = ()) -> Any: ...

    def release_state(self, state: Any) -> None: ...

    def append(self, params: Any, state: Any, items: Sequence[AppendItem]) -> tuple[Any, Any]: ...

    def fork(self, state: Any, sources, children, seeds, *, greedy: bool = False, turn_limit=None) -> Any: ...

    def drop_prefix(self, state: Any, prefix: Any) -> Any: ...

    def generate_async(self, params: Any, state: Any, refill_after: int | None = None) -> tuple[Any, Any]: ...

    def free_resource(self, state: Any, slots: Sequence[int]) -> Any: ...


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """Knobs of the turn loop."""

    seed: int = documented(0, "first sampling seed (continuation i of the runner's life uses ``seed + i``).")
    max_turn_tokens: int | None = documented(
        None,
        "per-turn token limit (``None``: the engine's ``max_turn_tokens``, which is the main job's one limit).",
    )
    refill_after: int = documented(
        1,
        "a ``generate`` call returns to the host once this many turns have ended, so their slots are refilled / "
        "extended at once (1 = most eager; larger = fewer host round trips).",
    )
    eos_ids: tuple[int, ...] = documented(
        (),
        "token ids that end a turn (and, by the environment's rules, usually the rollout); the main job passes its "
        "tokenizer's EOS.",
    )
    greedy: bool = documented(
        False,
        "argmax decoding (evaluation) on an engine that otherwise samples; the main job sets it per runner.",
    )
    overlap_env: bool = documented(
        True,
        "judge finished turns while the device decodes the others (see the module docstring).",
    )
    warmup: bool = documented(
        True,
        "compile the engine's whole program set before the first rollout (``Engine.warmup``).",
    )
    reuse_prefixes: bool = documented(
        True,
        "hold every appended history's KV pages under its tree node, so a later continuation from that node computes "
        "only its last id (``trace_jax.rollout.engine.prefix_cache``; the pool reclaims holds). Holds live until the "
        "engine's weights change or ``drop_held`` is called, whichever comes first.",
    )


@dataclasses.dataclass
class _Continuation:
    """One live rollout in a slot: where its next turn attaches and the turn sampled so far."""

    tree: RolloutTree
    parent: int
    length: int  # tokens in the slot's cache (host mirror, to catch a full context before extending)
    seed: int = 0
    parts: list[tuple[np.ndarray, ...]] = dataclasses.field(default_factory=list)
    checked: int = 0  # leading ids of the turn the text stop rule has read
    restart: bool = False  # the slot's cache holds ids the turn dropped: continue from the history, afresh
    turns_left: int | None = None  # turns it may still take (the request's max_turns); None: to a leaf

    def add(self, out: GenerateOutput, slot: int) -> None:
        n = int(out.num_tokens[slot])
        if n:
            columns = (out.tokens, out.logprobs, out.sample_logprobs, out.entropies)
            columns += () if out.routing is None else (out.routing,)
            self.parts.append(tuple(a[slot, :n] for a in columns))
            self.length += n

    def take_turn(self) -> tuple[np.ndarray, ...]:
        if not self.parts:
            return np.zeros(0, np.int32), *(np.zeros(0, np.float32) for _ in range(3))
        turn = tuple(np.concatenate(column) for column in zip(*self.parts, strict=True))
        self.parts, self.checked = [], 0
        return turn

    def cut_at_text_stop(self, text_stops: TextStops) -> int | None:
        """Drops the turn's ids after the one completing its first stop string (decoded text); returns the
        number dropped (None: no complete stop string yet)."""
        if not self.parts:
            return None
        turn = self.take_turn()
        keep = text_stops.cut(turn[0], self.checked)
        self.parts, self.checked = [turn if keep is None else tuple(a[:keep] for a in turn)], len(turn[0])
        if keep is None:
            return None
        self.length -= len(turn[0]) - keep
        return len(turn[0]) - keep


@dataclasses.dataclass
class _Batch:
    """Bookkeeping of one ``continue_anchors`` call."""

    pending: collections.deque  # (anchor key, tree, node id, seed, max turns)
    histories: dict[tuple[int, int], np.ndarray]
    remaining: collections.Counter  # anchor key -> continuations not yet started
    prefixes: dict[tuple[int, int], Any] = dataclasses.field(default_factory=dict)  # kept while some remain
    live: dict[int, _Continuation] = dataclasses.field(default_factory=dict)
    free: list[int] = dataclasses.field(default_factory=list)
    observations: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)  # slot -> ids to append
    restarts: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)  # slot -> append afresh
    stopping: list[int] = dataclasses.field(default_factory=list)  # slots freed once their observation is appended
    # (device hidden [rows >= k, D] of one append, [(tree, node id, row)]): anchor features fetched at the end
    features: list[tuple[Any, list[tuple[RolloutTree, int, int]]]] = dataclasses.field(default_factory=list)
    # (device routing record of one append, its spans, [(tree, node id, history position of the item's first
    # id)]): the appended ids' experts (``EngineConfig.routing_replay``), fetched with the features
    routing: list[tuple[Any, list, list[tuple[RolloutTree, int, int]]]] = dataclasses.field(default_factory=list)
    stats: RolloutStats = dataclasses.field(default_factory=RolloutStats)


class RolloutRunner:
    """Implements ``RolloutBackend`` on a decode engine and an ``AgentEnv``.

    Several runners (sampling and greedy evaluation) may share one engine: its weights and its one slot
    state (KV pool) are shared; each runner keeps its own seed sequence and decoding mode.

    Args:
      engine: an ``Engine`` (or ``MockEngine``).
      params: policy parameters handed to ``engine.set_params`` (``None``: the engine already has them).
      env: the environment judging turns.
      config: turn-loop knobs.
    """

    def __init__(self, engine: DecodeEngine, params: Any, env: AgentEnv, config: RunnerConfig | None = None):
        self.engine = engine
        self.env = env
        self.config = config or RunnerConfig()
        self._next_seed = self.config.seed
        self._held = PrefixCache()
        self._held_weights: Any = None  # the engine weights the held pages were computed with
        if params is not None:
            engine.set_params(params)

    def set_params(self, params: Any) -> None:
        """New policy weights for the next rollouts: the engine reshards them once (nothing recompiles). Held
        prefix pages hold keys and values of the old weights: they are dropped (kept for the same weights)."""
        self.engine.set_params(params)
        self._check_held_weights()

    @property
    def evicted_holds(self) -> int:
        """Held prefixes the page pool reclaimed to make room, over the runner's life."""
        return self._held.evicted

    def drop_held(self) -> None:
        """Gives every held prefix's pages back to the pool. A run calls it where its trees end (a step, an
        evaluation), so what the engine holds at a step boundary never depends on the steps before it."""
        self._held.clear()

    def state_dict(self) -> dict[str, int]:
        """What a resumed run needs to draw the same seeds: the next continuation's seed."""
        return {"next_seed": self._next_seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._next_seed = int(state["next_seed"])

    def reserve_seeds(self, n: int) -> int:
        """The first of ``n`` consecutive seeds, taken from the running count (for requests' ``first_seed``)."""
        first, self._next_seed = self._next_seed, self._next_seed + n
        return first

    # -------------------------------------------------------------------------------------------- api
    def featurize_roots(self, trees: Sequence[RolloutTree]) -> None:
        """Sets every featureless root's anchor feature from batched prefills, so stage 1 of the allocation
        predicts from the prompt itself (the scheduler calls this before it allocates roots)."""
        todo = [tree for tree in trees if tree.root.feature is None]
        if not todo:
            return
        state = self._acquire()
        chunk = self.engine.config.max_slots
        fetched = []
        for start in range(0, len(todo), chunk):
            batch = todo[start : start + chunk]
            slots = list(range(len(batch)))
            hold = self.config.reuse_prefixes
            items = [
                AppendItem(slot, tree.prefix_ids(ROOT), reset=True, hold=hold)
                for slot, tree in zip(slots, batch, strict=True)
            ]
            state, result = self.engine.append(None, state, items)
            for tree, prefix in zip(batch, result.held or (), strict=False):
                self._held.put(tree, ROOT, prefix)
            state = self.engine.free_resource(state, slots)
            fetched.append((batch, result.padded_hidden, result.routing, result.routing_spans))
        for batch, hidden, routing, spans in jax.device_get(fetched):
            for row, tree in enumerate(batch):
                tree.root.feature = np.asarray(hidden[row], np.float32)
                if routing is not None:  # the prompt's experts (EngineConfig.routing_replay)
                    first, experts = AppendResult.item_routing(routing, spans[row])
                    tree.record_routing(ROOT, experts, first)
        self.engine.release_state(state)

    def continue_anchors(self, requests: Sequence[ContinuationRequest]) -> RolloutStats:
        """Samples every request to completion, adding turns and leaves to the requests' trees."""
        batch = self._enqueue(requests)
        batch.free = list(range(self.engine.config.max_slots))[::-1]
        state = self._acquire()
        handle = None
        while batch.pending or batch.live:
            if handle is None:
                state = self._refill(state, batch)
                if not batch.live:  # every slot ran out of turns (``max_turns``): refill from the queue first
                    continue
                state, handle = self.engine.generate_async(None, state, refill_after=self.config.refill_after)
            out = handle.result()
            finished = self._collect(batch, out, handle.decoded)
            state, finished = self._end_at_text_stops(state, batch, handle.decoded, finished)
            handle = None
            if self.config.overlap_env and state.running.any():
                # The device decodes the slots mid-turn while the host judges the finished ones below.
                state, handle = self.engine.generate_async(None, state, refill_after=self.config.refill_after)
            for slot, reason in finished:
                state = self._finish_turn(state, batch, slot, reason)
            if handle is not None and (batch.observations or (batch.pending and batch.free)):
                state = self._refill(state, batch)  # queued on the device behind the running call
        self._resolve_features(batch)
        self.engine.release_state(state)
        return batch.stats

    # -------------------------------------------------------------------------------------- internals
    def _acquire(self) -> Any:
        state = self.engine.acquire_state([list(s) for s in self.env.stop_sequences], list(self.config.eos_ids))
        self._held.attach(getattr(state, "pool", None))
        self._check_held_weights()  # the weights may have changed through another runner or the engine itself
        warmup = getattr(self.engine, "warmup", None)
        if self.config.warmup and warmup is not None and not self.engine.programs.warm:
            warmup(None, state)
        return state

    def _check_held_weights(self) -> None:
        weights = getattr(self.engine, "params", None)
        if weights is not self._held_weights:
            self._held.clear()
            self._held_weights = weights

    def _enqueue(self, requests: Sequence[ContinuationRequest]) -> _Batch:
        """One queue entry (anchor key, tree, node, seed, max turns) per continuation; each anchor's history once."""
        max_len = self.engine.config.max_len
        batch = _Batch(collections.deque(), {}, collections.Counter())
        for request in requests:
            if request.tree[request.node_id].is_leaf:
                raise ValueError(f"node {request.node_id} is a leaf; only anchors can be continued")
            key = (id(request.tree), request.node_id)
            if key not in batch.histories:
                history = request.tree.prefix_ids(request.node_id)
                if len(history) >= max_len:
                    raise ValueError(
                        f"anchor {request.node_id} has a {len(history)}-token history; it does not fit "
                        f"EngineConfig.max_len={max_len} with room to generate; raise max_len"
                    )
                batch.histories[key] = history
            for j in range(request.k):
                seed = self.reserve_seeds(1) if request.first_seed is None else request.first_seed + j
                batch.pending.append((key, request.tree, request.node_id, seed, request.max_turns))
                batch.remaining[key] += 1
        return batch

    def _refill(self, state: Any, batch: _Batch) -> Any:
        """One ``append`` (pending observations + one fresh slot per new anchor history) and one ``fork`` (the
        anchors' other continuations) for as many queued continuations as there are free slots.

        An anchor history is computed once: it is kept as a prefix (shared KV pages) until its last
        continuation has been forked from it, across refills if the free slots run out."""
        cfg = self.config
        hold = cfg.reuse_prefixes
        items = [
            AppendItem(
                slot, ids, turn_limit=cfg.max_turn_tokens, greedy=cfg.greedy, hold=hold, **batch.restarts.pop(slot, {})
            )
            for slot, ids in batch.observations.items()
        ]
        targets = [(batch.live[s].tree, batch.live[s].parent) for s in batch.observations]
        owners = list(targets)  # per item: the tree node whose history its ids end
        batch.stats.forward_tokens += sum(len(ids) for ids in batch.observations.values())
        batch.observations = {}
        started: dict[tuple[int, int], int] = {}  # new anchor key -> its append row
        starts: dict[int, Any] = {}  # append row -> the held prefix it starts from (taken from the cache)
        forks: list[tuple[tuple[int, int], int, int]] = []  # (anchor key, child slot, seed)
        while batch.pending and batch.free:
            key, tree, node_id, seed, max_turns = batch.pending.popleft()
            slot = batch.free.pop()
            batch.live[slot] = _Continuation(tree, node_id, len(batch.histories[key]), seed, turns_left=max_turns)
            batch.remaining[key] -= 1
            if key in batch.prefixes or key in started:
                forks.append((key, slot, seed))
                continue
            started[key] = len(items)
            keep = batch.remaining[key] > 0
            start = self._held.take(tree, node_id)
            history = batch.histories[key]
            item = AppendItem(slot, history, True, seed, cfg.greedy, cfg.max_turn_tokens, keep, start is None and hold)
            if start is not None:
                item, starts[len(items)] = dataclasses.replace(item, start=start), start
            items.append(item)
            owners.append((tree, node_id))
            targets.append((tree, node_id) if tree[node_id].feature is None else (None, 0))
            batch.stats.forward_tokens += len(history) - (0 if start is None else start.length - 1)
        if items:
            state, result = self.engine.append(None, state, items)
            rows = [(tree, node, row) for row, (tree, node) in enumerate(targets) if tree is not None]
            batch.features.append((result.padded_hidden, rows))
            if result.routing is not None:  # the appended ids' experts: where each item's ids sit in its history
                starts_at = [
                    tree.prefix_length(node) - len(item.ids) for (tree, node), item in zip(owners, items, strict=True)
                ]
                places = [(tree, node, at) for (tree, node), at in zip(owners, starts_at, strict=True)]
                batch.routing.append((result.routing, result.routing_spans, places))
            for key, row in started.items():
                if result.prefixes[row] is not None:
                    batch.prefixes[key] = result.prefixes[row]
            held = result.held or [None] * len(items)
            for row, item in enumerate(items):  # a started row's prefix goes back: its pages are shared now
                rollout = batch.live[item.slot]
                self._held.put(rollout.tree, rollout.parent, starts.get(row, held[row]))
        if batch.stopping:  # out of turns: the observation is in the cache (and held); the slot goes back
            state = self.engine.free_resource(state, batch.stopping)
            for slot in batch.stopping:
                del batch.live[slot]
            batch.free += batch.stopping
            batch.stopping = []
        if forks:
            sources = [batch.prefixes[key] for key, _, _ in forks]
            children, seeds = [slot for _, slot, _ in forks], [seed for _, _, seed in forks]
            state = self.engine.fork(state, sources, children, seeds, greedy=cfg.greedy, turn_limit=cfg.max_turn_tokens)
        for key in {key for key, _, _ in forks}:
            if batch.remaining[key] == 0:
                state = self.engine.drop_prefix(state, batch.prefixes.pop(key))
        return state

    def _collect(self, batch: _Batch, out: GenerateOutput, decoded: np.ndarray) -> list[tuple[int, int]]:
        """Adds the call's tokens to the live rollouts it decoded; returns (slot, reason) of ended turns."""
        finished = []
        for slot, rollout in batch.live.items():
            if not decoded[slot]:
                continue
            rollout.add(out, slot)
            decoded_tokens = int(out.num_tokens[slot])
            batch.stats.generated_tokens += decoded_tokens
            batch.stats.forward_tokens += decoded_tokens
            if out.stop_reason[slot] != StopReason.RUNNING:
                finished.append((slot, int(out.stop_reason[slot])))
        return finished

    def _end_at_text_stops(
        self, state: Any, batch: _Batch, decoded: np.ndarray, finished: list[tuple[int, int]]
    ) -> tuple[Any, list[tuple[int, int]]]:
        """Ends the decoded turns whose text holds a stop string the engine's id table missed
        (``envs.stops.TextStops``): the turn keeps its ids up to the completing one and ends by
        STOP_SEQUENCE. A slot that went on past it is freed now (before the next ``generate``) and, if the
        rollout goes on, restarted from its history (``_finish_turn``)."""
        text_stops = getattr(self.env, "text_stops", None)
        if text_stops is None:
            return state, finished
        reasons = dict(finished)
        for slot, rollout in batch.live.items():
            if not decoded[slot]:
                continue
            dropped = rollout.cut_at_text_stop(text_stops)
            reason = reasons.get(slot, StopReason.RUNNING)
            if dropped is None or (dropped == 0 and reason in (StopReason.STOP_SEQUENCE, StopReason.EOS)):
                continue
            reasons[slot] = StopReason.STOP_SEQUENCE
            if dropped or reason == StopReason.RUNNING:
                rollout.restart = True
                state = self.engine.free_resource(state, [slot])
        return state, list(reasons.items())

    def _finish_turn(self, state: Any, batch: _Batch, slot: int, reason: int) -> Any:
        """Judges the ended turn and adds its node: a leaf frees the slot, otherwise the observation waits
        for the next refill."""
        rollout = batch.live[slot]
        tokens, logprobs, sample_logprobs, entropies, *routing = rollout.take_turn()
        tree, parent = rollout.tree, rollout.parent
        depth = tree[parent].depth + 1
        result = self.env.step(tree.task, depth, tokens, truncated=reason in _TRUNCATED)
        turn = dict(logprobs=logprobs, sample_logprobs=sample_logprobs, entropies=entropies)
        if routing:  # the engine records routing (EngineConfig.routing_replay)
            turn["routed_experts"] = routing[0]
        info = dict(result.info, stop_reason=StopReason(reason).name.lower())
        observation = np.asarray(result.observation_ids, np.int32)
        forced = None
        if not result.done and depth >= self.env.max_turns:
            forced = "max_turns"  # the environment broke its contract; end the rollout rather than loop
        elif not result.done and rollout.length + len(observation) >= self.engine.config.max_len:
            forced = "context_exhausted"
        if result.done or forced:
            reward = result.reward if result.done else 0.0
            tree.add_turn(parent, tokens, **turn, reward=reward, info=dict(info, forced_end=forced) if forced else info)
            del batch.live[slot]
            batch.free.append(slot)
            batch.stats.rollouts += 1
            return self.engine.free_resource(state, [slot])
        rollout.parent = tree.add_turn(parent, tokens, **turn, observation_ids=observation, info=info)
        rollout.length += len(observation)
        batch.observations[slot] = observation
        if rollout.turns_left is not None:
            rollout.turns_left -= 1
            if rollout.turns_left == 0:
                batch.stopping.append(slot)
        if rollout.restart:  # the cache went past the turn's kept ids: append the whole history afresh
            batch.observations[slot] = tree.prefix_ids(rollout.parent)
            seed = int(np.random.SeedSequence((rollout.seed, depth)).generate_state(1)[0] >> 1)
            batch.restarts[slot] = dict(reset=True, seed=seed)
            rollout.restart = False
        return state

    @staticmethod
    def _resolve_features(batch: _Batch) -> None:
        """Anchor features of every appended history, and the appended ids' routing records when the engine
        keeps them, fetched from the device in one copy."""
        fetched, routing = jax.device_get(([hidden for hidden, _ in batch.features], [r for r, _, _ in batch.routing]))
        for rows, (_, targets) in zip(fetched, batch.features, strict=True):
            for tree, node_id, row in targets:
                tree[node_id].feature = np.asarray(rows[row], np.float32)
        for record, (_, spans, places) in zip(routing, batch.routing, strict=True):
            for span, (tree, node_id, at) in zip(spans, places, strict=True):
                first, experts = AppendResult.item_routing(record, span)
                tree.record_routing(node_id, experts, at + first)
