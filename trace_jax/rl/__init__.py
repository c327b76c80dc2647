"""RL updates: tree-aware advantages, policy losses, tree-packed train batches, chunked log-probs and the jit'd
PPO trainer (``advantages``, ``losses``, ``packing`` -> ``batch``, ``logprobs``, ``trainer``)."""
