"""The run's typed config: :class:`RunConfig`, one frozen dataclass per section, and the keys each recipe reads.

A config file returns a ``ConfigDict`` (so ``--config.rl.steps=40`` can override any key); the job turns it into a
:class:`RunConfig` once, at the door (``trace_jax.job.commands.load_config`` for a command line,
``trace_jax.job.build.load_run_config`` for a saved run), and from there on every part reads typed fields.

Each recipe kind reads some sections and not others (:data:`RECIPES`): the Search-R1 recipe has no synthetic world,
no BPE to train and no warm start; the synthetic recipe loads no Hugging Face checkpoint. ``--show-config`` lists
what the run's recipe reads, and an override of a key it does not read is refused.

One fact, one key. A dataclass field the job sets itself (from another key, or from the run: the tokenizer's pad id)
is not a config key: :data:`RETIRED` names each such key with what to set instead, :func:`section` leaves them out
of a config file's sections, a config that sets one is refused (:func:`retired_problems`), and a saved run's
``config.json`` that holds one is read through :func:`upgrade`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import ml_collections

from trace_jax.allocation.scheduler import SchedulerConfig
from trace_jax.config_utils import from_config, to_config
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
from trace_jax.models.lora import LoRAConfig
from trace_jax.optim import OptimizerConfig
from trace_jax.parallel.distributed import DistributedConfig
from trace_jax.rl.batch import BatchConfig
from trace_jax.rl.losses import LossConfig
from trace_jax.rl.trainer import UpdateConfig
from trace_jax.rollout.engine.engine import EngineConfig
from trace_jax.rollout.runner import RunnerConfig

# Every section a run may have, by name, in the order --show-config lists them.
SECTIONS: dict[str, type] = {
    "recipe": RecipeConfig,
    "model": ModelSourceConfig,
    "data": SearchR1DataConfig,
    "world": WorldConfig,
    "tokenizer": TokenizerConfig,
    "react": ReActConfig,
    "retriever": RetrieverConfig,
    "sft": SFTConfig,
    "warm_start": WarmStartConfig,
    "engine": EngineConfig,
    "runner": RunnerConfig,
    "allocation": SchedulerConfig,
    "batch": BatchConfig,
    "loss": LossConfig,
    "ppo": UpdateConfig,
    "optim": OptimizerConfig,
    "lora": LoRAConfig,
    "rl": RLConfig,
    "eval": EvalConfig,
    "mesh": MeshConfig,
    "distributed": DistributedConfig,
}
TOP_LEVEL_DOCS = {"seed": "seed of the RL run: sampling, prompt order and the train state's rng"}


@dataclasses.dataclass(frozen=True)
class Reads:
    """What a recipe kind reads: its ``sections`` (``recipe`` and ``seed`` always) minus the ``skipped`` keys
    (dotted) of those sections that only another kind reads, each with the kind that does."""

    sections: tuple[str, ...]
    skipped: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def reads(self, dotted: str) -> bool:
        section = dotted.partition(".")[0]
        return dotted == "seed" or (section in self.sections and dotted not in self.skipped)


_SAMPLING_AND_TRAINING = (
    "engine",
    "runner",
    "allocation",
    "batch",
    "loss",
    "ppo",
    "optim",
    "lora",
    "rl",
    "eval",
    "mesh",
)
RECIPES: dict[str, Reads] = {
    "synthetic": Reads(
        (
            "recipe",
            "world",
            "tokenizer",
            "react",
            "retriever",
            "sft",
            "warm_start",
            *_SAMPLING_AND_TRAINING,
            "distributed",
        )
    ),
    "search_r1": Reads(
        ("recipe", "model", "data", "react", "retriever", *_SAMPLING_AND_TRAINING, "distributed"),
        # A search_r1 run streams its whole data.train_split; its sampling side is rebuilt only in-process.
        {"rl.pool_size": "synthetic", "rl.split": "synthetic", "mesh.rollout_cpus": "synthetic"},
    ),
}


def recipe_kind(config: Mapping[str, Any]) -> str:
    """``recipe.kind`` of a config (a ConfigDict or a dict); "synthetic" when it has no ``recipe`` section."""
    return (config.get("recipe") or {}).get("kind", RecipeConfig.kind)


def readers(dotted: str) -> list[str]:
    """The recipe kinds that read the key ``dotted``."""
    return [kind for kind, reads in RECIPES.items() if reads.reads(dotted)]


# ------------------------------------------------------------------------------------- retired keys
@dataclasses.dataclass(frozen=True)
class Retired:
    """A key the main job's config does not have. ``instead``: what to set instead (named in the error);
    ``carry(saved, value)``: writes what the value meant into the new keys of a saved run's config (a dict);
    None: the value changed nothing, it is dropped."""

    instead: str
    carry: Callable[[dict[str, Any], Any], None] | None = None


def _put(saved: dict[str, Any], dotted: str, value: Any) -> None:
    section, _, key = dotted.partition(".")
    saved.setdefault(section, {})[key] = value


def steps_per_rl_step(config: Mapping[str, Any]) -> int:
    """Optimizer steps one RL step makes: ppo.ppo_epochs × ppo.mini_batches (``UpdateConfig.steps_per_batch``)."""
    return from_config(UpdateConfig, config.get("ppo")).steps_per_batch


_PADDING = "the update runs only the rows that hold tokens, so padding rows change nothing: remove it"

# Old key -> what replaces it. Every key here is refused in a config and mapped when a saved run is read.
RETIRED: dict[str, Retired] = {
    "rl.recompute_old_logprobs": Retired(
        "use 'ppo.behaviour_logprobs': 'recompute' where it was True, 'sampler' (the default) where it was False",
        lambda saved, value: _put(saved, "ppo.behaviour_logprobs", "recompute") if value else None,
    ),
    "rl.micro_batches": Retired(
        "use 'ppo.micro_rows', the update's rows per forward/backward call (a row count, not a number of micro-batches)"
    ),
    "optim.total_steps": Retired(
        "it is derived from 'rl.steps' (rl.steps × ppo.ppo_epochs × ppo.mini_batches optimizer steps): set 'rl.steps'"
    ),
    "optim.warmup_steps": Retired(
        "use 'rl.warmup_steps', counted in RL steps, not optimizer steps (optimizer steps = rl.warmup_steps × "
        "ppo.ppo_epochs × ppo.mini_batches)",
        lambda saved, value: _put(saved, "rl.warmup_steps", value / steps_per_rl_step(saved)),
    ),
    "runner.max_turn_tokens": Retired(
        "use 'engine.max_turn_tokens' (the per-turn token limit)",
        lambda saved, value: _put(saved, "engine.max_turn_tokens", value) if value is not None else None,
    ),
    "batch.row_buckets": Retired(_PADDING),
    "batch.row_multiple": Retired(_PADDING),
    "batch.pad_id": Retired("the job pads with the tokenizer's pad id: remove it"),
    "runner.eos_ids": Retired("the job ends turns at the tokenizer's EOS id: remove it"),
    "runner.greedy": Retired("the job samples rollouts and decodes evaluations greedily: remove it"),
}


def retired_message(key: str) -> str:
    return f"config key {key!r} is gone: {RETIRED[key].instead}"


def leaves(section: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` of every leaf of a nested mapping or ConfigDict."""
    for key, value in section.items():
        if isinstance(value, Mapping | ml_collections.ConfigDict):
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value


def retired_problems(keys: Any) -> list[str]:
    """One message per retired key among ``keys`` (dotted names, or a config whose keys are checked)."""
    if isinstance(keys, Mapping | ml_collections.ConfigDict):
        keys = [name for name, _ in leaves(keys)]
    return [retired_message(key) for key in keys if key in RETIRED]


def section(instance: Any) -> ml_collections.ConfigDict:
    """``to_config(instance)`` of a :data:`SECTIONS` dataclass, without the fields that are :data:`RETIRED`
    keys (the job sets them): how ``configs/*.py`` build their sections."""
    name = next(name for name, cls in SECTIONS.items() if type(instance) is cls)
    config = to_config(instance)
    for key in RETIRED:
        owner, _, field = key.partition(".")
        if owner == name and field in config:
            del config[field]
    return config


def trim(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """``config`` without the sections and keys its recipe (``recipe.kind``) does not read: what a config file
    that starts from another recipe's file returns, so ``--show-config`` and the overrides see only its keys."""
    reads = RECIPES[recipe_kind(config)]
    for name in [name for name in config if name != "seed" and name not in reads.sections]:
        del config[name]
    for dotted in reads.skipped:
        name, _, field = dotted.partition(".")
        if name in config and field in config[name]:
            del config[name][field]
    return config


def upgrade(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A saved run's config (``config.json``, a dict) without :data:`RETIRED` keys: each one it holds is
    removed, and what it set is carried into the key that replaces it (overriding that key's saved value)."""
    saved = copy.deepcopy(dict(saved))
    for key, retired in RETIRED.items():
        owner, _, field = key.partition(".")
        if isinstance(saved.get(owner), dict) and field in saved[owner]:
            value = saved[owner].pop(field)
            if retired.carry is not None:
                retired.carry(saved, value)
    return saved


# ------------------------------------------------------------------------------------------ the run
@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A run's whole config, typed: ``seed`` and one field per section, each its part's own dataclass. The
    sections the run's recipe does not read hold their defaults (``reads`` says which it reads)."""

    seed: int = 0
    recipe: RecipeConfig = dataclasses.field(default_factory=RecipeConfig)
    model: ModelSourceConfig = dataclasses.field(default_factory=ModelSourceConfig)
    data: SearchR1DataConfig = dataclasses.field(default_factory=SearchR1DataConfig)
    world: WorldConfig = dataclasses.field(default_factory=WorldConfig)
    tokenizer: TokenizerConfig = dataclasses.field(default_factory=TokenizerConfig)
    react: ReActConfig = dataclasses.field(default_factory=ReActConfig)
    retriever: RetrieverConfig = dataclasses.field(default_factory=RetrieverConfig)
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)
    warm_start: WarmStartConfig = dataclasses.field(default_factory=WarmStartConfig)
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    runner: RunnerConfig = dataclasses.field(default_factory=RunnerConfig)
    allocation: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    batch: BatchConfig = dataclasses.field(default_factory=BatchConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    ppo: UpdateConfig = dataclasses.field(default_factory=UpdateConfig)
    optim: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
    rl: RLConfig = dataclasses.field(default_factory=RLConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)

    @property
    def reads(self) -> Reads:
        """The sections and keys this run's recipe reads."""
        return RECIPES[self.recipe.kind]

    @classmethod
    def build(cls, config: Mapping[str, Any]) -> RunConfig:
        """The sections of ``config`` (a ConfigDict or a dict) that its recipe reads, each built by
        ``from_config`` (keys it leaves out: their defaults); the sections and keys it does not read are left
        out. Raises ``ValueError`` / ``TypeError`` where a section does not build (``trace_jax.configs.validate``
        reports those one line each, with the rules' checks)."""
        reads = RECIPES[recipe_kind(config)]
        values: dict[str, Any] = {"seed": config["seed"]} if "seed" in config else {}
        for name in reads.sections:
            if name in config:
                values[name] = build_section(name, config[name], reads)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The run's config keys as JSON values (tuples as lists; what ``config.json`` holds): ``seed`` and the
        sections the recipe reads, without the keys it skips and the fields the job sets (:data:`RETIRED`)."""
        values: dict[str, Any] = {"seed": self.seed}
        for name in self.reads.sections:
            fields = dataclasses.asdict(getattr(self, name))
            values[name] = {
                key: value
                for key, value in fields.items()
                if f"{name}.{key}" not in RETIRED and f"{name}.{key}" not in self.reads.skipped
            }
        return json.loads(json.dumps(values))

    def sections(self) -> Iterator[tuple[str, Any]]:
        """``(name, dataclass)`` of the sections the recipe reads, in :data:`SECTIONS` order."""
        for name in SECTIONS:
            if name in self.reads.sections:
                yield name, getattr(self, name)


def build_section(name: str, values: Mapping[str, Any], reads: Reads | None = None) -> Any:
    """Section ``name`` as its dataclass, from a mapping of its keys (those ``reads`` skips left out)."""
    skipped = reads.skipped if reads is not None else {}
    kept = {key: value for key, value in values.items() if f"{name}.{key}" not in skipped}
    return from_config(SECTIONS[name], kept)
