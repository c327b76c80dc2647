"""The main job's config, section by section: which dataclass each section builds, and each key's doc.

Every section of ``configs/default.py`` is ``section(SomeConfig(...))`` of the dataclass named in
:data:`SECTIONS`, so a key's type, default and documentation live in one place: the dataclass and its
docstring. The four sections only the main job reads (``tokenizer``, ``rl``, ``eval``, ``mesh``) are defined
here. :func:`describe` renders a config as ``key = value  # doc`` lines (``python -m trace_jax.train
--show-config``).

One fact, one key. A dataclass field the job sets itself (from another key, or from the run: the tokenizer's
pad id) is not a config key: :data:`RETIRED` names each such key with what to set instead, ``section`` leaves
them out, a config that sets one is refused (:func:`retired_problems`), and a saved run's ``config.json`` that
holds one is read through :func:`upgrade`. The values the job derives are :func:`derived`'s.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import ml_collections

from trace_jax.allocation.scheduler import SchedulerConfig
from trace_jax.config_utils import from_config, to_config
from trace_jax.data.synthetic import WorldConfig
from trace_jax.envs.react import ReActConfig
from trace_jax.envs.retrieval.retriever import RetrieverConfig
from trace_jax.job.sft import SFTConfig
from trace_jax.job.warm_start import WarmStartConfig
from trace_jax.optim import OptimizerConfig
from trace_jax.parallel.distributed import DistributedConfig
from trace_jax.rl.batch import BatchConfig
from trace_jax.rl.losses import LossConfig
from trace_jax.rl.trainer import UpdateConfig
from trace_jax.rollout.engine.engine import EngineConfig
from trace_jax.rollout.runner import RunnerConfig


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
    """The world's byte-level BPE.

    vocab_size: number of tokens (bytes, merges, the ReAct tags, pad and EOS); the policy's vocabulary.
    """

    vocab_size: int = 1024


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """The RL loop.

    steps: number of RL updates; a finished run is extended by rerunning it with a larger value. The learning-rate
      schedule spans the whole run: rl.steps × ppo.ppo_epochs × ppo.mini_batches optimizer steps.
    prompts_per_step: training questions per step (each grows one rollout tree).
    pool_size: the prompt pool, evenly spaced over the RL split (rl.split; every kind keeps its share; the same pool
      for every seed); each epoch visits it once in a fresh seeded order (``trace_jax.data.prompts``). 0: the
      whole split. The epochs a run makes follow from rl.steps (``rl.epochs`` under [derived]); synthetic
      recipe only.
    split: the world split the prompts come from, optionally only some question kinds: ``"train:chain"`` trains on
      the chain questions alone (``trace_jax.data.synthetic.KINDS``). Synthetic recipe only (a search_r1 run
      streams ``data.train_split``).
    advantage: advantage estimator, a key of ``trace_jax.rl.advantages.ESTIMATORS``.
    warmup_steps: linear learning-rate warm-up over this many RL steps, i.e. over the first rl.warmup_steps ×
      ppo.ppo_epochs × ppo.mini_batches optimizer steps (rounded); fractions count (0.5: the first half of step
      1's optimizer steps).
    checkpoint_every: save the whole state every this many steps (and at the last step).
    keep_checkpoints: how many recent checkpoints to keep.
    logprob_chunk: compute the LM head this many positions at a time in the train step (peak logits memory
      [rows, chunk, vocab] instead of [rows, length, vocab]); None: the trainer's default chunk.
    preemption_grace_s: seconds between a SIGTERM (spot / queued capacity's preemption notice, ~30 s ahead) and
      the exit: the RL step under way finishes if it can, a checkpoint is written and the job exits with code
      143; a step still running when too little of the grace is left to write the checkpoint is abandoned
      (the last checkpoint stays the resume point). Rerunning the same command resumes exactly.
    max_staleness: how many policy versions the trees a step trains on may lag the policy it trains (0: every
      step samples its trees with the policy it then updates, strictly one after the other). k >= 1: while the
      trainer updates at step t, a background thread samples step t + 1's trees with the weights the engine
      has (the policy of step t - 1: one version old; one engine samples one step at a time, so the lag never
      exceeds 1); the PPO ratio corrects the lag with the sampler's log-probs (``trace_jax.cluster.pipeline``).
      A step that ends at a checkpoint or an evaluation, and the last step, do not sample ahead (the next
      step samples with the newest policy), so checkpoints never hold work in flight and a resume is exact.
      One process only.
    """

    steps: int = 30
    prompts_per_step: int = 16
    pool_size: int = 0
    split: str = "train"
    advantage: str = "grpo"
    warmup_steps: float = 0.5
    checkpoint_every: int = 5
    keep_checkpoints: int = 2
    logprob_chunk: int | None = None
    preemption_grace_s: float = 25.0
    max_staleness: int = 0


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Greedy held-out evaluation (EM / F1 per hop group) before RL, every ``every`` steps and at the end.

    split: world split evaluated: train, test or ood; optionally only some question kinds: ``"test:chain"``
      evaluates the chain questions alone (``trace_jax.data.synthetic.KINDS``).
    num_questions: how many questions of the split, evenly spaced over it (every hop group keeps its share).
    every: also evaluate every this many RL steps; 0 evaluates only before and after RL.
    """

    split: str = "test"
    num_questions: int = 150
    every: int = 10


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The device mesh: its axes' sizes; their product must equal the number of devices.

    data, fsdp, tensor: the size of each mesh axis; one of them may be -1 (it takes the remaining devices).
    expert: the expert-parallel axis: a mixture-of-experts model's experts are split over it (and the batch
        with data and fsdp); 1 (the default) changes nothing, and dense models have no expert weights.
    rollout_devices: how many devices only sample: the first ones of ``jax.devices()``; the engine decodes on
        them (slots split over fsdp) with its own copy of the weights, which each update sends there
        (``time/weight_sync_s``), and the axes above lay out the remaining devices, which train. 0 (the
        default): colocated, the engine decodes on the training devices. One process only.
    rollout_cpus: CPU hosts: sampling runs in a process of its own pinned to this many of the host's cores (the
        last ones this process may use), and the trainer's threads keep the rest (``trace_jax.job.sampling_process``).
        XLA:CPU runs all of a process's host devices on one thread pool, so apart devices (``rollout_devices``)
        still share every core; two processes do not. 0 (the default): sampling in the trainer's process. CPU
        backend, one JAX process, the synthetic recipe; not with ``rollout_devices``.
    """

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    expert: int = 1
    rollout_devices: int = 0
    rollout_cpus: int = 0


SECTIONS: dict[str, type] = {
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
    "rl": RLConfig,
    "eval": EvalConfig,
    "mesh": MeshConfig,
    "distributed": DistributedConfig,
}
TOP_LEVEL_DOCS = {"seed": "seed of the RL run: sampling, prompt order and the train state's rng"}


# ------------------------------------------------------------------------------------- derived values
def steps_per_rl_step(config: Mapping[str, Any]) -> int:
    """Optimizer steps one RL step makes: ppo.ppo_epochs × ppo.mini_batches (``UpdateConfig.steps_per_batch``)."""
    return from_config(UpdateConfig, config.get("ppo")).steps_per_batch


def derived(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The values the job computes from other keys, by the name of the field they set (in optimizer steps)."""
    per_step = steps_per_rl_step(config)
    values = {
        # At least 1: a run of 0 RL steps (evaluation only) still builds its optimizer.
        "optim.total_steps": max(config.rl.steps * per_step, 1),
        "optim.warmup_steps": int(config.rl.warmup_steps * per_step + 0.5),  # rounded half up
    }
    if config.rl.get("pool_size"):
        values["rl.epochs"] = epochs(config)
    return values


def prompts_drawn_per_step(config: Mapping[str, Any]) -> int:
    """Prompts an RL step draws: ``rl.prompts_per_step``, times ``allocation.candidates_per_prompt`` when the
    allocation policy selects the step's batch from more candidates."""
    return from_config(SchedulerConfig, config.get("allocation")).candidates(config["rl"]["prompts_per_step"])


def steps_per_epoch(config: Mapping[str, Any]) -> int:
    """RL steps of one pass over the prompt pool (``rl.pool_size``): the pool's whole batches of drawn prompts
    (a batch never straddles two epochs); 0 without a pool."""
    pool = config["rl"].get("pool_size", 0)
    return max(pool // prompts_drawn_per_step(config), 1) if pool else 0


def epochs(config: Mapping[str, Any]) -> float:
    """Passes over the prompt pool that rl.steps make (``rl.epochs`` under [derived])."""
    return config["rl"]["steps"] / steps_per_epoch(config)


def steps_for_epochs(config: Mapping[str, Any], num_epochs: float) -> int:
    """The rl.steps that visit the pool (``rl.pool_size``) ``num_epochs`` times (rounded up to whole steps)."""
    return math.ceil(num_epochs * steps_per_epoch(config) - 1e-9)


DERIVED_DOCS = {
    "optim.total_steps": "optimizer steps of the whole run: rl.steps × ppo.ppo_epochs × ppo.mini_batches",
    "optim.warmup_steps": "optimizer steps of warm-up: rl.warmup_steps × ppo.ppo_epochs × ppo.mini_batches",
    "rl.epochs": "passes over the prompt pool: rl.steps / (rl.pool_size // prompts drawn a step), not a key",
}


def optimizer_config(config: ml_collections.ConfigDict) -> OptimizerConfig:
    """``config.optim`` with the schedule's lengths in optimizer steps from :func:`derived`."""
    fields = {key.partition(".")[2]: value for key, value in derived(config).items() if key.startswith("optim.")}
    return from_config(OptimizerConfig, config.optim, **fields)


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


def retired_problems(keys: Any) -> list[str]:
    """One message per retired key among ``keys`` (dotted names, or a config whose keys are checked)."""
    if isinstance(keys, Mapping | ml_collections.ConfigDict):
        keys = [name for name, _ in _leaves(keys, "")]
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


_DOC_LINE = re.compile(r"^\s*([A-Za-z_]\w*(?:\s*(?:,|/)\s*[A-Za-z_]\w*)*)\s*:\s+(.*)$")


def field_docs(cls: type) -> dict[str, str]:
    """Each field's text from the dataclass docstring's ``name: text`` lines (``a, b: text`` and
    ``a / b: text`` document several fields; indented lines continue the text). Undocumented fields
    get ``see ClassName``."""
    names = {f.name for f in dataclasses.fields(cls)}
    docs: dict[str, str] = {}
    current: list[str] = []
    indent = None
    for line in (cls.__doc__ or "").splitlines():
        match = _DOC_LINE.match(line)
        keys = re.split(r"\s*(?:,|/)\s*", match.group(1)) if match else []
        if match and set(keys) <= names:
            current, indent = keys, len(line) - len(line.lstrip())
            for key in keys:
                docs[key] = match.group(2).strip()
        elif current and line.strip() and len(line) - len(line.lstrip()) > indent:
            for key in current:
                docs[key] += " " + line.strip()
        else:
            current = []
    return {name: docs.get(name, f"see {cls.__name__}") for name in sorted(names)}


def _leaves(section: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    for key, value in section.items():
        if isinstance(value, Mapping | ml_collections.ConfigDict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value


def describe(config: ml_collections.ConfigDict) -> str:
    """Every key of ``config`` as ``key = value  # doc``, one per line, sections in config order; then the
    values the job derives from them (:func:`derived`)."""
    lines = []
    for name, value in config.items():
        if not isinstance(value, ml_collections.ConfigDict):
            lines.append(f"{name} = {value!r}  # {TOP_LEVEL_DOCS.get(name, '')}".rstrip(" #"))
            continue
        cls = SECTIONS.get(name)
        docs = field_docs(cls) if cls is not None else {}
        lines.append(f"\n[{name}]" + (f"  {cls.__doc__.strip().splitlines()[0]}" if cls and cls.__doc__ else ""))
        for key, leaf in _leaves(value, ""):
            doc = docs.get(key.split(".")[0], "")
            lines.append(f"{name}.{key} = {leaf!r}" + (f"  # {doc}" if doc else ""))
    if {"rl", "ppo", "optim"} <= set(config.keys()):
        lines.append("\n[derived]  computed from the keys above; not keys themselves")
        lines += [f"{key} = {value!r}  # {DERIVED_DOCS[key]}" for key, value in derived(config).items()]
    return "\n".join(lines).lstrip("\n")
