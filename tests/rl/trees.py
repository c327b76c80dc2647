"""Small hand-made rollout trees shared by the RL tests."""

import numpy as np

from trace_jax.rollout.tree import RolloutTree


def branching_tree() -> RolloutTree:
    """root ─ a ─┬─ b (r=1)        node ids: root 0, a 1, b 2, c 3, d 4
           └─ c (r=0)        leaves under: root 3, a 2, b/c/d 1
    └─ d (r=0)               V̂: root 1/3, a 1/2, b 1, c 0, d 0
    """
    tree = RolloutTree([1, 2, 3], task="q")
    turn = lambda parent, ids, lp, **kw: tree.add_turn(parent, ids, logprobs=lp, sample_logprobs=lp, **kw)
    a = turn(0, [10, 11], [-0.5, -0.25], observation_ids=[90, 91])
    turn(a, [20], [-1.0], reward=1.0)
    turn(a, [21, 22], [-0.1, -0.2], reward=0.0)
    turn(0, [30], [-2.0], reward=0.0)
    return tree


def random_tree(rng: np.random.Generator, vocab: int = 32, max_leaves: int = 5) -> RolloutTree:
    """A random tree of short turns with random rewards, branching at random depths (property-style tests)."""
    tree = RolloutTree(rng.integers(1, vocab, size=rng.integers(1, 4)))
    open_nodes = [0]
    for _ in range(int(rng.integers(1, max_leaves + 1))):
        parent = int(rng.choice(open_nodes))
        node = parent
        while True:
            n = int(rng.integers(1, 4))
            done = rng.random() < 0.5 or tree[node].depth >= 3
            logprobs = -rng.random(n)
            node = tree.add_turn(
                node,
                rng.integers(1, vocab, size=n),
                logprobs=logprobs,
                sample_logprobs=logprobs,
                observation_ids=None if done else rng.integers(1, vocab, size=int(rng.integers(0, 3))),
                reward=float(rng.integers(0, 2)) if done else None,
            )
            if done:
                break
            open_nodes.append(node)
    return tree
