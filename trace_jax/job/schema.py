"""The main job's config, section by section: which dataclass each section builds, and each key's doc.

Every section of ``configs/default.py`` is ``to_config(SomeConfig(...))`` of the dataclass named in
:data:`SECTIONS`, so a key's type, default and documentation live in one place: the dataclass and its
docstring. The four sections only the main job reads (``tokenizer``, ``rl``, ``eval``, ``mesh``) are defined
here. :func:`describe` renders a config as ``key = value  # doc`` lines (``python -m trace_jax.train
--show-config``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import Any

import ml_collections

from trace_jax.allocation.scheduler import SchedulerConfig
from trace_jax.data.synthetic import WorldConfig
from trace_jax.envs.react import ReActConfig
from trace_jax.envs.retriever import RetrieverConfig
from trace_jax.job.sft import SFTConfig
from trace_jax.job.warm_start import WarmStartConfig
from trace_jax.optim import OptimizerConfig
from trace_jax.parallel.distributed import DistributedConfig
from trace_jax.rl.batch import BatchConfig
from trace_jax.rl.losses import LossConfig
from trace_jax.rl.trainer import UpdateConfig
from trace_jax.rollout.engine import EngineConfig
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

    steps: number of RL updates; a finished run is extended by rerunning it with a larger value.
    prompts_per_step: training questions per step (each grows one rollout tree).
    advantage: advantage estimator, a key of ``trace_jax.rl.advantages.ESTIMATORS``.
    micro_batches: RLTrainer.train_step's gradient-accumulation split (benchmarks, planner); the main job's
      update accumulates over micro-batches of ppo.micro_rows rows.
    recompute_old_logprobs: recompute the sampling policy's logprobs with the training forward pass.
    checkpoint_every: save the whole state every this many steps (and at the last step).
    keep_checkpoints: how many recent checkpoints to keep.
    logprob_chunk: compute the LM head this many positions at a time in the train step (peak logits memory
      [rows, chunk, vocab] instead of [rows, length, vocab]); None: the trainer's default chunk.
    """

    steps: int = 30
    prompts_per_step: int = 16
    advantage: str = "grpo"
    micro_batches: int = 1
    recompute_old_logprobs: bool = False
    checkpoint_every: int = 5
    keep_checkpoints: int = 2
    logprob_chunk: int | None = None


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Greedy held-out evaluation (EM / F1 per hop group) before RL, every ``every`` steps and at the end.

    split: world split evaluated: train, test or ood.
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
    """

    data: int = 1
    fsdp: int = -1
    tensor: int = 1


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
        if isinstance(value, ml_collections.ConfigDict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value


def describe(config: ml_collections.ConfigDict) -> str:
    """Every key of ``config`` as ``key = value  # doc``, one per line, sections in config order."""
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
    return "\n".join(lines).lstrip("\n")
