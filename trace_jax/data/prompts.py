"""A seeded, resumable stream of prompt batches over a split: epochs in shuffled order, state in two ints."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class PromptStream:
    """Yields batches of ``batch_size`` rows; each epoch is a fresh permutation drawn from ``(seed, epoch)``.

    The position (epoch, offset) is the whole state, so ``state_dict`` / ``load_state_dict`` make a resumed
    run see exactly the batches an uninterrupted run would. A batch never straddles two epochs.
    """

    def __init__(self, rows: Sequence[Any], batch_size: int, seed: int = 0):
        if batch_size < 1 or batch_size > len(rows):
            raise ValueError(f"batch_size must be in [1, {len(rows)}] (the split's size), got {batch_size}")
        self.rows = list(rows)
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.offset = 0

    def _order(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.rows))

    def next_batch(self) -> list[Any]:
        if self.offset + self.batch_size > len(self.rows):
            self.epoch, self.offset = self.epoch + 1, 0
        picked = self._order()[self.offset : self.offset + self.batch_size]
        self.offset += self.batch_size
        return [self.rows[i] for i in picked]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
