"""What the allocation scheduler asks of whatever produces rollouts (the real runner or the simulator)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from trace_jax.rollout.tree import RolloutTree


@dataclasses.dataclass(frozen=True)
class ContinuationRequest:
    """Continue ``tree`` from the anchor ``node_id`` ``k`` times, each to a finished leaf.

    ``first_seed``: sampling seeds ``first_seed .. first_seed + k - 1`` for the k continuations (a backend
    shared across processes numbers them globally); None: the backend's own running seed count.
    ``max_turns``: each continuation stops after this many turns even when unfinished; its last turn then stays
    an inner node (observation and anchor feature in place, no leaf below) that a later request can continue.
    Such a continuation's tokens count in ``RolloutStats.generated_tokens``, not in ``rollouts``. None: to a leaf.
    """

    tree: RolloutTree
    node_id: int
    k: int
    first_seed: int | None = None
    max_turns: int | None = None


@dataclasses.dataclass
class RolloutStats:
    """Cost of one batch of requests: rollouts finished and tokens the policy generated / the model ran."""

    rollouts: int = 0  # continuations that reached a leaf
    generated_tokens: int = 0
    forward_tokens: int = 0  # prefill + extend + decode tokens the engine pushed through the model

    def __iadd__(self, other: RolloutStats) -> RolloutStats:
        self.rollouts += other.rollouts
        self.generated_tokens += other.generated_tokens
        self.forward_tokens += other.forward_tokens
        return self


class RolloutBackend(Protocol):
    def continue_anchors(self, requests: Sequence[ContinuationRequest]) -> RolloutStats:
        """Samples every request to completion, adding its turns and leaves to the request's tree.

        New nodes carry ids, log-probs, observation ids, anchor features and leaf rewards. Returns the cost.
        """
        ...
