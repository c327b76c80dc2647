"""trace_jax: TRACE (Tree Rollout Allocation for Contrastive Exploration) for multi-turn agentic RL in JAX."""

__version__ = "0.1.0"
