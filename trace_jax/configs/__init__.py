"""What config files build a run's config from, and the run's typed config.

``configs/*.py`` build each section as ``section(SomeConfig(...))`` of the dataclass :data:`SECTIONS` names (the
part's own config: ``WorldConfig``, ``EngineConfig``, ``LossConfig``..., or one of the job's sections below), so a
key's type, default and documentation live in one place, the dataclass and its docstring::

    from trace_jax.configs import EngineConfig, RLConfig, section

    config.engine = section(EngineConfig(max_slots=32))
    config.rl = section(RLConfig(steps=30))

The package is the one config door: every entry point gets its :class:`RunConfig` from :func:`load` (a config
file and its ``--config.a.b=v`` overrides, checked once by :func:`validate`; a problem is a :class:`ConfigError`).
``--show-config`` is :func:`describe`. Names are imported on first use, so ``ConfigError`` costs no JAX import.
"""

from __future__ import annotations

import importlib
from typing import Any

# Each public name and the module that defines it.
_WHERE: dict[str, str] = {
    "RECIPES": "trace_jax.configs.run",
    "RETIRED": "trace_jax.configs.run",
    "SECTIONS": "trace_jax.configs.run",
    "TOP_LEVEL_DOCS": "trace_jax.configs.run",
    "BatchConfig": "trace_jax.rl.batch",
    "ConfigError": "trace_jax.configs.errors",
    "DistributedConfig": "trace_jax.parallel.distributed",
    "EngineConfig": "trace_jax.rollout.engine.engine",
    "EvalConfig": "trace_jax.configs.sections",
    "LossConfig": "trace_jax.rl.losses",
    "MeshConfig": "trace_jax.configs.sections",
    "ModelSourceConfig": "trace_jax.configs.sections",
    "LoRAConfig": "trace_jax.models.lora",
    "OptimizerConfig": "trace_jax.optim",
    "RLConfig": "trace_jax.configs.sections",
    "ReActConfig": "trace_jax.envs.react",
    "Reads": "trace_jax.configs.run",
    "RecipeConfig": "trace_jax.configs.sections",
    "Retired": "trace_jax.configs.run",
    "RetrieverConfig": "trace_jax.envs.retrieval.retriever",
    "RunConfig": "trace_jax.configs.run",
    "RunnerConfig": "trace_jax.rollout.runner",
    "SFTConfig": "trace_jax.configs.sections",
    "SchedulerConfig": "trace_jax.allocation.scheduler",
    "SearchR1DataConfig": "trace_jax.data.search_r1",
    "TokenizerConfig": "trace_jax.configs.sections",
    "UpdateConfig": "trace_jax.rl.trainer",
    "WarmStartConfig": "trace_jax.configs.sections",
    "WorldConfig": "trace_jax.data.synthetic",
    "build_section": "trace_jax.configs.run",
    "check_mesh": "trace_jax.configs.validate",
    "check_sampling_process": "trace_jax.configs.validate",
    "derived": "trace_jax.configs.schema",
    "describe": "trace_jax.configs.schema",
    "leaves": "trace_jax.configs.run",
    "load": "trace_jax.configs.files",
    "load_config_file": "trace_jax.configs.files",
    "optimizer_config": "trace_jax.configs.schema",
    "readers": "trace_jax.configs.run",
    "recipe_kind": "trace_jax.configs.run",
    "retired_message": "trace_jax.configs.run",
    "retired_problems": "trace_jax.configs.run",
    "section": "trace_jax.configs.run",
    "steps_per_rl_step": "trace_jax.configs.run",
    "trim": "trace_jax.configs.run",
    "unknown_overrides": "trace_jax.configs.files",
    "upgrade": "trace_jax.configs.run",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    """The public name ``name``, imported from its module on first use."""
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
