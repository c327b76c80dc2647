"""The paged, jit-compiled decode engine: JetStream's engine interface plus forks and per-slot extends.

    from trace_jax.rollout.engine import Engine, EngineConfig
    engine = Engine(model_config, EngineConfig(), params)

``engine`` holds the ``Engine``; ``config`` its settings; ``pages`` the paged KV pool and paged attention;
``slots`` the slot table; ``append``, ``fork`` and ``decode_loop`` the jitted programs that prefill, fork and
decode; ``programs`` compiles them once per shape bucket; ``layout`` where the pool and slots live on the mesh;
``sampling`` the token samplers; ``prefix_cache`` reuses prompt prefixes across requests; ``mock`` a scripted
engine for tests; ``jetstream`` (imported by no module here: it imports JetStream) serves the engine to
JetStream's orchestrator and server.
"""

from trace_jax.rollout.engine.config import EngineConfig
from trace_jax.rollout.engine.engine import Engine

__all__ = ["Engine", "EngineConfig"]
