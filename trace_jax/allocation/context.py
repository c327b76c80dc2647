"""What an allocation policy sees during one batch: trees, budget, predictions, costs and the backend.

A policy only decides *where* to sample; :class:`AllocationContext` does the bookkeeping every policy shares
(budget in rollouts and generated tokens, expected costs, the success predictor, the call to the backend), so
all policies are charged the same way whether the backend is the simulator or the real rollout runner.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from trace_jax.allocation.anchors import AnchorBatch, gather_anchors
from trace_jax.allocation.history import PromptHistory
from trace_jax.allocation.predictor import SuccessPredictor
from trace_jax.rollout.backend import ContinuationRequest, RolloutBackend, RolloutStats
from trace_jax.rollout.tree import ROOT, RolloutTree


@dataclasses.dataclass(frozen=True)
class Budget:
    """Sampling budget of one batch: finished rollouts and generated tokens (None: unlimited; not both).

    Rollouts are never exceeded. Policies plan tokens on *expected* costs; with ``max_tokens_per_rollout`` (the
    most one continuation can generate: max turns x per-turn limit) the context also guarantees the realised
    tokens never exceed ``tokens``, by sending a plan in waves whose worst case fits what is left (and
    dropping what no longer can). Without it, realised tokens may pass ``tokens`` by one round's noise.
    """

    rollouts: int | None = None
    tokens: int | None = None
    max_tokens_per_rollout: int | None = None

    def __post_init__(self):
        if self.rollouts is None and self.tokens is None:
            raise ValueError("a Budget needs rollouts or tokens (or both); set rollouts_per_prompt/tokens_per_prompt")
        if self.max_tokens_per_rollout is not None and self.max_tokens_per_rollout < 1:
            raise ValueError("max_tokens_per_rollout must be >= 1 (max turns x per-turn token limit) or None")


class CostModel:
    """Expected generated tokens of one continuation from an anchor at depth d, learned from finished trees.

    For an anchor y the observed cost is the sampled tokens along its first-child chain down to a leaf (the first
    child with a leaf below: an unfinished turn, e.g. a dropped prompt-selection probe, is no sample). Per depth we
    keep a decayed mean of it; depths never seen fall back to the nearest shallower depth seen, then to
    ``prior_tokens_per_rollout``.
    """

    def __init__(self, max_depth: int = 16, prior_tokens_per_rollout: float = 512.0, decay: float = 0.8):
        self.max_depth, self.prior, self.decay = max_depth, float(prior_tokens_per_rollout), decay
        self.sums = np.zeros(max_depth + 1)
        self.weights = np.zeros(max_depth + 1)

    def remaining_tokens(self, depths_n: np.ndarray) -> np.ndarray:
        """float64 [N] > 0: expected tokens one continuation from each depth generates."""
        seen = self.weights > 1e-9
        per_depth = np.where(seen, self.sums / np.maximum(self.weights, 1e-9), np.nan)
        last = self.prior
        for depth in range(self.max_depth + 1):  # forward-fill unseen depths from shallower ones
            per_depth[depth] = last = per_depth[depth] if seen[depth] else last
        return np.maximum(per_depth[np.minimum(np.asarray(depths_n), self.max_depth)], 1.0)

    def update(self, trees: Sequence[RolloutTree]) -> None:
        sums = np.zeros_like(self.sums)
        weights = np.zeros_like(self.weights)
        for tree in trees:
            # A node's first child continues the very rollout that created the node, so the tokens along the
            # first-child chain below y are one unbiased sample of a fresh continuation's cost from y. (Averaging
            # over all leaves under y would over-count long paths: forks are made deep on long trajectories.)
            leaves = tree.leaf_counts()
            chain = np.zeros(len(tree))
            inner = []
            for node in reversed(tree.nodes):
                finished = [c for c in node.children if leaves[c] > 0]
                if finished:
                    first = tree[finished[0]]
                    chain[node.node_id] = first.token_ids.shape[0] + chain[first.node_id]
                    inner.append(node)
            depth = np.minimum([n.depth for n in inner], self.max_depth).astype(np.int64)
            sums += np.bincount(depth, chain[[n.node_id for n in inner]], self.max_depth + 1)
            weights += np.bincount(depth, minlength=self.max_depth + 1)
        self.sums = self.decay * self.sums + sums
        self.weights = self.decay * self.weights + weights

    def state_dict(self) -> dict[str, Any]:
        return {"sums": self.sums.copy(), "weights": self.weights.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sums, self.weights = np.asarray(state["sums"], float), np.asarray(state["weights"], float)


Item = tuple[int, int]  # (tree index in the batch, node id)


def tree_backups(tree: RolloutTree) -> tuple[np.ndarray, np.ndarray]:
    """(int64 [nodes] leaves under each node, float64 [nodes] ``V̂``, NaN without leaves): ``tree.backups()``."""
    return tree.backups()


class AllocationContext:
    """One batch's trees and budget; what policies call to score anchors and to spend the budget.

    ``trees`` is the batch (a policy may replace an entry, e.g. to discard a group). ``spent`` accumulates the
    backend's cost; ``rollouts_left`` / ``tokens_left`` are what is still allowed (inf when unlimited).
    ``history``: the prompts' outcomes on earlier visits (given to the predictor's anchors and to history-based
    policies). ``prefix_auc``: the predictor's held-out AUC on prefixes over recent batches (NaN before any),
    what a gated stage 2 reads. ``notes``: figures a policy reports for the step's log (``alloc/<name>``).

    Prompt selection *(ours)*: ``prompt_anchors[t]`` is the node that stands for tree ``t``'s prompt when prompts
    are scored (the root, or a probe's first turn: ``trace_jax.allocation.selection``); ``prompt_scores`` the
    score selection ranked each tree by (NaN where none); :meth:`keep` narrows the batch to the kept prompts.
    """

    def __init__(
        self,
        trees: Sequence[RolloutTree],
        backend: RolloutBackend,
        budget: Budget,
        predictor: SuccessPredictor,
        cost_model: CostModel,
        rng: np.random.Generator,
        history: PromptHistory | None = None,
        prefix_auc: float = float("nan"),
    ):
        self.trees = list(trees)
        self.history = history
        self.prefix_auc = prefix_auc
        self.notes: dict[str, float] = {}
        self.backend = backend
        self.budget = budget
        self.predictor = predictor
        self.cost_model = cost_model
        self.rng = rng
        self.spent = RolloutStats()
        self.backend_seconds = 0.0
        self.rounds: list[dict[str, int]] = []
        self.prompt_anchors = [ROOT] * len(self.trees)
        self.prompt_scores = np.full(len(self.trees), np.nan)

    def keep(self, indices: Sequence[int]) -> list[tuple[RolloutTree, int]]:
        """Narrows the batch to ``trees[i]`` for ``i`` in ``indices`` (in that order); returns the dropped trees,
        each with its prompt anchor."""
        kept = {int(i) for i in indices}
        dropped = [(tree, self.prompt_anchors[i]) for i, tree in enumerate(self.trees) if i not in kept]
        self.trees = [self.trees[i] for i in indices]
        self.prompt_anchors = [self.prompt_anchors[i] for i in indices]
        self.prompt_scores = self.prompt_scores[np.asarray(indices, np.int64)]
        return dropped

    def prompt_items(self) -> list[Item]:
        """(tree index, the node standing for its prompt) per tree: see ``prompt_anchors``."""
        return list(enumerate(self.prompt_anchors))

    # ------------------------------------------------------------------------------------------ budget
    @property
    def rollouts_left(self) -> float:
        return np.inf if self.budget.rollouts is None else float(self.budget.rollouts - self.spent.rollouts)

    @property
    def tokens_left(self) -> float:
        return np.inf if self.budget.tokens is None else float(self.budget.tokens - self.spent.generated_tokens)

    def affordable_rollouts(self, cost: float, share: float = 1.0) -> int:
        """How many continuations of expected cost ``cost`` fit in ``share`` of what is left of both budgets."""
        by_tokens = np.floor(max(self.tokens_left, 0.0) * share / cost)
        return int(min(np.floor(max(self.rollouts_left, 0.0) * share), by_tokens))

    # ------------------------------------------------------------------------------------------ scoring
    def anchors(self, items: Sequence[Item]) -> AnchorBatch:
        prefix_ids = getattr(self.predictor, "needs_prefix_ids", False)
        return gather_anchors(self.trees, items, with_prefix_ids=prefix_ids, history=self.history)

    def last_all_equal(self, tree_indices: Sequence[int]) -> np.ndarray:
        """bool [N]: whether each tree's prompt came out all-equal on its last visit (False without a history)."""
        if self.history is None:
            return np.zeros(len(tree_indices), bool)
        return self.history.last_all_equal(np.asarray([self.trees[t].prompt_key for t in tree_indices], np.int64))

    def predict(self, items: Sequence[Item]) -> np.ndarray:
        """float64 [N] predicted P(success) of each anchor (the shared predictor)."""
        if not items:
            return np.zeros(0)
        return self.predictor.predict(self.anchors(items))

    def predict_dispersion(self, items: Sequence[Item]) -> np.ndarray | None:
        """float64 [N] predicted dispersion rho of each anchor's success probability, or None when the predictor
        has no dispersion head (the solvers then use the plug-in values)."""
        predict = getattr(self.predictor, "predict_dispersion", None)
        if predict is None or not items:
            return None
        return predict(self.anchors(items))

    def true_success(self, items: Sequence[Item]) -> np.ndarray:
        """float64 [N] true P(success): only a simulator backend knows it (the oracle policy)."""
        truth = getattr(self.backend, "true_success_probability", None)
        if truth is None:
            raise ValueError("the oracle policy needs a backend with true_success_probability (the simulator)")
        return np.asarray([truth(self.trees[t], n) for t, n in items], np.float64)

    def costs(self, items: Sequence[Item]) -> np.ndarray:
        """float64 [N] expected generated tokens of one continuation from each anchor."""
        depths = np.asarray([self.trees[t][n].depth for t, n in items], np.int64)
        return self.cost_model.remaining_tokens(depths)

    # ------------------------------------------------------------------------------------------ sampling
    def dispatch(self, items: Sequence[Item], counts: np.ndarray, max_turns: int | None = None) -> RolloutStats:
        """Continues anchor ``items[a]`` ``counts[a]`` times and charges the cost.

        One backend call, or, under a strict token budget (``Budget.max_tokens_per_rollout``), waves of calls
        whose worst case fits what is left; continuations that no longer fit are dropped in random order.
        ``max_turns``: stop each continuation after that many turns (``ContinuationRequest.max_turns``).
        """
        counts = np.asarray(counts, np.int64)
        total = int(counts.sum())
        assert total <= self.rollouts_left, f"policy asked for {total} rollouts with {self.rollouts_left} left"
        worst = self.budget.max_tokens_per_rollout
        if worst is None or self.budget.tokens is None:
            return self._send(items, counts, max_turns)
        queue = self.rng.permutation(np.repeat(np.arange(len(items)), counts))
        stats = RolloutStats()
        while queue.size:
            fits = int(max(self.tokens_left, 0.0) // worst)
            if fits == 0:
                break
            wave, queue = queue[:fits], queue[fits:]
            stats += self._send(items, np.bincount(wave, minlength=len(items)), max_turns)
        return stats

    def dispatch_roots(self, counts: np.ndarray) -> RolloutStats:
        """Stage 1: ``counts[t]`` rollouts of tree ``t``'s prompt. Where selection left an open probe (its prompt
        anchor is an unfinished first turn), the first of them continues the probe, so its tokens are part of a
        trained rollout rather than sampled again; the rest start at the root."""
        counts = np.asarray(counts, np.int64)
        probe = np.asarray([self._open_probe(t) for t in range(len(self.trees))], bool) & (counts > 0)
        items = [(t, ROOT) for t in range(len(self.trees))]
        items += [(t, self.prompt_anchors[t]) for t in np.flatnonzero(probe)]
        return self.dispatch(items, np.concatenate([counts - probe, np.ones(int(probe.sum()), np.int64)]))

    def _open_probe(self, t: int) -> bool:
        node = self.trees[t][self.prompt_anchors[t]]
        return node.node_id != ROOT and not node.is_leaf and not node.children

    def _send(self, items: Sequence[Item], counts: np.ndarray, max_turns: int | None = None) -> RolloutStats:
        requests = [
            ContinuationRequest(self.trees[t], n, int(k), max_turns=max_turns)
            for (t, n), k in zip(items, counts, strict=True)
            if k > 0
        ]
        if not requests:
            return RolloutStats()
        start = time.perf_counter()
        stats = self.backend.continue_anchors(requests)
        self.backend_seconds += time.perf_counter() - start
        self.spent += stats
        self.rounds.append({"rollouts": stats.rollouts, "generated_tokens": stats.generated_tokens})
        return stats
