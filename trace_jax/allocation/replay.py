"""A bounded replay buffer of training anchors for the online success predictor.

Rows are stored column-wise (a dict of numpy arrays with one leading row axis); adding rows keeps the most
recent ``capacity``. Sampling is with replacement from a caller-supplied generator, so a run that restores
the buffer and its step counter from a checkpoint draws the same minibatches.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


class ReplayBuffer:
    """The most recent ``capacity`` rows of named columns (every column has the same number of rows)."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"replay capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.columns: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return int(next(iter(self.columns.values())).shape[0]) if self.columns else 0

    def add(self, rows: Mapping[str, np.ndarray]) -> None:
        """Appends rows (same keys on every call, same leading size per column), dropping the oldest beyond capacity."""
        sizes = {key: np.asarray(value).shape[0] for key, value in rows.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"replay columns have different row counts {sizes}")
        if self.columns and set(rows) != set(self.columns):
            raise ValueError(f"replay columns {sorted(rows)} differ from the stored {sorted(self.columns)}")
        self.columns = {
            key: (np.concatenate([self.columns[key], value]) if self.columns else np.asarray(value))[-self.capacity :]
            for key, value in rows.items()
        }

    def sample(self, rng: np.random.Generator, batch_size: int) -> dict[str, np.ndarray]:
        """``batch_size`` rows drawn uniformly with replacement, as a dict of column arrays."""
        if not self.columns:
            raise ValueError("cannot sample from an empty replay buffer")
        rows = rng.integers(0, len(self), batch_size)
        return {key: value[rows] for key, value in self.columns.items()}

    def state_dict(self) -> dict[str, np.ndarray]:
        """The stored columns (copies), for checkpoints."""
        return {key: value.copy() for key, value in self.columns.items()}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        self.columns = {key: np.asarray(value) for key, value in state.items()}
