"""Builds the pieces of a run from its config: world, tokenizer, environment, engine, runners, scheduler.

Shared by ``trace_jax.train`` (which also trains) and ``trace_jax.evaluate`` (which rebuilds a finished
run from the ``config.json`` written into its workdir), so both see exactly the same world and env.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import ml_collections
from flax import nnx

from trace_jax.allocation.scheduler import SchedulerConfig, TreeScheduler
from trace_jax.config_utils import from_config
from trace_jax.data.synthetic import SyntheticWorld, WorldConfig
from trace_jax.data.tokenizer import load_tokenizer, train_world_tokenizer
from trace_jax.envs.react import ReActConfig, ReActEnv
from trace_jax.envs.retriever import RetrieverConfig, build_retriever
from trace_jax.models.qwen import ModelConfig
from trace_jax.rollout.engine import Engine, EngineConfig
from trace_jax.rollout.runner import RolloutRunner, RunnerConfig
from trace_jax.rollout.sampling import SamplingConfig

CONFIG_FILE = "config.json"
CHECKPOINTS = "checkpoints"


@dataclasses.dataclass
class World:
    """The task side of a run: questions, the tokenizer the policy speaks and the environment judging it."""

    world: SyntheticWorld
    tokenizer: Any
    env: ReActEnv


def build_world(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> World:
    """The synthetic world, its tokenizer (trained once, then reused from ``workdir/tokenizer``) and env."""
    world = SyntheticWorld(from_config(WorldConfig, config.world))
    tokenizer_dir = workdir / "tokenizer"
    if (tokenizer_dir / "tokenizer.json").is_file():
        tokenizer = load_tokenizer(tokenizer_dir)
    else:
        tokenizer = train_world_tokenizer(world, tokenizer_dir, vocab_size=config.tokenizer.vocab_size)
    # BM25 over the world's corpus unless the config's ``retriever`` section names a corpus file or a server.
    retriever = build_retriever(from_config(RetrieverConfig, config.get("retriever")), rows=world.corpus)
    env = ReActEnv(tokenizer, retriever, from_config(ReActConfig, config.react))
    return World(world, tokenizer, env)


def build_runner(
    config: ml_collections.ConfigDict,
    model_config: ModelConfig,
    params: nnx.State,
    world: World,
    *,
    greedy: bool = False,
    seed: int | None = None,
) -> RolloutRunner:
    """An engine + runner for the policy; ``greedy`` swaps the sampling settings for argmax decoding."""
    engine_config = from_config(EngineConfig, config.engine)
    if greedy:
        engine_config = dataclasses.replace(engine_config, sampling=SamplingConfig.make_greedy())
    engine = Engine.for_model(model_config, engine_config)
    eos_id = world.tokenizer.eos_token_id
    overrides: dict[str, Any] = {"eos_ids": () if eos_id is None else (eos_id,)}
    if seed is not None:
        overrides["seed"] = seed
    return RolloutRunner(engine, params, world.env, from_config(RunnerConfig, config.runner, **overrides))


def build_scheduler(config: ml_collections.ConfigDict, backend: Any) -> TreeScheduler:
    return TreeScheduler(backend, from_config(SchedulerConfig, config.allocation))


def save_run_config(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / CONFIG_FILE).write_text(config.to_json_best_effort(indent=2, sort_keys=True) + "\n")


def load_run_config(workdir: pathlib.Path) -> ml_collections.ConfigDict:
    path = workdir / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{workdir} has no {CONFIG_FILE}: it is not a trace_jax run directory")
    return ml_collections.ConfigDict(json.loads(path.read_text()))
