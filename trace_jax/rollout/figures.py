"""The public figures of a batch of rollout trees: one function each, used by train, evaluate and bench alike.

All functions take the batch's trees (one per prompt, including prompts that got no rollout: they count in
the denominator of per-prompt figures, so filtering a prompt can never raise the effective ratio by itself).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from trace_jax.rollout.tree import RolloutTree


def effective_ratio(trees: Sequence[RolloutTree]) -> float:
    """Share of the batch's prompts whose tree has both a success and a failure leaf (non-zero group advantage).

    0.0 for an empty batch.
    """
    if not trees:
        return 0.0
    return float(np.mean([tree.is_mixed() for tree in trees]))


def nonzero_advantage_share(trees: Sequence[RolloutTree], generated_tokens: int | None = None) -> dict[str, float]:
    """Share of leaves and of generated tokens that carry a non-zero group advantage.

    A leaf (and every sampled token of its tree) carries signal exactly when its tree is mixed: a group
    whose rewards are all equal normalises to zero advantage. Tokens are counted once per tree node (shared
    prefixes are generated once). ``generated_tokens`` overrides the token denominator, for policies that
    generated tokens they then threw away (dynamic sampling); by default it is the tokens in ``trees``.

    Returns ``{"leaves": float, "tokens": float}``, each in [0, 1] (0.0 when there is nothing to count).
    """
    mixed = np.asarray([tree.is_mixed() for tree in trees], bool)
    leaves = np.asarray([len(tree.leaves()) for tree in trees], np.int64)
    tokens = np.asarray([tree.num_sampled_tokens() for tree in trees], np.int64)
    total_tokens = int(tokens.sum()) if generated_tokens is None else int(generated_tokens)
    return {
        "leaves": float(leaves[mixed].sum() / leaves.sum()) if leaves.sum() else 0.0,
        "tokens": float(tokens[mixed].sum() / total_tokens) if total_tokens else 0.0,
    }


def tokens_per_leaf(trees: Sequence[RolloutTree]) -> float:
    """Generated tokens per finished trajectory: below a chain's length when leaves share prefixes."""
    num_leaves = sum(len(tree.leaves()) for tree in trees)
    return float(sum(tree.num_sampled_tokens() for tree in trees) / num_leaves) if num_leaves else 0.0


def mixed_anchor_share(trees: Sequence[RolloutTree]) -> float:
    """Share of inner nodes (anchors with at least two leaves below) whose leaves disagree: turn-level signal."""
    mixed = total = 0
    for tree in trees:
        counts, values = tree.leaf_counts(), tree.values()
        inner = np.asarray([not node.is_leaf for node in tree], bool) & (counts >= 2)
        total += int(inner.sum())
        mixed += int((inner & (values > 0) & (values < 1)).sum())
    return mixed / total if total else 0.0


def batch_figures(trees: Sequence[RolloutTree], generated_tokens: int | None = None) -> dict[str, float]:
    """Every figure above in one flat dict (for logs and bench tables)."""
    share = nonzero_advantage_share(trees, generated_tokens)
    return {
        "effective_ratio": effective_ratio(trees),
        "nonzero_advantage_leaves": share["leaves"],
        "nonzero_advantage_tokens": share["tokens"],
        "tokens_per_leaf": tokens_per_leaf(trees),
        "mixed_anchor_share": mixed_anchor_share(trees),
    }
