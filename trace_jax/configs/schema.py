"""The main job's config, section by section: the values the job derives from it, and each key's doc.

The sections, the recipes' reads and the retired keys are ``trace_jax.configs``' (re-exported here); the run's
typed config is a ``RunConfig``. :func:`describe` renders one as ``key = value  # doc`` lines (``python -m
trace_jax.train --show-config``): every key the run's recipe reads, none it ignores. The values the job derives
from other keys are :func:`derived`'s.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from trace_jax.config_utils import field_doc
from trace_jax.configs.run import (
    RECIPES,
    RETIRED,
    SECTIONS,
    TOP_LEVEL_DOCS,
    Retired,
    RunConfig,
    leaves,
    retired_message,
    retired_problems,
    section,
    steps_per_rl_step,
    upgrade,
)
from trace_jax.configs.sections import EvalConfig, MeshConfig, RLConfig, TokenizerConfig
from trace_jax.optim import OptimizerConfig

__all__ = [
    "RECIPES",
    "RETIRED",
    "SECTIONS",
    "TOP_LEVEL_DOCS",
    "EvalConfig",
    "MeshConfig",
    "RLConfig",
    "Retired",
    "RunConfig",
    "TokenizerConfig",
    "derived",
    "describe",
    "epochs",
    "field_docs",
    "optimizer_config",
    "prompts_drawn_per_step",
    "retired_message",
    "retired_problems",
    "section",
    "steps_for_epochs",
    "steps_per_epoch",
    "steps_per_rl_step",
    "upgrade",
]


# ------------------------------------------------------------------------------------- derived values
def derived(config: RunConfig) -> dict[str, Any]:
    """The values the job computes from other keys, by the name of the field they set (in optimizer steps)."""
    per_step = config.ppo.steps_per_batch
    values = {
        # At least 1: a run of 0 RL steps (evaluation only) still builds its optimizer.
        "optim.total_steps": max(config.rl.steps * per_step, 1),
        "optim.warmup_steps": int(config.rl.warmup_steps * per_step + 0.5),  # rounded half up
    }
    if config.rl.pool_size:
        values["rl.epochs"] = epochs(config)
    return values


def prompts_drawn_per_step(config: RunConfig) -> int:
    """Prompts an RL step draws: ``rl.prompts_per_step``, times ``allocation.candidates_per_prompt`` when the
    allocation policy selects the step's batch from more candidates."""
    return config.allocation.candidates(config.rl.prompts_per_step)


def steps_per_epoch(config: RunConfig) -> int:
    """RL steps of one pass over the prompt pool (``rl.pool_size``): the pool's whole batches of drawn prompts
    (a batch never straddles two epochs); 0 without a pool."""
    pool = config.rl.pool_size
    return max(pool // prompts_drawn_per_step(config), 1) if pool else 0


def epochs(config: RunConfig) -> float:
    """Passes over the prompt pool that rl.steps make (``rl.epochs`` under [derived])."""
    return config.rl.steps / steps_per_epoch(config)


def steps_for_epochs(config: RunConfig, num_epochs: float) -> int:
    """The rl.steps that visit the pool (``rl.pool_size``) ``num_epochs`` times (rounded up to whole steps)."""
    return math.ceil(num_epochs * steps_per_epoch(config) - 1e-9)


DERIVED_DOCS = {
    "optim.total_steps": "optimizer steps of the whole run: rl.steps × ppo.ppo_epochs × ppo.mini_batches",
    "optim.warmup_steps": "optimizer steps of warm-up: rl.warmup_steps × ppo.ppo_epochs × ppo.mini_batches",
    "rl.epochs": "passes over the prompt pool: rl.steps / (rl.pool_size // prompts drawn a step), not a key",
}


def optimizer_config(config: RunConfig) -> OptimizerConfig:
    """``config.optim`` with the schedule's lengths in optimizer steps from :func:`derived`."""
    fields = {key.partition(".")[2]: value for key, value in derived(config).items() if key.startswith("optim.")}
    return dataclasses.replace(config.optim, **fields)


# ------------------------------------------------------------------------------------------- docs
def field_docs(cls: type) -> dict[str, str]:
    """Each field's doc, as declared with ``trace_jax.config_utils.documented``; a field declared without one
    gets ``see ClassName``."""
    docs = {f.name: field_doc(f) or f"see {cls.__name__}" for f in dataclasses.fields(cls)}
    return dict(sorted(docs.items()))


def describe(config: RunConfig) -> str:
    """Every key the run's recipe reads as ``key = value  # doc``, one per line, section by section; then the
    values the job derives from them (:func:`derived`). Keys the recipe does not read and the fields the job
    sets itself (:data:`RETIRED`) are not shown."""
    values = config.to_dict()
    lines = [f"seed = {config.seed!r}  # {TOP_LEVEL_DOCS['seed']}"]
    for name, typed in config.sections():
        cls = type(typed)
        docs = field_docs(cls)
        lines.append(f"\n[{name}]  {cls.__doc__.strip().splitlines()[0]}")
        for key, _ in leaves(values[name]):
            field, *inner = key.split(".")
            leaf = getattr(typed, field)
            for part in inner:  # a nested dataclass's field (engine.sampling.temperature)
                leaf = getattr(leaf, part)
            lines.append(f"{name}.{key} = {leaf!r}  # {docs[field]}")
    lines.append("\n[derived]  computed from the keys above; not keys themselves")
    lines += [f"{key} = {value!r}  # {DERIVED_DOCS[key]}" for key, value in derived(config).items()]
    return "\n".join(lines)
