"""Rollout trees -> ``TrainBatch``: one row per leaf path, each turn trained once, shapes bucketed.

Row layout. Leaf ``ℓ``'s row holds the exact token ids of its history (``tree.prefix_ids(ℓ)``: the prompt,
then every turn's sampled ids and observation ids, as sampled; text is never re-tokenized), right-padded
to a bucketed length. Per-token arrays are aligned with the tokens: entry ``t`` is about token ``t``.

Dedup. A turn node shared by several leaves appears in several rows; only the first row (in leaf order)
that contains it trains it, with the node's dedup weight (``NodeAdvantages.weights``: the number of leaf
paths through it, or 1 with ``segment_weight="one"``). In the other rows it is context only (weight 0).
Prompt tokens, observation (tool) tokens and padding always have weight 0.

Shapes. The length ``T`` is the smallest of ``length_buckets`` that fits the longest row; the row count is
padded (with weight-0 rows) to the smallest of ``row_buckets`` that fits, then to a multiple of
``row_multiple`` (data-parallel shards × micro-batches), so a run compiles a handful of programs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from trace_jax.buckets import bucket, round_up
from trace_jax.rl.advantages import NodeAdvantages, compute_advantages
from trace_jax.rollout.tree import RolloutTree


class TrainBatch(NamedTuple):
    """Device-side training rows (a pytree of arrays; ``ref_logprobs`` may be None).

    tokens: int32 [B, T] ids exactly as sampled, right-padded with ``pad_id``.
    weights: float32 [B, T] per-token loss weight = loss mask × dedup weight.
    advantages: float32 [B, T] advantage of the token's turn (0 where weight is 0).
    old_logprobs: float32 [B, T] log-probs of the sampling policy (0 where weight is 0).
    segment_ids: int32 [B, T] the turn's depth (1, 2, ...) on trained tokens, 0 elsewhere.
    lengths: int32 [B] real tokens per row (0 for padding rows).
    ref_logprobs: float32 [B, T] reference-policy log-probs, or None until filled in by the trainer.
    """

    tokens: np.ndarray
    weights: np.ndarray
    advantages: np.ndarray
    old_logprobs: np.ndarray
    segment_ids: np.ndarray
    lengths: np.ndarray
    ref_logprobs: np.ndarray | None = None

    @property
    def loss_mask(self) -> np.ndarray:
        """float32 [B, T]: 1 on the tokens this batch trains."""
        return (np.asarray(self.weights) > 0).astype(np.float32)


@dataclasses.dataclass
class BatchInfo:
    """Host-side bookkeeping of a batch.

    Attributes:
      tree_index: int32 [B] which input tree a row came from (-1 for padding rows).
      leaf_id: int32 [B] the node id of the row's leaf (-1 for padding rows).
      num_rows: real rows (before padding).
      num_tokens: real tokens over all rows (what the forward pass processes, padding excluded).
      num_trained_tokens: tokens with non-zero weight (each sampled turn token at most once).
      num_trees_skipped: trees left out by ``skip_zero_advantage``.
    """

    tree_index: np.ndarray
    leaf_id: np.ndarray
    num_rows: int
    num_tokens: int
    num_trained_tokens: int
    num_trees_skipped: int


SEGMENT_WEIGHTS = ("leaves", "one")


@dataclasses.dataclass(frozen=True)
class BatchConfig:
    """How trees become rows.

    Attributes:
      length_buckets: allowed row lengths T (ascending); a row longer than the largest is an error.
      row_buckets: allowed row counts before ``row_multiple`` padding; None: no row bucketing.
      row_multiple: the row count is padded to a multiple of this (data × fsdp shards × micro-batches).
      segment_weight: "leaves": a turn weighs the number of leaf paths through it (the per-path objective);
        "one": each turn weighs 1 (a tree-native objective).
      skip_zero_advantage: leave out trees whose every advantage is 0 (no policy-gradient signal).
      pad_id: token id used for padding (never trained, never attended to by real tokens).
    """

    length_buckets: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096)
    row_buckets: tuple[int, ...] | None = (8, 16, 32, 64, 128, 256, 512, 1024)
    row_multiple: int = 1
    segment_weight: str = "leaves"
    skip_zero_advantage: bool = False
    pad_id: int = 0

    def __post_init__(self):
        if self.segment_weight not in SEGMENT_WEIGHTS:
            raise ValueError(f"segment_weight must be one of {SEGMENT_WEIGHTS}, got {self.segment_weight!r}")
        if not self.length_buckets or list(self.length_buckets) != sorted(self.length_buckets):
            raise ValueError(f"length_buckets must be a non-empty ascending tuple, got {self.length_buckets}")
        if self.row_multiple < 1:
            raise ValueError(f"row_multiple must be >= 1, got {self.row_multiple}")


def _row_count(n: int, config: BatchConfig) -> int:
    """Padded row count: the row bucket (past the largest, a multiple of it), then a multiple of ``row_multiple``."""
    buckets = config.row_buckets
    if buckets:
        n = bucket(n, buckets, "rows") if n <= buckets[-1] else round_up(n, buckets[-1])
    return round_up(n, config.row_multiple)


class _Row(NamedTuple):
    tree_index: int
    leaf_id: int
    tokens: np.ndarray
    weights: np.ndarray
    advantages: np.ndarray
    old_logprobs: np.ndarray
    segment_ids: np.ndarray


def _tree_rows(tree_index: int, tree: RolloutTree, adv: NodeAdvantages, segment_weight: str) -> list[_Row]:
    rows = []
    trained: set[int] = set()
    for leaf in tree.leaves():
        parts: dict[str, list[np.ndarray]] = {k: [] for k in ("tokens", "weights", "advantages", "old", "segments")}
        for node_id in tree.path(leaf):
            node = tree[node_id]
            n_turn, n_obs = node.token_ids.shape[0], node.observation_ids.shape[0]
            train = node.parent is not None and node_id not in trained and adv.weights[node_id] > 0
            if train:
                trained.add(node_id)
            weight = (adv.weights[node_id] if segment_weight == "leaves" else 1.0) if train else 0.0
            parts["tokens"] += [node.token_ids, node.observation_ids]
            # node.loss_mask is 1 on sampled turn tokens and 0 on observations and on the prompt.
            parts["weights"].append(node.loss_mask * weight)
            parts["advantages"].append(
                np.concatenate([np.full(n_turn, adv.advantages[node_id] if train else 0.0), np.zeros(n_obs)])
            )
            parts["old"].append(np.concatenate([node.logprobs if train else np.zeros(n_turn), np.zeros(n_obs)]))
            parts["segments"].append(np.concatenate([np.full(n_turn, node.depth if train else 0), np.zeros(n_obs)]))
        rows.append(
            _Row(
                tree_index,
                leaf,
                np.concatenate(parts["tokens"]).astype(np.int32),
                np.concatenate(parts["weights"]).astype(np.float32),
                np.concatenate(parts["advantages"]).astype(np.float32),
                np.concatenate(parts["old"]).astype(np.float32),
                np.concatenate(parts["segments"]).astype(np.int32),
            )
        )
    return rows


def build_batch(
    trees: Sequence[RolloutTree], advantages: Sequence[NodeAdvantages], config: BatchConfig | None = None
) -> tuple[TrainBatch, BatchInfo]:
    """Rows for every leaf of every tree (see the module docstring); ``advantages[i]`` belongs to ``trees[i]``."""
    config = config or BatchConfig()
    if len(trees) != len(advantages):
        raise ValueError(f"{len(trees)} trees but {len(advantages)} advantage sets")
    rows: list[_Row] = []
    skipped = 0
    for i, (tree, adv) in enumerate(zip(trees, advantages, strict=True)):
        if config.skip_zero_advantage and not np.any(adv.advantages[adv.weights > 0]):
            skipped += 1
            continue
        rows += _tree_rows(i, tree, adv, config.segment_weight)
    if not rows:
        raise ValueError(
            f"no rows to train: {len(trees)} trees, {skipped} skipped for zero advantage, the rest without a leaf"
        )
    longest = max(r.tokens.shape[0] for r in rows)
    if longest > config.length_buckets[-1]:
        raise ValueError(
            f"a row has {longest} tokens, more than the largest length bucket {config.length_buckets[-1]}; "
            "add a larger bucket to length_buckets or lower the rollout token limits"
        )
    t = bucket(longest, config.length_buckets, "row length")
    b = _row_count(len(rows), config)

    tokens = np.full((b, t), config.pad_id, np.int32)
    floats = {k: np.zeros((b, t), np.float32) for k in ("weights", "advantages", "old_logprobs")}
    segment_ids = np.zeros((b, t), np.int32)
    lengths = np.zeros(b, np.int32)
    tree_index = np.full(b, -1, np.int32)
    leaf_id = np.full(b, -1, np.int32)
    for r, row in enumerate(rows):
        n = row.tokens.shape[0]
        tokens[r, :n] = row.tokens
        floats["weights"][r, :n] = row.weights
        floats["advantages"][r, :n] = row.advantages
        floats["old_logprobs"][r, :n] = row.old_logprobs
        segment_ids[r, :n] = row.segment_ids
        lengths[r] = n
        tree_index[r], leaf_id[r] = row.tree_index, row.leaf_id
    batch = TrainBatch(tokens=tokens, segment_ids=segment_ids, lengths=lengths, **floats)
    info = BatchInfo(
        tree_index=tree_index,
        leaf_id=leaf_id,
        num_rows=len(rows),
        num_tokens=int(lengths.sum()),
        num_trained_tokens=int((floats["weights"] > 0).sum()),
        num_trees_skipped=skipped,
    )
    return batch, info


def trees_to_batch(
    trees: Sequence[RolloutTree], estimator: str, config: BatchConfig | None = None, eps: float = 1e-6
) -> tuple[TrainBatch, BatchInfo, list[NodeAdvantages]]:
    """``compute_advantages(estimator, trees)`` then ``build_batch``; also returns the advantages (for metrics)."""
    advantages = compute_advantages(estimator, trees, eps=eps)
    batch, info = build_batch(trees, advantages, config)
    return batch, info, advantages
