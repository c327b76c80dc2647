"""Turns a config file's ConfigDict into the run's typed ``RunConfig``, checking it once; a problem is one line
naming the key and what is allowed.

Each check lives in one place. :data:`RULES` hold the main job's checks, one per key whose bad values would
only fail later (or silently do nothing): negative step counts, zero budgets, unknown registry names; they read
the typed fields. The parts that are also built outside the main job (engine, sampling, batch, loss, ppo,
allocation, world, ReAct, retriever) check their own dataclass in its ``__post_init__``; every section the
recipe reads must build its dataclass (``trace_jax.configs.SECTIONS``: unknown fields, those self-checks), and
no rule repeats a self-check. A section with a key that breaks a rule is not built (its self-checks could trip
on the same value). Retired keys are refused first, each naming the key that replaces it (``RETIRED``), and a
key the recipe does not read may not be set (``RECIPES``). The mesh is checked against the devices separately
(:func:`check_mesh`), once the devices are known.

    run = validate(config)            # a RunConfig, or ConfigError("config.rl.steps=-1 is not allowed: ...")
    check_mesh(run, jax.device_count())
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from trace_jax.allocation.policies import POLICIES
from trace_jax.allocation.predictor import PREDICTORS
from trace_jax.configs.errors import ConfigError
from trace_jax.configs.run import RECIPES, SECTIONS, RunConfig, build_section, recipe_kind, retired_problems
from trace_jax.configs.schema import prompts_drawn_per_step
from trace_jax.data.synthetic import KINDS, SyntheticWorld, split_kinds
from trace_jax.envs.react import TAGS
from trace_jax.models import PRESETS
from trace_jax.models.expert_dispatch import EXPERT_DISPATCH
from trace_jax.parallel.mesh import MESH_AXES
from trace_jax.rl.advantages import ESTIMATORS
from trace_jax.rl.batch import check_objective


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
        "engine.expert_dispatch",
        one_of(lambda: ("", *EXPERT_DISPATCH)),
        f"'' (the model's own) or one of {', '.join(EXPERT_DISPATCH)}",
    ),
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
    Rule("mesh.slices", at_least(1), "an integer >= 1 (the number of TPU slices)"),
    *(
        Rule(f"mesh.{axis}", lambda v: _is_int(v) and (v >= 1 or v == -1), "an integer >= 1, or -1")
        for axis in MESH_AXES
    ),
]


def _get(typed: dict[str, Any], config: Mapping[str, Any], dotted: str) -> tuple[bool, Any]:
    """The value of ``dotted``: the typed section's field when the section built, else the raw value."""
    name, _, field = dotted.partition(".")
    if name in typed:
        return True, getattr(typed[name], field)
    try:
        return True, config[name][field] if field else config[name]
    except KeyError:
        return False, None


def _objective_problems(config: RunConfig) -> list[str]:
    """An estimator × loss × batch layout whose packed gradient is not the per-path one (rl.batch.check_objective)."""

    try:
        check_objective(config.rl.advantage, config.loss, config.batch)
    except ValueError as e:
        return [" ".join(str(e).split())]
    return []


def _routing_problems(config: RunConfig) -> list[str]:
    """``engine.routing_replay`` with a dense policy preset (``sft.model``, the synthetic recipe's policy): there
    is no router to record. A checkpoint's policy (recipe.kind=search_r1) is checked by the engine it builds."""
    preset = config.sft.model
    if config.recipe.kind != "synthetic" or not config.engine.routing_replay or PRESETS[preset].routing_shape:
        return []
    return [
        f"config.engine.routing_replay=True records a mixture of experts' routing, but sft.model={preset!r} is "
        "dense (no router): choose a qwen3_moe preset (e.g. qwen3-moe-tiny) or set engine.routing_replay=False"
    ]


def _dispatch_problems(config: RunConfig) -> list[str]:
    """``engine.expert_dispatch`` with a dense policy preset (the synthetic recipe's ``sft.model``): it has no
    experts to dispatch. A checkpoint's policy is checked by the engine it builds."""
    preset = config.sft.model
    if config.recipe.kind != "synthetic" or not config.engine.expert_dispatch or PRESETS[preset].routing_shape:
        return []
    return [
        f"config.engine.expert_dispatch={config.engine.expert_dispatch!r} chooses how a mixture of experts "
        f"dispatches, but sft.model={preset!r} is dense: choose a qwen3_moe preset or set engine.expert_dispatch=''"
    ]


def _prompt_problems(config: RunConfig) -> list[str]:
    """Synthetic recipe: an RL split (``rl.split``) or an evaluation split (``eval.split``) with no question (a kind
    the world has none of), a prompt pool (``rl.pool_size``) larger than the RL split, or smaller than the prompts
    one step draws. Sizes need the world built (about a second): only a run with a pool or a split of its own pays."""
    if config.recipe.kind != "synthetic":
        return []
    pool, name, evaluated = config.rl.pool_size, config.rl.split, config.eval.split
    if not pool and name == "train" and ":" not in evaluated:
        return []
    world = SyntheticWorld(config.world)
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


def _mesh_problems(config: RunConfig) -> list[str]:
    mesh = [getattr(config.mesh, axis) for axis in MESH_AXES]
    if mesh.count(-1) > 1:
        return [f"config.mesh has {mesh.count(-1)} axes set to -1: at most one axis may be -1"]
    return []


def _unread_problems(config: Mapping[str, Any], kind: str) -> list[str]:
    """A key of a section the recipe reads that only another recipe reads, set to other than its default."""
    found = []
    for dotted, reader in RECIPES[kind].skipped.items():
        name, _, field = dotted.partition(".")
        if name in config and field in config[name]:
            value = config[name][field]
            if value != getattr(SECTIONS[name](), field):
                found.append(
                    f"config.{dotted}={value!r} is read only by the {reader} recipe; this run's recipe.kind={kind!r} "
                    "does not read it: leave it out"
                )
    return found


def _checked(config: Mapping[str, Any]) -> tuple[list[str], RunConfig | None]:
    """``config``'s problems, one line each, and its ``RunConfig`` when the sections built (None otherwise)."""
    found = retired_problems(config)
    if found:  # the sections would not build with these keys in them; the rest waits for the fix
        return found, None
    kind = recipe_kind(config)
    if kind not in RECIPES:
        return [f"config.recipe.kind={kind!r} is not allowed: one of {', '.join(RECIPES)}"], None
    reads = RECIPES[kind]
    found = _unread_problems(config, kind)
    typed: dict[str, Any] = {}
    unbuilt: dict[str, str] = {}
    missing = []
    for name in reads.sections:
        if name not in config:
            if name != "recipe":  # no recipe section: the synthetic recipe
                missing.append(f"config has no section {name!r} (the {kind} recipe reads {', '.join(reads.sections)})")
            continue
        try:
            typed[name] = build_section(name, config[name], reads)
        except Exception as e:  # a self-check tripping on a value a rule below refuses (engine.max_len=0: a modulo)
            unbuilt[name] = " ".join(str(e).split()) if isinstance(e, TypeError | ValueError) else repr(e)
    broken = set()
    for rule in RULES:
        if not reads.reads(rule.key):
            continue
        present, value = _get(typed, config, rule.key)
        if present and not rule.ok(value):
            found.append(rule.message(value))
            broken.add(rule.key.partition(".")[0])
    found += missing
    found += [f"config.{name}: {message}" for name, message in unbuilt.items() if name not in broken]
    if found:
        return found, None
    run = RunConfig.build(config)
    checks = (_objective_problems, _routing_problems, _dispatch_problems, _prompt_problems, _mesh_problems)
    return [problem for check in checks for problem in check(run)], run


def problems(config: Mapping[str, Any]) -> list[str]:
    """Every problem of ``config`` (a config file's ConfigDict, or a saved run's dict), one line each (empty when
    it is fine)."""
    return _checked(config)[0]


def validate(config: Any) -> RunConfig:
    """The typed ``RunConfig`` of ``config`` (a ConfigDict or a dict; a ``RunConfig`` is returned as it is), built
    once. Raises :class:`ConfigError` listing every problem of ``config`` on one line."""
    if isinstance(config, RunConfig):
        return config
    found, run = _checked(config)
    if found:
        raise ConfigError("; ".join(found))
    return run


def check_mesh(config: RunConfig, device_count: int, process_count: int = 1) -> None:
    """Raises :class:`ConfigError` unless the sampling devices (``mesh.rollout_devices``) leave at least one
    device to train, and the mesh axes fit the training devices exactly; a split placement and sampling ahead
    (``rl.max_staleness``) need one process."""
    sampling = config.mesh.rollout_devices
    if process_count > 1:
        apart = {
            "mesh.rollout_devices": sampling,
            "mesh.rollout_cpus": config.mesh.rollout_cpus,
            "rl.max_staleness": config.rl.max_staleness,
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
    slices = config.mesh.slices
    if (device_count - sampling) % slices:
        raise ConfigError(
            f"config.mesh.slices={slices} does not divide the {device_count - sampling} training device(s): set "
            "mesh.slices to the number of slices the job runs on"
        )
    training = (device_count - sampling) // slices
    sizes = {axis: getattr(config.mesh, axis) for axis in MESH_AXES}
    known = math.prod(s for s in sizes.values() if s != -1)
    fits = training % known == 0 if -1 in sizes.values() else known == training
    if not fits:
        shown = ", ".join(f"mesh.{a}={s}" for a, s in sizes.items())
        which = (
            f"training device(s) ({device_count} minus mesh.rollout_devices={sampling})"
            if sampling
            else "available device(s)"
        ) + (f" per slice (mesh.slices={slices})" if slices > 1 else "")
        raise ConfigError(
            f"config {shown} does not fit the {training} {which}: the axes' product must equal {training} (one "
            "axis may be -1 to take the rest)"
        )


def check_sampling_process(config: RunConfig, platform: str, cores: int) -> None:
    """Raises :class:`ConfigError` unless ``mesh.rollout_cpus`` (sampling in a process of its own) can run here:
    a CPU backend (``platform``), no ``mesh.rollout_devices``, and a core left to train of the ``cores`` this
    process may use. (Only the synthetic recipe reads ``mesh.rollout_cpus``: the child rebuilds its world.)"""
    cpus = config.mesh.rollout_cpus
    if not cpus:
        return
    found = [
        (platform != "cpu", f"is for CPU hosts, and this backend is {platform}: pass mesh.rollout_devices instead"),
        (config.mesh.rollout_devices, "and mesh.rollout_devices exclude each other: pass one of them"),
        (cpus >= cores, f"leaves no core to train: this process may use {cores}; allowed 1 to {cores - 1}"),
    ]
    problems = [f"config.mesh.rollout_cpus={cpus} {why}" for failed, why in found if failed]
    if problems:
        raise ConfigError("; ".join(problems))
