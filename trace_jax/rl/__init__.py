"""RL updates: tree-aware advantages, policy losses, train batches and the jit'd trainer."""
