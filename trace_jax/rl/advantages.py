"""Tree-aware advantage estimators, one registered function per name (``grpo``, ``drgrpo``, ``rloo``,
``tree_grpo``, ``treerl``, ``node_value``).

Every estimator is defined in the *path view*: each leaf ``ℓ`` of a tree is one trajectory (its root-to-leaf
path) and every turn node ``y`` on that path gets an advantage ``A(ℓ, y)``; training on every path would
count a node shared by ``n_y`` leaves ``n_y`` times. The result is returned *deduplicated*, per node:

    weight(y)    = n_y                                  (leaf paths through y; 0 at the root)
    advantage(y) = (1 / n_y) Σ_{ℓ under y} A(ℓ, y)      (0 where n_y = 0)

so that ``weight(y) * advantage(y) = Σ_ℓ A(ℓ, y)``. Every estimator's path view has the form
``A(ℓ, y) = leaf_part[ℓ] + node_part[y]`` (kept on ``NodeAdvantages``): ``trace_jax.rl.batch`` needs it,
not just the mean, because a clipped loss is linear in A only per sign of A; it trains node ``y`` once
with the sums of the positive and of the negative ``A(ℓ, y)`` over its leaves, which is exact.

Notation: ``r_ℓ`` leaf reward; ``V̂(y)`` backed-up value (mean reward of leaves under ``y``,
``RolloutTree.values``); ``n_y`` leaves under ``y``; ``mean``/``std`` population statistics; ``ε`` = eps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from trace_jax.registry import Registry
from trace_jax.rollout.tree import ROOT, RolloutTree


@dataclasses.dataclass
class NodeAdvantages:
    """Per-node advantages of one tree (index = node id).

    Attributes:
      advantages: float32 [num_nodes]: mean over the node's leaves of ``A(ℓ, y)``; 0 at the root.
      weights: float32 [num_nodes]: how many times the node's tokens count in the loss (dedup weight n_y);
        0 at the root and at nodes with no finished leaf under them.
      leaf_part / node_part: float64 [num_leaves] (``tree.leaves()`` order) / [num_nodes]: the path view,
        ``A(ℓ, y) = leaf_part[ℓ] + node_part[y]`` for node ``y`` on leaf ``ℓ``'s path. None: node-constant,
        ``A(ℓ, y) = advantages[y]``.
    """

    advantages: np.ndarray
    weights: np.ndarray
    leaf_part: np.ndarray | None = None
    node_part: np.ndarray | None = None

    def path_advantages(self, tree: RolloutTree) -> np.ndarray:
        """float64 [num_nodes, num_leaves]: ``A(ℓ, y)`` for every node and leaf (meaningful where y is on ℓ's path)."""
        num_leaves = len(tree.leaves())
        node = self.advantages if self.node_part is None else self.node_part
        leaf = np.zeros(num_leaves) if self.leaf_part is None else self.leaf_part
        return np.asarray(node, np.float64)[:, None] + np.asarray(leaf, np.float64)[None, :]


Estimator = Callable[..., list[NodeAdvantages]]
# ``fn(trees, *, eps) -> list[NodeAdvantages]`` by name.
ESTIMATORS: Registry[Estimator] = Registry("advantage estimator")
register_estimator = ESTIMATORS.register


def compute_advantages(name: str, trees: Sequence[RolloutTree], eps: float = 1e-6) -> list[NodeAdvantages]:
    """Advantages of every tree of a batch with the estimator registered as ``name``."""
    return ESTIMATORS[name](trees, eps=eps)


# ------------------------------------------------------------------------------------------- helpers
def from_leaf_advantages(tree: RolloutTree, leaf_advantages: np.ndarray) -> NodeAdvantages:
    """Dedup of a path-constant advantage: ``A(ℓ, y) = leaf_advantages[ℓ]`` for every node of ℓ's path."""
    leaf_advantages = np.asarray(leaf_advantages, np.float64)
    sums = tree.subtree_sums(np.stack([np.ones_like(leaf_advantages), leaf_advantages], axis=1))
    counts = sums[:, 0].astype(np.float32)
    counts[ROOT] = 0.0
    return NodeAdvantages(
        advantages=np.where(counts > 0, sums[:, 1] / np.maximum(counts, 1), 0.0).astype(np.float32),
        weights=counts,
        leaf_part=leaf_advantages,
        node_part=np.zeros(len(tree)),
    )


def from_node_advantages(tree: RolloutTree, node_advantages: np.ndarray) -> NodeAdvantages:
    """Dedup of a node-constant advantage: ``A(ℓ, y) = node_advantages[y]`` on every path through y."""
    counts = tree.subtree_sums().astype(np.float32)
    counts[ROOT] = 0.0
    values = np.where(counts > 0, np.nan_to_num(node_advantages), 0.0)
    return NodeAdvantages(advantages=values.astype(np.float32), weights=counts)


def _normalise(x: np.ndarray, eps: float) -> np.ndarray:
    """(x − mean) / (std + ε); a group without spread (or empty) gives zeros, even with ε = 0."""
    if x.size == 0 or x.std() == 0:
        return np.zeros_like(x, dtype=np.float64)
    return (x - x.mean()) / (x.std() + eps)


# ---------------------------------------------------------------------------------------- estimators
@register_estimator("grpo")
def grpo(trees: Sequence[RolloutTree], *, eps: float = 1e-6) -> list[NodeAdvantages]:
    """GRPO, one group per tree: ``A(ℓ, y) = (r_ℓ − mean_tree r) / (std_tree r + ε)`` on every node of ℓ."""
    return [from_leaf_advantages(t, _normalise(t.leaf_rewards(), eps)) for t in trees]


@register_estimator("drgrpo")
def drgrpo(trees: Sequence[RolloutTree], *, eps: float = 1e-6) -> list[NodeAdvantages]:
    """Dr. GRPO (no std scaling): ``A(ℓ, y) = r_ℓ − mean_tree r``."""
    del eps
    return [from_leaf_advantages(t, t.leaf_rewards() - t.leaf_rewards().mean()) for t in trees]


@register_estimator("rloo")
def rloo(trees: Sequence[RolloutTree], *, eps: float = 1e-6) -> list[NodeAdvantages]:
    """RLOO, leave-one-out baseline: ``A(ℓ, y) = r_ℓ − mean_{ℓ' ≠ ℓ} r_ℓ' = n/(n−1) (r_ℓ − mean r)``; 0 if n = 1."""
    del eps
    out = []
    for tree in trees:
        rewards = tree.leaf_rewards()
        n = rewards.size
        leaf_adv = np.zeros(n) if n < 2 else n / (n - 1) * (rewards - rewards.mean())
        out.append(from_leaf_advantages(tree, leaf_adv))
    return out


@register_estimator("tree_grpo")
def tree_grpo(trees: Sequence[RolloutTree], *, eps: float = 1e-6) -> list[NodeAdvantages]:
    """Tree-GRPO: intra-tree plus inter-tree normalised rewards, summed.

    ``A(ℓ, y) = (r_ℓ − mean_{T(ℓ)} r) / (std_{T(ℓ)} r + ε) + (r_ℓ − mean_P r) / (std_P r + ε)``

    *(ours)* Tree-GRPO grows several trees per prompt, each from one initial chain; here those trees are
    the subtrees under the root's children (the stage-1 chains), ``T(ℓ)`` is the one holding ℓ, and ``P``
    is all leaves of the prompt. A subtree with a single leaf has intra-tree advantage 0.
    """
    out = []
    for tree in trees:
        rewards = tree.leaf_rewards()
        chain_of_leaf = np.asarray([tree.path(leaf)[1] for leaf in tree.leaves()], np.int64)
        intra = np.zeros_like(rewards)
        for chain in np.unique(chain_of_leaf):
            members = chain_of_leaf == chain
            intra[members] = _normalise(rewards[members], eps)
        out.append(from_leaf_advantages(tree, intra + _normalise(rewards, eps)))
    return out


@register_estimator("treerl")
def treerl(trees: Sequence[RolloutTree], *, eps: float = 1e-6) -> list[NodeAdvantages]:
    """TreeRL: global plus local value gain, damped by the node's leaf count.

    ``A(ℓ, y) = [(V̂(y) − V̂(root)) + (V̂(y) − V̂(parent(y)))] / sqrt(n_y)`` on every path through y.
    """
    del eps
    out = []
    for tree in trees:
        counts, values = tree.backups()
        node_adv = np.zeros(len(tree))
        for node in tree.nodes[1:]:
            if counts[node.node_id] == 0:
                continue
            v = values[node.node_id]
            node_adv[node.node_id] = (2 * v - values[ROOT] - values[node.parent]) / np.sqrt(counts[node.node_id])
        out.append(from_node_advantages(tree, node_adv))
    return out


@register_estimator("node_value")
def node_value(trees: Sequence[RolloutTree], *, eps: float = 1e-6) -> list[NodeAdvantages]:
    """AT²PO-style node value: a turn's tokens get the normalised backed-up value of the node it produced.

    ``A(ℓ, y) = (V̂(y) − mean_Y V̂) / (std_Y V̂ + ε)`` with ``Y`` the tree's turn nodes that have a leaf
    under them *(ours: normalised within the tree, unweighted)*.
    """
    out = []
    for tree in trees:
        counts, values = tree.backups()
        turns = np.asarray([n.node_id for n in tree.nodes[1:] if counts[n.node_id] > 0], np.int64)
        node_adv = np.zeros(len(tree))
        if turns.size:
            node_adv[turns] = _normalise(values[turns], eps)
        out.append(from_node_advantages(tree, node_adv))
    return out
