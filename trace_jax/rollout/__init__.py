"""Rollouts: the paged, jit-compiled decode engine, the multi-turn runner and the trees it grows.

    from trace_jax.rollout import Engine, EngineConfig, RolloutRunner, RunnerConfig
    runner = RolloutRunner(Engine(model_config, EngineConfig(), params), env, RunnerConfig())

``engine`` (a package) is the decode engine: JetStream's engine interface plus a fork (one prefix into k slots)
and per-slot extends; ``runner`` turns continuation requests into turns, observations and ``RolloutTree`` nodes;
``figures`` computes the public figures of a batch of trees (effective ratio, signal-token share).
"""

from trace_jax.rollout.backend import ContinuationRequest, RolloutBackend, RolloutStats
from trace_jax.rollout.engine import Engine, EngineConfig
from trace_jax.rollout.runner import RolloutRunner, RunnerConfig
from trace_jax.rollout.tree import ROOT, Node, RolloutTree

__all__ = [
    "ROOT",
    "ContinuationRequest",
    "Engine",
    "EngineConfig",
    "Node",
    "RolloutBackend",
    "RolloutRunner",
    "RolloutStats",
    "RolloutTree",
    "RunnerConfig",
]
