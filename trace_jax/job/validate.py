"""Checks a main-job config before any work starts; a problem is one line naming the key and what is allowed.

Each check lives in one place. :data:`RULES` hold the main job's checks, one per key whose bad values would
only fail later (or silently do nothing): negative step counts, zero budgets, unknown registry names. The
parts that are also built outside the main job (engine, sampling, batch, loss, ppo, allocation, world,
ReAct, retriever) check their own dataclass in its ``__post_init__``; every section must build its dataclass
(``schema.SECTIONS``: unknown fields, those self-checks), and no rule repeats a self-check. A section with a
key that breaks a rule is not built (its self-checks could trip on the same value). Retired keys are refused
first, each naming the key that replaces it (``schema.RETIRED``). The mesh is checked against
the devices separately (:func:`check_mesh`), once the devices are known.

    validate(config)                  # raises ConfigError("rl.steps=-1: allowed: an integer >= 0 ...")
    check_mesh(config, jax.device_count())
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

import ml_collections

from trace_jax.allocation.policies import POLICIES
from trace_jax.allocation.predictor import PREDICTORS
from trace_jax.config_utils import from_config
from trace_jax.data.synthetic import KINDS, SyntheticWorld, WorldConfig, split_kinds
from trace_jax.envs.react import TAGS
from trace_jax.job.cli import ConfigError
from trace_jax.job.schema import SECTIONS, prompts_drawn_per_step, retired_problems
from trace_jax.models import PRESETS
from trace_jax.parallel.mesh import MESH_AXES
from trace_jax.rl.advantages import ESTIMATORS
from trace_jax.rl.batch import BatchConfig, check_objective
from trace_jax.rl.losses import LossConfig


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def at_least(n: int) -> Callable[[Any], bool]:
    return lambda v: _is_int(v) and v >= n


def positive(v: Any) -> bool:
    return _is_number(v) and v > 0


def positive_or_none(v: Any) -> bool:
    return v is None or positive(v)


def one_of(choices: Callable[[], Iterable[str]]) -> Callable[[Any], bool]:
    return lambda v: v in set(choices())


def _is_split(value: Any, names: Iterable[str]) -> bool:
    """``value`` names a split of ``names``, optionally followed by question kinds: ``"test:chain,trivial"``."""
    if not isinstance(value, str):
        return False
    try:
        name, _ = split_kinds(value)
    except ValueError:
        return False
    return name in set(names)


def _training_policies() -> list[str]:

    return sorted(p for p in POLICIES if p != "oracle")  # oracle needs ground truth: simulator-only


def _estimators() -> list[str]:

    return sorted(ESTIMATORS)


def _predictors() -> list[str]:

    return sorted(PREDICTORS)


def _model_presets() -> list[str]:

    return sorted(PRESETS)


def _min_vocab() -> int:

    return 256 + 2 + len(TAGS)  # the byte alphabet, pad and EOS, the atomic ReAct tags


@dataclasses.dataclass(frozen=True)
class Rule:
    """``key`` (dotted) must satisfy ``ok``; ``allowed`` says what is allowed (a callable: computed late)."""

    key: str
    ok: Callable[[Any], bool]
    allowed: str | Callable[[], str]

    def message(self, value: Any) -> str:
        allowed = self.allowed() if callable(self.allowed) else self.allowed
        return f"config.{self.key}={value!r} is not allowed: {allowed}"


RULES: list[Rule] = [
    Rule("rl.steps", at_least(0), "an integer >= 0 (the number of RL updates)"),
    Rule("rl.prompts_per_step", at_least(1), "an integer >= 1"),
    Rule("rl.pool_size", at_least(0), "an integer >= 0 (0: the whole train split)"),
    Rule(
        "rl.warmup_steps",
        lambda v: _is_number(v) and v >= 0,
        "a number >= 0 (RL steps of learning-rate warm-up; fractions count)",
    ),
    Rule("rl.checkpoint_every", at_least(1), "an integer >= 1"),
    Rule("rl.keep_checkpoints", at_least(1), "an integer >= 1"),
    Rule("rl.logprob_chunk", lambda v: v is None or at_least(1)(v), "None, or an integer >= 1"),
    Rule("rl.preemption_grace_s", lambda v: _is_number(v) and v >= 0, "a number of seconds >= 0"),
    Rule(
        "rl.max_staleness",
        at_least(0),
        "an integer >= 0 (0: sample and train in turn; k >= 1: sample the next step's trees while training)",
    ),
    Rule("rl.advantage", one_of(_estimators), lambda: f"one of {', '.join(_estimators())}"),
    Rule(
        "allocation.policy",
        one_of(_training_policies),
        lambda: f"one of {', '.join(_training_policies())} (oracle is simulator-only)",
    ),
    Rule("allocation.predictor", one_of(_predictors), lambda: f"one of {', '.join(_predictors())}"),
    Rule("allocation.rollouts_per_prompt", positive_or_none, "a number > 0, or None for no rollout limit"),
    Rule("allocation.tokens_per_prompt", positive_or_none, "a number > 0, or None for no token limit"),
    Rule("allocation.max_depth", at_least(1), "an integer >= 1"),
    Rule("allocation.predictor_warmup_prompts", at_least(0), "an integer >= 0 (0: no predictor warm-up)"),
    Rule("sft.max_steps", at_least(0), "an integer >= 0 (0: no warm start)"),
    Rule("sft.time_budget_s", positive_or_none, "None (train exactly sft.max_steps) or a number of seconds > 0"),
    Rule("sft.batch_size", at_least(1), "an integer >= 1"),
    Rule("sft.learning_rate", positive, "a number > 0"),
    Rule("sft.practice_worlds", at_least(0), "an integer >= 0"),
    Rule("sft.model", one_of(_model_presets), lambda: f"a model preset: {', '.join(_model_presets())}"),
    Rule("tokenizer.vocab_size", lambda v: _is_int(v) and v >= _min_vocab(), lambda: f"an integer >= {_min_vocab()}"),
    Rule("optim.learning_rate", positive, "a number > 0"),
    Rule("engine.max_slots", at_least(1), "an integer >= 1"),
    Rule("engine.max_len", at_least(2), "an integer >= 2"),
    Rule("engine.steps_per_call", at_least(1), "an integer >= 1"),
    Rule("engine.max_turn_tokens", at_least(1), "an integer >= 1"),
    Rule(
        "eval.split",
        lambda v: _is_split(v, ("train", "test", "ood", "dev")),
        f"one of train, test, ood, each optionally with question kinds ('test:chain'; kinds: {', '.join(KINDS)}) "
        "(synthetic world); train, dev, test (recipe.kind=search_r1)",
    ),
    Rule(
        "rl.split",
        lambda v: _is_split(v, ("train", "test", "ood")),
        f"train, test or ood, optionally with question kinds ('train:chain'; kinds: {', '.join(KINDS)})",
    ),
    Rule("eval.num_questions", at_least(1), "an integer >= 1"),
    Rule("eval.every", at_least(0), "an integer >= 0 (0: only before and after RL)"),
    Rule("seed", _is_int, "an integer"),
    Rule("mesh.rollout_devices", at_least(0), "an integer >= 0 (0: the engine decodes on the training devices)"),
    Rule("mesh.rollout_cpus", at_least(0), "an integer >= 0 (0: sampling in the trainer's process)"),
    *(
        Rule(f"mesh.{axis}", lambda v: _is_int(v) and (v >= 1 or v == -1), "an integer >= 1, or -1")
        for axis in MESH_AXES
    ),
]


def _get(config: ml_collections.ConfigDict, dotted: str) -> tuple[bool, Any]:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _objective_problems(config: ml_collections.ConfigDict) -> list[str]:
    """An estimator × loss × batch layout whose packed gradient is not the per-path one (rl.batch.check_objective)."""

    try:
        check_objective(
            config.rl.advantage, from_config(LossConfig, config.loss), from_config(BatchConfig, config.batch)
        )
    except ValueError as e:
        return [" ".join(str(e).split())]
    return []


def _routing_problems(config: ml_collections.ConfigDict) -> list[str]:
    """``engine.routing_replay`` with a dense policy preset (``sft.model``, the synthetic recipe's policy): there
    is no router to record. A checkpoint's policy (recipe.kind=search_r1) is checked by the engine it builds."""
    on, replay = _get(config, "engine.routing_replay")
    named, preset = _get(config, "sft.model")
    synthetic = _get(config, "recipe.kind")[1] in (None, "synthetic")
    if not (on and replay and named and synthetic and preset in PRESETS) or PRESETS[preset].routing_shape:
        return []
    return [
        f"config.engine.routing_replay=True records a mixture of experts' routing, but sft.model={preset!r} is "
        "dense (no router): choose a qwen3_moe preset (e.g. qwen3-moe-tiny) or set engine.routing_replay=False"
    ]


def _prompt_problems(config: ml_collections.ConfigDict) -> list[str]:
    """Synthetic recipe: an RL split (``rl.split``) or an evaluation split (``eval.split``) with no question (a kind
    the world has none of), a prompt pool (``rl.pool_size``) larger than the RL split, or smaller than the prompts
    one step draws. Sizes need the world built (about a second): only a run with a pool or a split of its own pays."""
    if (config.get("recipe") or {}).get("kind", "synthetic") != "synthetic":
        return []
    pool, name, evaluated = config.rl.get("pool_size", 0), config.rl.get("split", "train"), config.eval.split
    if not pool and name == "train" and ":" not in evaluated:
        return []
    world = SyntheticWorld(from_config(WorldConfig, config.world))
    sizes = {("rl.split", name): len(world.questions(name)), ("eval.split", evaluated): len(world.questions(evaluated))}
    empty = [f"config.{key}={value!r} holds no question in this world" for (key, value), n in sizes.items() if not n]
    if empty:
        return [
            f"{line}: check the kinds after ':' against config.world (buried_questions, trivial_questions)"
            for line in empty
        ]
    split = sizes["rl.split", name]
    if not pool:
        return []
    if pool > split:
        return [
            f"config.rl.pool_size={pool} is larger than the world's {name} split ({split} questions): pass at most "
            f"--config.rl.pool_size={split} (0: the whole split)"
        ]
    drawn = prompts_drawn_per_step(config)
    if pool < drawn:
        return [
            f"config.rl.pool_size={pool} holds fewer prompts than one step draws ({drawn}: rl.prompts_per_step x "
            "allocation.candidates_per_prompt): raise the pool or lower those"
        ]
    return []


def problems(config: ml_collections.ConfigDict) -> list[str]:
    """Every problem of ``config``, one line each (empty when it is fine)."""
    found = retired_problems(config)
    if found:  # the sections would not build with these keys in them; the rest waits for the fix
        return found
    broken = set()
    for rule in RULES:
        present, value = _get(config, rule.key)
        if present and not rule.ok(value):
            found.append(rule.message(value))
            broken.add(rule.key.partition(".")[0])
    for name, cls in SECTIONS.items():
        if name not in config:
            found.append(f"config has no section {name!r} (the main job needs {', '.join(SECTIONS)})")
        elif name not in broken:
            try:
                from_config(cls, config[name])
            except (TypeError, ValueError) as e:
                found.append(f"config.{name}: {' '.join(str(e).split())}")
    if not found and {"loss", "batch", "rl"} <= set(config.keys()):
        found.extend(_objective_problems(config))
    found.extend(_routing_problems(config))
    if not found and {"rl", "world", "allocation", "eval"} <= set(config.keys()):
        found.extend(_prompt_problems(config))
    mesh = [config.mesh.get(axis) for axis in MESH_AXES] if "mesh" in config else []
    if mesh.count(-1) > 1:
        found.append(f"config.mesh has {mesh.count(-1)} axes set to -1: at most one axis may be -1")
    return found


def validate(config: ml_collections.ConfigDict) -> None:
    """Raises :class:`ConfigError` listing every problem of ``config`` on one line."""
    found = problems(config)
    if found:
        raise ConfigError("; ".join(found))


def check_mesh(config: ml_collections.ConfigDict, device_count: int, process_count: int = 1) -> None:
    """Raises :class:`ConfigError` unless the sampling devices (``mesh.rollout_devices``) leave at least one
    device to train, and the mesh axes fit the training devices exactly; a split placement and sampling ahead
    (``rl.max_staleness``) need one process."""
    sampling = config.mesh.get("rollout_devices", 0)
    if process_count > 1:
        apart = {
            "mesh.rollout_devices": sampling,
            "mesh.rollout_cpus": config.mesh.get("rollout_cpus", 0),
            "rl.max_staleness": config.rl.get("max_staleness", 0),
        }
        for key, value in apart.items():
            if value:
                raise ConfigError(
                    f"config.{key}={value} needs one JAX process; this job has {process_count} (with several, "
                    "each process already samples on its own devices and the rollouts are gathered step by step)"
                )
    if sampling >= device_count:
        raise ConfigError(
            f"config.mesh.rollout_devices={sampling} leaves no device to train: {device_count} device(s) are "
            f"available; allowed 0 (colocated) to {device_count - 1}"
        )
    training = device_count - sampling
    sizes = {axis: config.mesh.get(axis, 1) for axis in MESH_AXES}
    known = math.prod(s for s in sizes.values() if s != -1)
    fits = training % known == 0 if -1 in sizes.values() else known == training
    if not fits:
        shown = ", ".join(f"mesh.{a}={s}" for a, s in sizes.items())
        which = (
            f"training device(s) ({device_count} minus mesh.rollout_devices={sampling})"
            if sampling
            else "available device(s)"
        )
        raise ConfigError(
            f"config {shown} does not fit the {training} {which}: the axes' product must equal {training} (one "
            "axis may be -1 to take the rest)"
        )


def check_sampling_process(config: ml_collections.ConfigDict, platform: str, cores: int) -> None:
    """Raises :class:`ConfigError` unless ``mesh.rollout_cpus`` (sampling in a process of its own) can run here:
    a CPU backend (``platform``), the synthetic recipe, no ``mesh.rollout_devices``, and a core left to train
    of the ``cores`` this process may use."""
    cpus = config.mesh.get("rollout_cpus", 0)
    if not cpus:
        return
    recipe = (config.get("recipe") or {}).get("kind", "synthetic")
    found = [
        (platform != "cpu", f"is for CPU hosts, and this backend is {platform}: pass mesh.rollout_devices instead"),
        (config.mesh.get("rollout_devices", 0), "and mesh.rollout_devices exclude each other: pass one of them"),
        (recipe != "synthetic", f"needs the synthetic recipe (the child rebuilds its world), not {recipe!r}"),
        (cpus >= cores, f"leaves no core to train: this process may use {cores}; allowed 1 to {cores - 1}"),
    ]
    problems = [f"config.mesh.rollout_cpus={cpus} {why}" for failed, why in found if failed]
    if problems:
        raise ConfigError("; ".join(problems))
