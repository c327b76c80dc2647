"""Builds the pieces of a run from its config: world, tokenizer, environment, engine, runners, scheduler.

Shared by ``trace_jax.job.train`` (which also trains) and ``trace_jax.job.evaluate`` (which rebuilds a finished
run from the ``config.json`` written into its workdir), so both see exactly the same world and env.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import shutil
from collections.abc import Callable
from typing import Any

from flax import nnx

from trace_jax.allocation.scheduler import TreeScheduler
from trace_jax.cluster.processes import Processes
from trace_jax.configs import RunConfig, validate
from trace_jax.data.synthetic import SyntheticWorld
from trace_jax.data.tokenizer import load_tokenizer, train_world_tokenizer
from trace_jax.envs.react import ReActEnv
from trace_jax.envs.retrieval.retriever import build_retriever
from trace_jax.job import rundir
from trace_jax.job.sft import SFTResult, run_sft
from trace_jax.job.warm_start import CacheEntry, WarmStartCache, key_material
from trace_jax.models import ModelConfig
from trace_jax.rollout.engine.engine import Engine
from trace_jax.rollout.engine.layout import SamplingLayout
from trace_jax.rollout.runner import RolloutRunner

CONFIG_FILE = rundir.CONFIG_FILE
CHECKPOINTS = rundir.CHECKPOINTS


@dataclasses.dataclass
class World:
    """The task side of a run: questions, the tokenizer the policy speaks and the environment judging it."""

    world: SyntheticWorld
    tokenizer: Any
    env: ReActEnv


def build_world(config: RunConfig, workdir: pathlib.Path) -> World:
    """The synthetic world, its tokenizer (trained once, then reused from ``workdir/tokenizer``) and env."""
    world = SyntheticWorld(config.world)
    tokenizer_dir = workdir / "tokenizer"
    if not (tokenizer_dir / "tokenizer.json").is_file():
        # Trained aside, then renamed: a kill mid-save never leaves a torn tokenizer to be loaded later.
        partial = workdir / "tokenizer.partial"
        shutil.rmtree(partial, ignore_errors=True)
        train_world_tokenizer(world, partial, vocab_size=config.tokenizer.vocab_size)
        shutil.rmtree(tokenizer_dir, ignore_errors=True)
        partial.rename(tokenizer_dir)
    tokenizer = load_tokenizer(tokenizer_dir)
    # BM25 over the world's corpus unless the config's ``retriever`` section names a corpus file or a server.
    retriever = build_retriever(config.retriever, rows=world.corpus)
    env = ReActEnv(tokenizer, retriever, config.react)
    return World(world, tokenizer, env)


def build_engine(config: RunConfig, model_config: ModelConfig, params: nnx.State | None = None, *, mesh=None) -> Engine:
    """The one decode engine of a run (rollouts and evaluation share it, and its KV pool). With a ``mesh`` it
    decodes in the sampling layout (``trace_jax.rollout.engine.layout``); ``params`` become its weights."""
    layout = None if mesh is None else SamplingLayout(mesh)
    engine = Engine.for_model(model_config, config.engine, layout)
    if params is not None:
        engine.set_params(params)
    return engine


def build_runner(
    config: RunConfig,
    model_config: ModelConfig,
    params: nnx.State | None,
    world: World,
    *,
    greedy: bool = False,
    seed: int | None = None,
    engine: Engine | None = None,
) -> RolloutRunner:
    """A runner for the policy on ``engine`` (default: a new one); ``greedy`` decodes by argmax (evaluation).
    ``params`` (``None``: the engine's current weights) are handed to the engine."""
    engine = engine or build_engine(config, model_config)
    eos_id = world.tokenizer.eos_token_id
    overrides: dict[str, Any] = {"eos_ids": () if eos_id is None else (eos_id,), "greedy": greedy}
    if seed is not None:
        overrides["seed"] = seed
    return RolloutRunner(engine, params, world.env, dataclasses.replace(config.runner, **overrides))


def build_scheduler(config: RunConfig, backend: Any) -> TreeScheduler:
    return TreeScheduler(backend, config.allocation)


@dataclasses.dataclass
class WarmStart:
    """A run's starting point from the warm-start cache: the world (with the cached tokenizer), the SFT
    policy, the cache entry and whether this call trained it (``trained``) or found it."""

    world: World
    sft: SFTResult
    entry: CacheEntry
    trained: bool

    def describe(self) -> dict[str, Any]:
        """The warm start's reproducible facts, for a run's summary."""
        return {
            "key": self.entry.key,
            "steps": self.sft.steps,
            "final_loss": self.sft.final_loss,
            "stopped_by": self.sft.stopped_by,
            "reproducible": self.sft.reproducible,
        }


def build_warm_start(
    config: RunConfig, progress: Callable[[int, str], Any] | None = None, notify: Any = None
) -> WarmStart:
    """The world and SFT policy of ``config``, from the shared cache (trained into it on a miss).

    ``progress(total, description)`` makes a tqdm-like bar for the SFT steps (called only when training);
    ``notify(message)`` reports waiting on another process that builds the same entry.

    With several JAX processes (one job) the cache is on a filesystem they all see or in a bucket: process 0 alone
    takes a local entry's lock, trains the tokenizer (a bucket's: in its own folder, then uploads it) and writes
    ``warm_start.json`` last; the others wait for the tokenizer at a barrier (a bucket's: then download it); all
    of them take part in the SFT (one program over every device), whose orbax checkpoint they write together.
    """
    entry = WarmStartCache(config.warm_start.cache_dir).entry(config)
    processes = Processes()
    with entry.building(notify) if processes.is_main else contextlib.nullcontext():
        world = _entry_world(config, entry, processes)
        sft_config = config.sft
        info = entry.info()
        bar = None if info is not None or progress is None else progress(sft_config.max_steps, "warm start (SFT)")
        try:
            sft = run_sft(sft_config, world.world, world.tokenizer, entry.directory, env=world.env, progress=bar)
        finally:
            if bar is not None:
                bar.close()
        start = WarmStart(world, sft, entry, trained=not sft.restored)
        if processes.is_main and (info is None or start.trained):
            entry.write_info({"config": key_material(config), **start.describe()})
    return start


def _entry_world(config: RunConfig, entry: CacheEntry, processes: Processes) -> World:
    """The world with the entry's tokenizer. Process 0 downloads a complete entry's, or trains one and publishes
    it; the others read it only after the barrier that follows (never a tokenizer half-written)."""
    if processes.is_main:
        complete = entry.info() is not None
        if complete:
            entry.fetch_tokenizer()
        world = build_world(config, entry.local)  # trains the tokenizer when ``entry.local`` has none
        if not complete:
            entry.publish_tokenizer()
    processes.barrier("warm start: tokenizer written")
    if processes.is_main:
        return world
    entry.fetch_tokenizer()
    return build_world(config, entry.local)  # finds process 0's tokenizer


def save_run_config(config: RunConfig, workdir: pathlib.Path) -> None:
    """Writes the run's config keys (``RunConfig.to_dict``) to ``workdir/config.json``."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n")


def load_run_config(workdir: pathlib.Path) -> RunConfig:
    """A saved run's typed config: its ``config.json``, retired keys upgraded (``rundir.read_saved_config``),
    checked and typed as a command line's is (``validate.validate``)."""
    path = workdir / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{workdir} has no {CONFIG_FILE}: it is not a trace_jax run directory")
    return validate.validate(rundir.read_saved_config(path))
