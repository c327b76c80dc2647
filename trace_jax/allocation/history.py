"""Per-prompt outcome history across visits *(ours)*: what a prompt did the last times it was sampled.

A run that revisits its prompt pool for several epochs learns more from a prompt's past groups than from its
text: a prompt that came out all-right or all-wrong last epoch likely does again (GRESO skips such prompts).
:class:`PromptHistory` keeps, per ``RolloutTree.prompt_key``, a Beta posterior over the root's past rollouts
(successes and failures), how many times and rollouts it was sampled, when (the scheduler's batch clock) and
whether its last group was all-equal. The scheduler observes every batch after training the predictor on it,
so the features an anchor is trained on are those it was predicted with (no outcome leaks into its own input).

:meth:`PromptHistory.features` is what the MLP predictor reads beside the policy's hidden state
(``MLPPredictor(history=True)``); a prompt never seen has all zeros, so its prediction comes from the network.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from trace_jax.rollout.tree import ROOT, RolloutTree

# Feature columns: seen, posterior mean, log visits' rollouts, age, last group all-pass, last group all-fail.
HISTORY_FEATURES = 6
AGE_SCALE = 16.0  # ages (in batches) are given as min(age, 4 * AGE_SCALE) / AGE_SCALE
# Per-prompt columns of the table: successes, rollouts, visits, clock of the last visit, last V̂, last rollouts.
_SUCC, _ROLL, _VISITS, _LAST, _LAST_V, _LAST_N = range(6)


class PromptHistory:
    """Outcomes of every prompt seen so far, by prompt key; ``clock`` counts observed batches.

    Args:
      prior_a / prior_b: the Beta prior of the posterior mean feature (successes + a) / (rollouts + a + b).
    """

    def __init__(self, prior_a: float = 0.5, prior_b: float = 0.5):
        self.prior = (prior_a, prior_b)
        self.table: dict[int, np.ndarray] = {}
        self.clock = 0

    def __len__(self) -> int:
        return len(self.table)

    def observe(self, trees: Sequence[RolloutTree]) -> None:
        """Adds each sampled tree's root outcomes (leaves and mean reward under the root) and advances the clock."""
        for tree in trees:
            counts, values = tree.backups()
            n = int(counts[ROOT]) if len(counts) else 0
            if n == 0:
                continue
            row = self.table.setdefault(tree.prompt_key, np.zeros(6))
            v = float(values[ROOT])
            row[_SUCC] += n * v
            row[_ROLL] += n
            row[_VISITS] += 1
            row[_LAST], row[_LAST_V], row[_LAST_N] = self.clock, v, n
        self.clock += 1

    def _rows(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(bool [N] seen, float64 [N, 6] table rows; zeros where unseen)."""
        rows = np.zeros((len(keys), 6))
        seen = np.zeros(len(keys), bool)
        for i, key in enumerate(np.asarray(keys).tolist()):
            row = self.table.get(int(key))
            if row is not None:
                rows[i], seen[i] = row, True
        return seen, rows

    def features(self, keys: np.ndarray) -> np.ndarray:
        """float32 [N, HISTORY_FEATURES] per prompt key (all zeros for a prompt never observed)."""
        seen, rows = self._rows(keys)
        a, b = self.prior
        mean = (rows[:, _SUCC] + a) / (rows[:, _ROLL] + a + b)
        age = np.minimum(self.clock - rows[:, _LAST], 4 * AGE_SCALE) / AGE_SCALE
        all_pass, all_fail = self._last_all_equal(rows)
        out = np.stack([np.ones(len(keys)), mean, np.log1p(rows[:, _ROLL]) / 4.0, age, all_pass, all_fail], axis=1)
        return np.where(seen[:, None], out, 0.0).astype(np.float32)

    @staticmethod
    def _last_all_equal(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        group = rows[:, _LAST_N] >= 2  # one rollout is never mixed: it says nothing about the group
        return (group & (rows[:, _LAST_V] >= 1.0)).astype(float), (group & (rows[:, _LAST_V] <= 0.0)).astype(float)

    def last_all_equal(self, keys: np.ndarray) -> np.ndarray:
        """bool [N]: the prompt's last group (of at least 2 rollouts) was all-right or all-wrong."""
        _, rows = self._rows(keys)
        all_pass, all_fail = self._last_all_equal(rows)
        return (all_pass + all_fail) > 0

    def visits(self, keys: np.ndarray) -> np.ndarray:
        """int64 [N]: how many observed batches sampled each prompt."""
        _, rows = self._rows(keys)
        return rows[:, _VISITS].astype(np.int64)

    # ------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``rows``: float64 [1 + K, 7], each prompt's key (exact in float64: keys are CRC-32s or indices) then its
        table row, after one row of padding (a checkpoint cannot hold an empty array); ``clock``."""
        keys = sorted(self.table)
        rows = np.zeros((1 + len(keys), 7))
        for i, key in enumerate(keys, start=1):
            rows[i, 0], rows[i, 1:] = key, self.table[key]
        return {"rows": rows, "clock": self.clock}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rows = np.asarray(state["rows"], np.float64).reshape(-1, 7)[1:]
        self.table = {int(row[0]): row[1:].copy() for row in rows}
        self.clock = int(state["clock"])
