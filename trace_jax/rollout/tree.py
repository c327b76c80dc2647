"""Rollout trees: one tree per prompt, one node per ReAct turn.

A node holds what the policy produced in its turn (``token_ids`` with their log-probabilities) and what
the environment answered (``observation_ids``). The token ids of the history that ends at node ``y`` are
the concatenation, along the root-to-``y`` path, of ``token_ids + observation_ids``; that history is the
*prefix* ``H`` of TRACE and the place where more continuations may be sampled (an *anchor*).

The root (depth 0) holds the prompt ids in ``token_ids``; it is never trained (loss mask 0). A *leaf* is a
finished trajectory with a terminal reward. Node values are the backups of ``docs/method.md``:
``V(leaf) = r`` and ``V(y) = sum_c n_c V(c) / n_y`` = mean reward of the leaves under ``y``.

Everything here is host-side numpy; ids and log-probs are stored exactly as sampled (token-in/token-out).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

ROOT = 0


def _ids(values: Sequence[int] | np.ndarray | None) -> np.ndarray:
    return np.asarray([] if values is None else values, dtype=np.int32).reshape(-1)


def _floats(values: Sequence[float] | np.ndarray | None, length: int, name: str) -> np.ndarray:
    out = np.zeros(length, np.float32) if values is None else np.asarray(values, np.float32).reshape(-1)
    if out.shape[0] != length:
        raise ValueError(f"{name} has {out.shape[0]} entries for {length} tokens")
    return out


def _routing(values: Any, sampled: int, total: int) -> np.ndarray | None:
    """A node's routing record: [total tokens (sampled + observation), sparse layers, top-k], or [sampled, ...]
    (the sampled tokens only: a record taken before the observation was appended, or from a sampler that
    recorded no context; the observation's rows then count as unrecorded)."""
    if values is None:
        return None
    out = np.asarray(values, np.int32)
    if out.ndim != 3 or out.shape[0] not in (sampled, total):
        want = f"{sampled}" if sampled == total else f"{sampled} or {total}"
        raise ValueError(f"routed_experts has shape {out.shape}; want [{want} tokens, sparse layers, top-k]")
    return out


@dataclasses.dataclass
class Node:
    """One turn of a rollout (or the prompt, at the root).

    Attributes:
      node_id: index of the node in its tree (the root is 0).
      parent: parent's id; None at the root.
      depth: 0 at the root, t for the t-th turn.
      token_ids: int32 [n] ids the policy sampled in this turn (the prompt ids at the root).
      logprobs: float32 [n] log-probabilities of ``token_ids`` under the untempered policy (diagnostics).
        Zero at the root.
      sample_logprobs: float32 [n] log-probabilities under the distribution the tokens were drawn from
        (tempered, top-k / top-p truncated): the behaviour log-probs PPO's ratio needs.
      entropies: float32 [n] per-token entropy of the untempered policy (for entropy-guided baselines).
      observation_ids: int32 [o] ids the environment appended after this turn (never trained).
      feature: float32 [d] predictor input at this node as an anchor: the policy's final hidden state at
        the last token of the prefix that ends with this node (after its observation). None if unknown.
      reward: terminal reward for leaves, None for inner nodes.
      info: free-form facts from the environment (format error, search query, retrieval failure...).
      children: ids of child nodes, in creation order.
      routed_experts: int32 [n + o, sparse layers, top-k] the experts each of ``token_ids + observation_ids``
        went to in the sampler's forward (a mixture-of-experts policy with ``EngineConfig.routing_replay``):
        sampled tokens as decoded, the prompt (root) and observation tokens as the engine appended them; -1
        rows are tokens without a record. The trainer's forward replays every recorded row. A record of the
        n sampled tokens only (observation not appended yet, or a sampler without context records) is
        accepted; its observation counts as unrecorded. None when nothing was recorded.
    """

    node_id: int
    parent: int | None
    depth: int
    token_ids: np.ndarray
    logprobs: np.ndarray
    sample_logprobs: np.ndarray
    entropies: np.ndarray
    observation_ids: np.ndarray
    feature: np.ndarray | None = None
    reward: float | None = None
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    children: list[int] = dataclasses.field(default_factory=list)
    routed_experts: np.ndarray | None = None

    @property
    def is_leaf(self) -> bool:
        return self.reward is not None

    @property
    def num_tokens(self) -> int:
        """Tokens this node adds to the history (sampled + observation)."""
        return int(self.token_ids.shape[0] + self.observation_ids.shape[0])

    @property
    def loss_mask(self) -> np.ndarray:
        """float32 [num_tokens]: 1 on sampled turn tokens, 0 on observation tokens; all 0 at the root."""
        sampled = 0.0 if self.parent is None else 1.0
        return np.concatenate(
            [np.full(self.token_ids.shape[0], sampled, np.float32), np.zeros(self.observation_ids.shape[0], np.float32)]
        )


class RolloutTree:
    """All rollouts of one prompt, sharing the prefixes where they branched.

    Args:
      prompt_ids: token ids of the rendered prompt (the root's history).
      task: whatever the environment needs to judge this prompt (question, gold answers, ...).
      prompt_index: the prompt's position in its batch / dataset, for bookkeeping.
    """

    def __init__(self, prompt_ids: Sequence[int] | np.ndarray, task: Any = None, prompt_index: int = 0):
        self.task = task
        self.prompt_index = prompt_index
        # The policy version (RL updates behind the weights) that sampled it, when the job records it.
        self.policy_version: int | None = None
        ids = _ids(prompt_ids)
        zeros = np.zeros(ids.shape[0], np.float32)
        self.nodes: list[Node] = [Node(ROOT, None, 0, ids, zeros, zeros, zeros, _ids(None))]

    @property
    def prompt_key(self) -> int:
        """The same integer whenever this prompt comes back, in any batch position or process (the per-prompt
        predictor's key): the CRC-32 of the task's ``"id"`` when it has one, else ``prompt_index``."""
        if isinstance(self.task, Mapping) and self.task.get("id") is not None:
            return zlib.crc32(str(self.task["id"]).encode())
        return int(self.prompt_index)

    # ----------------------------------------------------------------------------------------- building
    def add_turn(
        self,
        parent: int,
        token_ids: Sequence[int] | np.ndarray,
        logprobs: Sequence[float] | np.ndarray | None = None,
        sample_logprobs: Sequence[float] | np.ndarray | None = None,
        entropies: Sequence[float] | np.ndarray | None = None,
        observation_ids: Sequence[int] | np.ndarray | None = None,
        reward: float | None = None,
        feature: np.ndarray | None = None,
        info: dict[str, Any] | None = None,
        routed_experts: np.ndarray | None = None,
    ) -> int:
        """Appends a turn under ``parent`` and returns its id. A reward makes it a leaf."""
        parent_node = self.nodes[parent]
        if parent_node.is_leaf:
            raise ValueError(f"node {parent} is a leaf (reward {parent_node.reward}); it cannot be continued")
        ids = _ids(token_ids)
        n = ids.shape[0]
        node = Node(
            node_id=len(self.nodes),
            parent=parent,
            depth=parent_node.depth + 1,
            token_ids=ids,
            logprobs=_floats(logprobs, n, "logprobs"),
            sample_logprobs=_floats(sample_logprobs, n, "sample_logprobs"),
            entropies=_floats(entropies, n, "entropies"),
            observation_ids=_ids(observation_ids),
            feature=None if feature is None else np.asarray(feature, np.float32),
            reward=None if reward is None else float(reward),
            info=dict(info or {}),
            routed_experts=_routing(routed_experts, n, n + _ids(observation_ids).shape[0]),
        )
        self.nodes.append(node)
        parent_node.children.append(node.node_id)
        return node.node_id

    def record_routing(self, node_id: int, experts: np.ndarray, start: int) -> None:
        """Keeps the engine's routing of positions ``start .. start + len(experts)`` of the history that ends
        with ``node_id`` (``prefix_ids``), int32 [ids, sparse layers, top-k], on the nodes that hold them. A
        token keeps its first record: a later forward of the same positions (a history appended again, a
        prefix's last id recomputed) leaves it, so every token has one row whichever call filled the cache."""
        experts = np.asarray(experts, np.int32)
        begin = 0
        for i in self.path(node_id):
            node = self.nodes[i]
            lo, hi = max(start - begin, 0), min(start + len(experts) - begin, node.num_tokens)
            if lo < hi:
                rows = experts[begin + lo - start : begin + hi - start]
                record = node.routed_experts
                if record is None or record.shape[0] < node.num_tokens:
                    full = np.full((node.num_tokens, *experts.shape[1:]), -1, np.int32)
                    if record is not None:
                        full[: record.shape[0]] = record
                    record = node.routed_experts = full
                unset = record[lo:hi, 0, 0] < 0
                record[lo:hi][unset] = rows[unset]
            begin += node.num_tokens

    # ------------------------------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __getitem__(self, node_id: int) -> Node:
        return self.nodes[node_id]

    @property
    def root(self) -> Node:
        return self.nodes[ROOT]

    def leaves(self) -> list[int]:
        """Ids of finished trajectories, in creation order."""
        return [n.node_id for n in self.nodes if n.is_leaf]

    def anchors(self) -> list[int]:
        """Ids of nodes where continuations can be sampled: the root and every unfinished turn node."""
        return [n.node_id for n in self.nodes if not n.is_leaf]

    def path(self, node_id: int) -> list[int]:
        """Node ids from the root to ``node_id``, both included."""
        out = []
        cursor: int | None = node_id
        while cursor is not None:
            out.append(cursor)
            cursor = self.nodes[cursor].parent
        return out[::-1]

    def prefix_ids(self, node_id: int) -> np.ndarray:
        """int32 token ids of the history ending with ``node_id`` (its turn and its observation)."""
        parts = []
        for i in self.path(node_id):
            parts += [self.nodes[i].token_ids, self.nodes[i].observation_ids]
        return np.concatenate(parts).astype(np.int32)

    def prefix_length(self, node_id: int) -> int:
        return sum(self.nodes[i].num_tokens for i in self.path(node_id))

    def subtree_sums(self, leaf_values: Sequence[float] | np.ndarray | None = None) -> np.ndarray:
        """float64 [num_nodes, ...]: for every node, the sum of ``leaf_values`` over the leaves under it.

        ``leaf_values``: [num_leaves, ...] in ``leaves()`` order (default 1 per leaf: the leaf counts). A leaf
        counts itself. This is the package's one bottom-up traversal: leaf counts, value backups, allocation's
        backups and the advantages' per-node sums all go through it.
        """
        leaves = self.leaves()
        values = np.ones(len(leaves)) if leaf_values is None else np.asarray(leaf_values, np.float64)
        if values.shape[:1] != (len(leaves),):
            raise ValueError(f"leaf_values has {values.shape[:1]} rows for {len(leaves)} leaves")
        sums = np.zeros((len(self.nodes), *values.shape[1:]))
        sums[leaves] = values
        for node in reversed(self.nodes[1:]):  # children always come after their parent
            sums[node.parent] += sums[node.node_id]
        return sums

    def backups(self) -> tuple[np.ndarray, np.ndarray]:
        """(int64 [num_nodes] leaves under each node, float64 [num_nodes] ``V̂``) in one traversal.

        ``V̂(y)`` is the mean reward of the leaves under ``y`` (NaN with no leaf under it).
        """
        sums = self.subtree_sums(np.stack([np.ones(len(self.leaves())), self.leaf_rewards()], axis=1))
        counts = sums[:, 0].astype(np.int64)
        with np.errstate(invalid="ignore", divide="ignore"):
            return counts, np.where(counts > 0, sums[:, 1] / np.maximum(counts, 1), np.nan)

    def leaf_counts(self) -> np.ndarray:
        """int64 [num_nodes]: number of leaves under each node (a leaf counts itself)."""
        return self.subtree_sums().astype(np.int64)

    def values(self) -> np.ndarray:
        """float64 [num_nodes]: V̂ backups, the mean leaf reward under each node; NaN with no leaf under it."""
        return self.backups()[1]

    def leaf_rewards(self) -> np.ndarray:
        return np.asarray([self.nodes[i].reward for i in self.leaves()], np.float64).reshape(-1)

    def is_mixed(self) -> bool:
        """True when the leaves' rewards differ: the tree gives a non-zero group advantage."""
        rewards = self.leaf_rewards()
        return rewards.size > 1 and bool(np.ptp(rewards) > 0)

    def num_sampled_tokens(self) -> int:
        """Tokens the policy generated in this tree (prompt and observations excluded)."""
        return int(sum(n.token_ids.shape[0] for n in self.nodes[1:]))

    # ---------------------------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "prompt_index": self.prompt_index,
            "nodes": [dataclasses.asdict(n) for n in self.nodes],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RolloutTree:
        tree = cls(data["nodes"][0]["token_ids"], data["task"], data["prompt_index"])
        tree.nodes = []
        for raw in data["nodes"]:
            raw = dict(raw)
            for key in ("token_ids", "observation_ids"):
                raw[key] = _ids(raw[key])
            for key in ("logprobs", "sample_logprobs", "entropies"):
                raw[key] = np.asarray(raw[key], np.float32)
            if raw["feature"] is not None:
                raw["feature"] = np.asarray(raw["feature"], np.float32)
            sampled = raw["token_ids"].shape[0]
            raw["routed_experts"] = _routing(
                raw.get("routed_experts"), sampled, sampled + raw["observation_ids"].shape[0]
            )
            tree.nodes.append(Node(**raw))
        return tree
