"""A seeded, resumable stream of prompt batches over a pool: epochs in shuffled order, state in two ints."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def pool_rows(rows: Sequence[Any], pool_size: int = 0) -> list[Any]:
    """The ``pool_size`` rows of ``rows`` evenly spaced over it (a split ordered by kind keeps every kind's
    share), or all of them for 0. The same pool for every seed, so runs that differ in seed or policy train on
    the same questions."""
    if pool_size < 0 or pool_size > len(rows):
        raise ValueError(f"pool_size must be in [0, {len(rows)}] (the split's size; 0: all of it), got {pool_size}")
    if pool_size in (0, len(rows)):
        return list(rows)
    picked = np.linspace(0, len(rows) - 1, pool_size).round().astype(int)
    return [rows[i] for i in picked]


class PromptStream:
    """Yields batches of ``batch_size`` rows; each epoch is a fresh permutation of the pool drawn from
    ``(seed, epoch)``, so every prompt of the pool comes back once per epoch.

    ``pool_size`` (0: every row) keeps that many of ``rows`` (:func:`pool_rows`): a run that revisits a small
    pool for several epochs. The position (epoch, offset) is the whole state, so ``state_dict`` /
    ``load_state_dict`` make a resumed run see exactly the batches an uninterrupted run would. A batch never
    straddles two epochs (the pool's last ``pool % batch_size`` rows of an epoch's order are skipped).
    """

    def __init__(self, rows: Sequence[Any], batch_size: int, seed: int = 0, pool_size: int = 0):
        self.rows = pool_rows(rows, pool_size)
        if batch_size < 1 or batch_size > len(self.rows):
            raise ValueError(f"batch_size must be in [1, {len(self.rows)}] (the pool's size), got {batch_size}")
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.offset = 0

    def _order(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.rows))

    @property
    def batches_per_epoch(self) -> int:
        return len(self.rows) // self.batch_size

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
