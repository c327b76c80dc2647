"""The turn interface between the rollout runner and an agent environment.

The runner owns the token history; the environment only judges one finished turn at a time. It is
stateless per rollout (all it needs is the task, the turn index and the ids of the turn), so a prefix can
be forked into many continuations without copying any environment state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np


@dataclasses.dataclass(frozen=True)
class TurnResult:
    """What the environment answers to one finished turn.

    observation_ids: ids to append after the turn (empty when ``done``); tokenized once, never re-rendered.
    done: the trajectory is finished (answered, malformed, out of turns or out of tokens).
    reward: the terminal reward when ``done``; ignored otherwise.
    info: facts for metrics (``format_error``, ``query``, ``retrieval_failed``, ``answer``...).
    """

    observation_ids: np.ndarray
    done: bool
    reward: float = 0.0
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


class AgentEnv(Protocol):
    """An environment the rollout runner can drive.

    stop_sequences: token-id sequences that end a turn (e.g. the ids of ``</search>`` and ``</answer>``);
      EOS always ends a turn too.
    max_turns: the turn whose ``depth == max_turns`` must come back ``done``.
    text_stops (optional): an ``envs.stops.TextStops``; the runner then also ends a turn at the first stop
      string of its decoded text, however the ids spelled it.
    """

    stop_sequences: Sequence[Sequence[int]]
    max_turns: int

    def prompt_ids(self, task: Any) -> np.ndarray:
        """int32 ids of the rendered prompt for ``task`` (the root's history)."""
        ...

    def step(self, task: Any, depth: int, turn_ids: np.ndarray, truncated: bool = False) -> TurnResult:
        """Judges the turn at ``depth`` (1-based) whose sampled ids are ``turn_ids``.

        ``truncated`` says the turn hit its token limit or the context ran out before a stop sequence.
        """
        ...
