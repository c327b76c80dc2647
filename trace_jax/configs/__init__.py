"""What config files build a run's config from, and the run's typed config.

``configs/*.py`` build each section as ``section(SomeConfig(...))`` of the dataclass :data:`SECTIONS` names (the
part's own config: ``WorldConfig``, ``EngineConfig``, ``LossConfig``..., or one of the job's sections below), so a
key's type, default and documentation live in one place, the dataclass and its docstring::

    from trace_jax.configs import EngineConfig, RLConfig, section

    config.engine = section(EngineConfig(max_slots=32))
    config.rl = section(RLConfig(steps=30))

The job reads a :class:`RunConfig`, built once from the config file's ``ConfigDict`` (overrides applied).
"""

from trace_jax.allocation.scheduler import SchedulerConfig
from trace_jax.configs.run import (
    RECIPES,
    RETIRED,
    SECTIONS,
    TOP_LEVEL_DOCS,
    Reads,
    Retired,
    RunConfig,
    build_section,
    leaves,
    readers,
    recipe_kind,
    retired_message,
    retired_problems,
    section,
    steps_per_rl_step,
    trim,
    upgrade,
)
from trace_jax.configs.sections import (
    EvalConfig,
    MeshConfig,
    ModelSourceConfig,
    RecipeConfig,
    RLConfig,
    SFTConfig,
    TokenizerConfig,
    WarmStartConfig,
)
from trace_jax.data.search_r1 import SearchR1DataConfig
from trace_jax.data.synthetic import WorldConfig
from trace_jax.envs.react import ReActConfig
from trace_jax.envs.retrieval.retriever import RetrieverConfig
from trace_jax.optim import OptimizerConfig
from trace_jax.parallel.distributed import DistributedConfig
from trace_jax.rl.batch import BatchConfig
from trace_jax.rl.losses import LossConfig
from trace_jax.rl.trainer import UpdateConfig
from trace_jax.rollout.engine.engine import EngineConfig
from trace_jax.rollout.runner import RunnerConfig

__all__ = [
    "RECIPES",
    "RETIRED",
    "SECTIONS",
    "TOP_LEVEL_DOCS",
    "BatchConfig",
    "DistributedConfig",
    "EngineConfig",
    "EvalConfig",
    "LossConfig",
    "MeshConfig",
    "ModelSourceConfig",
    "OptimizerConfig",
    "RLConfig",
    "ReActConfig",
    "Reads",
    "RecipeConfig",
    "Retired",
    "RetrieverConfig",
    "RunConfig",
    "RunnerConfig",
    "SFTConfig",
    "SchedulerConfig",
    "SearchR1DataConfig",
    "TokenizerConfig",
    "UpdateConfig",
    "WarmStartConfig",
    "WorldConfig",
    "build_section",
    "leaves",
    "readers",
    "recipe_kind",
    "retired_message",
    "retired_problems",
    "section",
    "steps_per_rl_step",
    "trim",
    "upgrade",
]
