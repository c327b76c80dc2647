"""Predictor inputs gathered from rollout trees: the anchors TRACE allocates to and trains its predictor on.

An anchor is a (tree index, node id) pair; :func:`gather_anchors` turns a list of them into an
:class:`AnchorBatch` of host arrays (features, depths, prompt keys, optionally ``V̂`` targets, leaf-count
weights and history ids) that every :class:`trace_jax.allocation.predictor.SuccessPredictor` reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from trace_jax.allocation.history import PromptHistory
from trace_jax.rollout.tree import RolloutTree


@dataclasses.dataclass
class AnchorBatch:
    """Predictor inputs (and, for training, targets) for N anchors, gathered from trees on the host.

    features_nd: float32 [N, D] anchor features (zeros where a node has none, see ``has_feature_n``; D = 0 when
      no node of the trees has one).
    has_feature_n: bool [N].
    depths_n: int32 [N] node depth (0 = root).
    prompt_keys_n: int64 [N] the tree's ``prompt_key``, the same whenever a prompt comes back (per-prompt baselines).
    targets_n: float64 [N] ``V̂`` backups (NaN where unknown or not gathered).
    weights_n: float64 [N] leaves under each anchor (0 where not gathered).
    prefix_ids: per anchor the int32 ids of its history (only when gathered ``with_prefix_ids``).
    history_nh: float32 [N, H] the prompt's outcome history (``PromptHistory.features``; only when gathered
      with a ``history``): the same for every anchor of a prompt, zeros for a prompt never seen.
    """

    features_nd: np.ndarray
    has_feature_n: np.ndarray
    depths_n: np.ndarray
    prompt_keys_n: np.ndarray
    targets_n: np.ndarray
    weights_n: np.ndarray
    prefix_ids: list[np.ndarray] | None = None
    history_nh: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.depths_n.shape[0])


def gather_anchors(
    trees: Sequence[RolloutTree],
    items: Sequence[tuple[int, int]],
    with_targets: bool = False,
    with_prefix_ids: bool = False,
    history: PromptHistory | None = None,
) -> AnchorBatch:
    """Collects the anchors ``items`` = [(tree index, node id), ...].

    Adds ``V̂`` targets and leaf counts with ``with_targets``, each anchor's history ids with
    ``with_prefix_ids`` (for predictors that read tokens, see ``needs_prefix_ids``), and its prompt's outcome
    history features with a ``history``.
    """
    num = len(items)
    nodes = [trees[t][n] for t, n in items]
    has_feature = np.fromiter((node.feature is not None for node in nodes), bool, num)
    found = [node.feature for node in nodes if node.feature is not None]
    dims = {f.shape[0] for f in found}
    if len(dims) > 1:
        raise ValueError(f"anchor features have different sizes {sorted(dims)}; one predictor needs one size")
    features = np.zeros((num, dims.pop() if dims else 0), np.float32)
    if found:
        features[has_feature] = np.stack(found)
    depths = np.fromiter((node.depth for node in nodes), np.int32, num)
    keys = np.fromiter((trees[t].prompt_key for t, _ in items), np.int64, num)
    targets = np.full(num, np.nan)
    weights = np.zeros(num)
    if with_targets:
        backups: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for row, (tree_index, node_id) in enumerate(items):
            if tree_index not in backups:
                backups[tree_index] = (trees[tree_index].values(), trees[tree_index].leaf_counts())
            values, counts = backups[tree_index]
            targets[row], weights[row] = values[node_id], counts[node_id]
    prefix_ids = [trees[t].prefix_ids(n) for t, n in items] if with_prefix_ids else None
    history_nh = None if history is None else history.features(keys)
    return AnchorBatch(features, has_feature, depths, keys, targets, weights, prefix_ids, history_nh)


def training_anchors(
    trees: Sequence[RolloutTree], with_prefix_ids: bool = False, history: PromptHistory | None = None
) -> AnchorBatch:
    """Every non-leaf node with at least one leaf below, with its ``V̂`` target and leaf-count weight."""
    items = []
    for tree_index, tree in enumerate(trees):
        counts = tree.leaf_counts()
        items += [(tree_index, n.node_id) for n in tree if not n.is_leaf and counts[n.node_id] > 0]
    return gather_anchors(trees, items, with_targets=True, with_prefix_ids=with_prefix_ids, history=history)
