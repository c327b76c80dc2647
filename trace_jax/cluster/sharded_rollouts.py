"""A rollout backend for several JAX processes: each samples its own prompts, all see every tree.

How the allocation stays identical on every host: the scheduler (unchanged) runs on every process over the
*whole* batch of trees. ``ProcessShardedBackend`` wraps the process's real backend (runner or simulator):

- a request is executed only by the process that owns its tree (``owner``: prompt index modulo the process
  count), on that process's own devices, with the sampling seeds the one-process run would give it (the
  continuations are numbered over the whole batch when the inner backend has ``reserve_seeds``);
- the turns each process added are then all-gathered and appended, in the same order, to the other
  processes' copies of those trees; ``RolloutStats`` are summed over processes.

So before and after every backend call all processes hold the same trees and the same spent budget, and the
policy's stage-1 / stage-2 decisions, the predictor's training anchors (hence its parameters) and the cost
model are the same everywhere without further communication. What travels is each new turn (ids,
log-probs, entropies, observation ids, anchor feature, reward): exact, and small next to sampling it.

The train batch is then built from ``local_trees(trees)`` on each process and assembled with
``multihost.global_batch``. Evaluation needs no other change: ``evaluate(ProcessShardedBackend(runner), env,
tasks)`` splits the questions across processes and every process computes the same (one-process) scores.
With one process the wrapper only forwards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from trace_jax.parallel import multihost
from trace_jax.rollout.backend import ContinuationRequest, RolloutBackend, RolloutStats
from trace_jax.rollout.tree import Node, RolloutTree

_STATS = ("rollouts", "generated_tokens", "forward_tokens")


def owner(tree: RolloutTree, count: int | None = None) -> int:
    """The process that samples ``tree``: its prompt index modulo the process count (disjoint, stateless)."""
    return tree.prompt_index % (jax.process_count() if count is None else count)


def local_trees(trees: Sequence[RolloutTree]) -> list[RolloutTree]:
    """The trees this process sampled (and trains on)."""
    return [tree for tree in trees if owner(tree) == jax.process_index()]


def _turn(node: Node) -> dict[str, Any]:
    """What ``RolloutTree.add_turn`` needs to recreate ``node`` under the same parent."""
    return {
        "parent": node.parent,
        "token_ids": node.token_ids,
        "logprobs": node.logprobs,
        "sample_logprobs": node.sample_logprobs,
        "entropies": node.entropies,
        "observation_ids": node.observation_ids,
        "reward": node.reward,
        "feature": node.feature,
        "info": node.info,
        "routed_experts": node.routed_experts,
    }


class ProcessShardedBackend:
    """Wraps ``inner`` (a ``RolloutBackend``) so each process samples only the trees it owns.

    ``continue_anchors`` and ``featurize_roots`` are collective: every process must call them with the same
    requests / trees (the scheduler does, since it runs identically everywhere).
    """

    def __init__(self, inner: RolloutBackend):
        self.inner = inner
        self.sampled: set[int] = set()  # prompt indices this process sampled since the last ``take_sampled``

    def take_sampled(self) -> list[int]:
        """The prompt indices whose continuations this process ran itself since the last call (then reset)."""
        sampled, self.sampled = sorted(self.sampled), set()
        return sampled

    def featurize_roots(self, trees: Sequence[RolloutTree]) -> None:
        featurize = getattr(self.inner, "featurize_roots", None)
        if featurize is None:
            return
        mine = local_trees(trees)
        if mine:
            featurize(mine)
        by_index = {tree.prompt_index: tree for tree in trees}
        # The prompt's routing record (``EngineConfig.routing_replay``) travels with its feature.
        for roots in multihost.exchange({t.prompt_index: (t.root.feature, t.root.routed_experts) for t in mine}):
            for index, (feature, experts) in roots.items():
                by_index[index].root.feature = feature
                by_index[index].root.routed_experts = experts

    def _globally_seeded(self, requests: Sequence[ContinuationRequest]) -> list[ContinuationRequest]:
        """Each request with the seeds a one-process runner would draw for it (the running count advances by
        every process's continuations on every process, so the counts stay equal)."""
        reserve = getattr(self.inner, "reserve_seeds", None)
        if reserve is None or any(r.first_seed is not None for r in requests):
            return list(requests)
        first = reserve(sum(r.k for r in requests))
        starts = first + np.cumsum([0] + [r.k for r in requests[:-1]])
        return [dataclasses.replace(r, first_seed=int(s)) for r, s in zip(requests, starts, strict=True)]

    def continue_anchors(self, requests: Sequence[ContinuationRequest]) -> RolloutStats:
        trees = list({id(r.tree): r.tree for r in requests}.values())
        if len({tree.prompt_index for tree in trees}) != len(trees):
            raise ValueError("ProcessShardedBackend needs a distinct prompt_index per tree of a batch")
        sizes = {id(tree): len(tree.nodes) for tree in trees}
        requests = self._globally_seeded(requests)
        mine = [r for r in requests if owner(r.tree) == jax.process_index()]
        stats = self.inner.continue_anchors(mine) if mine else RolloutStats()
        self.sampled |= {r.tree.prompt_index for r in mine}
        added = {  # the new turns, and the prompt's routing record (set by the root's first prefill)
            tree.prompt_index: (tree.root.routed_experts, [_turn(node) for node in tree.nodes[sizes[id(tree)] :]])
            for tree in trees
            if owner(tree) == jax.process_index()
        }
        by_index = {tree.prompt_index: tree for tree in trees}
        for process, turns_by_tree in enumerate(multihost.exchange(added)):
            if process == jax.process_index():
                continue
            for index, (root_experts, turns) in turns_by_tree.items():
                tree = by_index[index]
                tree.root.routed_experts = root_experts
                for turn in turns:
                    tree.add_turn(**turn)
        totals = multihost.allgather_rows(np.asarray([[getattr(stats, k) for k in _STATS]], np.int64))[0].sum(0)
        return RolloutStats(**{k: int(v) for k, v in zip(_STATS, totals, strict=True)})
