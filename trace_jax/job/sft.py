"""Supervised warm start: teach the policy the ReAct protocol on gold trajectories before RL.

RL learns only from groups with mixed outcomes, so the policy must already succeed sometimes. This module
renders the synthetic world's gold trajectories through the environment (the same ``ReActEnv.step`` path
a rollout takes: turn tokens carry loss, observation and prompt tokens do not), and trains the Qwen
policy with next-token cross-entropy on the turn tokens, jit-compiled on the mesh, for a fixed number of
steps (so the same settings give the same model on any machine and under any load; a wall-clock budget is
an explicit opt-in). The result is checkpointed (orbax) under ``workdir``; a second call with the same
settings restores it instead of training again::

    result = run_sft(SFTConfig(), world, tokenizer, workdir)
    graphdef, _ = abstract_model(result.model_config); model = nnx.merge(graphdef, result.params)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import pathlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trace_jax import paths
from trace_jax.checkpoint.state import StateCheckpointer
from trace_jax.cluster.processes import Processes
from trace_jax.configs.sections import SFTConfig
from trace_jax.data.synthetic import SyntheticWorld
from trace_jax.envs.react import ReActConfig, ReActEnv, render_trajectory
from trace_jax.envs.retrieval.retriever import BM25Retriever, Retriever
from trace_jax.job.cli import TERMINATION
from trace_jax.models import ModelConfig, create_model
from trace_jax.optim import make_optimizer
from trace_jax.parallel.mesh import batch_sharding, create_sharded, make_mesh

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SFTData:
    """Examples right-padded to ``T``: int32 ``ids [N, T]``, float32 ``loss_mask [N, T]`` (1 on turn
    tokens), int32 ``lengths [N]`` (true lengths) and ``hops [N]``."""

    ids: np.ndarray
    loss_mask: np.ndarray
    lengths: np.ndarray
    hops: np.ndarray

    def buckets(self, multiple: int) -> dict[int, np.ndarray]:
        """Row indices grouped by length rounded up to ``multiple``: a batch from one bucket is cut to that
        width, so short (1-hop) examples do not pay for the longest one, and only a few shapes compile."""
        widths = np.minimum(-(-self.lengths // multiple) * multiple, self.ids.shape[1])
        return {int(w): np.flatnonzero(widths == w) for w in np.unique(widths)}


@dataclasses.dataclass
class SFTResult:
    """What ``run_sft`` hands to the RL job: the params (an ``nnx.State`` of ``nnx.Param``) and their config."""

    params: nnx.State
    model_config: ModelConfig
    steps: int
    final_loss: float
    seconds: float
    restored: bool
    losses: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (step, loss) every log_every
    reproducible: bool = True  # False when a wall-clock budget, not the step count, ended training

    @property
    def stopped_by(self) -> str:
        return "steps" if self.reproducible else "time_budget_s"


def make_env(world: SyntheticWorld, tokenizer: Any, react: str = "synthetic", retriever: Retriever | None = None):
    """The ReAct env over ``world``'s corpus (BM25 unless a retriever is given), with a named preset."""
    retriever = retriever if retriever is not None else BM25Retriever.from_rows(world.corpus)
    return ReActEnv(tokenizer, retriever, ReActConfig.preset(react))


def practice_worlds(world: SyntheticWorld, count: int, seed: int = 0) -> list[SyntheticWorld]:
    """``count`` relabeled copies of ``world`` (same structure and questions by position, names shuffled)."""
    return [
        SyntheticWorld(dataclasses.replace(world.config, relabel_seed=seed * 1000 + i)) for i in range(1, count + 1)
    ]


def build_sft_data(
    env: ReActEnv | Sequence[ReActEnv], tasks: Sequence[Mapping[str, Any]], pad_id: int, multiple: int = 32
) -> SFTData:
    """Renders each task's ``gold_turns`` in its env and right-pads to the longest, rounded up to ``multiple``.

    ``env`` is one env for every task, or one env per task (tasks of several worlds).
    """
    envs = [env] * len(tasks) if isinstance(env, ReActEnv) else list(env)
    if len(envs) != len(tasks):
        raise ValueError(f"{len(envs)} envs for {len(tasks)} tasks; pass one env, or one per task")
    trajectories = [render_trajectory(e, t, t["gold_turns"]) for e, t in zip(envs, tasks, strict=True)]
    if not trajectories:
        raise ValueError("no tasks to build SFT data from; the split is empty")
    failed = [t["id"] for t, tr in zip(tasks, trajectories, strict=True) if tr.reward != 1.0]
    if failed:  # a gold trace that does not reach its answer would teach the wrong thing
        raise ValueError(f"{len(failed)} gold trajectories do not earn reward 1 in this env, e.g. {failed[:3]}")
    length = max(tr.ids.shape[0] for tr in trajectories)
    length = -(-length // multiple) * multiple
    ids = np.full((len(trajectories), length), pad_id, np.int32)
    mask = np.zeros((len(trajectories), length), np.float32)
    for i, tr in enumerate(trajectories):
        ids[i, : tr.ids.shape[0]] = tr.ids
        mask[i, : tr.ids.shape[0]] = tr.loss_mask
    lengths = np.asarray([tr.ids.shape[0] for tr in trajectories], np.int32)
    return SFTData(ids, mask, lengths, np.asarray([t.get("hops", 0) for t in tasks], np.int32))


def token_loss(logits_btv: jax.Array, ids_bt: jax.Array, mask_bt: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy over positions whose *target* token has mask 1.

    logits_btv[:, t] predicts ids_bt[:, t + 1]; only turn tokens (mask 1) are targets.
    """
    targets_bt = ids_bt[:, 1:]
    weights_bt = mask_bt[:, 1:]
    nll_bt = optax.softmax_cross_entropy_with_integer_labels(logits_btv[:, :-1], targets_bt)
    return jnp.sum(nll_bt * weights_bt) / jnp.maximum(jnp.sum(weights_bt), 1.0)


def state_shardings(tree: Any, mesh: Mesh) -> Any:
    """Each leaf's NamedSharding (a leaf on a single device, like an optimizer step count, is replicated)."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: x.sharding if isinstance(x.sharding, NamedSharding) else replicated, tree)


def make_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, shardings: Any = None):
    """A jit-compiled ``(params, opt_state, ids, mask) -> (params, opt_state, loss)``; params and state are donated.

    ``shardings``: optional ``(params, opt_state)`` shardings the outputs keep, so step t+1 sees inputs
    placed exactly like step t's and nothing recompiles.
    """

    def loss_fn(params, ids_bt, mask_bt):
        return token_loss(nnx.merge(graphdef, params)(ids_bt).logits_btv, ids_bt, mask_bt)

    def step(params, opt_state, ids_bt, mask_bt):
        loss, grads = jax.value_and_grad(loss_fn)(params, ids_bt, mask_bt)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    out_shardings = None if shardings is None else (*shardings, None)
    # Donated: the old params / optimizer state are dead after the step, so XLA may update in place.
    return jax.jit(step, donate_argnums=(0, 1), out_shardings=out_shardings)


def _fingerprint(config: SFTConfig, model_config: ModelConfig, world: SyntheticWorld, data: SFTData) -> str:
    """What must match for a saved warm start to be reused: settings, architecture, world and the exact
    training ids (which also pins the tokenizer and the environment's rendering)."""
    return json.dumps(
        {
            "sft": dataclasses.asdict(config),
            "model": dataclasses.asdict(model_config),
            "world": dataclasses.asdict(world.config),
            "data_sha256": hashlib.sha256(data.ids.tobytes() + data.loss_mask.tobytes()).hexdigest(),
        },
        sort_keys=True,
        default=str,
    )


def _save_partial(
    checkpointer: StateCheckpointer,
    step: int,
    params: Any,
    opt_state: Any,
    rng: np.random.Generator,
    fingerprint: str,
    losses: list,
    start: float,
) -> None:
    """The warm start's progress at a SIGTERM (after ``step`` steps): what :func:`_resume_partial` continues from."""
    meta = {
        "fingerprint": fingerprint,
        "partial": True,
        "rng": rng.bit_generator.state,  # the batches still to draw
        "losses": losses,
        "seconds": time.monotonic() - start,
    }
    checkpointer.save(step, {"params": params, "opt_state": opt_state}, metadata=meta, force=True)
    checkpointer.wait()
    log.info("SFT: SIGTERM; progress saved at step %d in %s", step, checkpointer.directory)


def _resume_partial(checkpointer: StateCheckpointer, restored: Any, params: Any, opt_state: Any) -> tuple:
    """``(params, opt_state, rng, step, losses, seconds)`` of the progress :func:`_save_partial` wrote."""
    full = checkpointer.restore(restored.step, target={"params": params, "opt_state": opt_state})
    rng = np.random.default_rng()
    rng.bit_generator.state = restored.metadata["rng"]
    losses = [tuple(x) for x in restored.metadata["losses"]]
    state = full.state
    return state["params"], state["opt_state"], rng, restored.step, losses, restored.metadata["seconds"]


def run_sft(
    config: SFTConfig,
    world: SyntheticWorld,
    tokenizer: Any,
    workdir: str | pathlib.Path,
    env: ReActEnv | None = None,
    mesh: Mesh | None = None,
    progress: Any = None,
) -> SFTResult:
    """Trains (or restores) the warm-start policy; the checkpoint lives in ``workdir/sft``.

    Args:
      config: :class:`SFTConfig`.
      world: the synthetic world whose ``config.split`` gold trajectories are the training data.
      tokenizer: the tokenizer the policy uses (its length sets the vocabulary).
      workdir: run directory; ``workdir/sft`` holds the orbax checkpoint, reused when settings match.
      env: the environment to render ``world`` with (defaults to :func:`make_env` with ``config.react``).
      mesh: where to train (default: ``make_mesh()`` over all devices; ``batch_size`` must divide over
        its data x fsdp axes).
      progress: optional tqdm-like bar (``update(n)``, ``set_postfix(**values)``) advanced once per step.
    """
    # Practice worlds are rendered with the same env settings as the world itself (a passed env wins).
    react = env.config if env is not None else ReActConfig.preset(config.react)
    envs, tasks = [], []
    for i, w in enumerate([world, *practice_worlds(world, config.practice_worlds, config.seed)]):
        world_env = (
            env if (i == 0 and env is not None) else ReActEnv(tokenizer, BM25Retriever.from_rows(w.corpus), react)
        )
        envs += [world_env] * len(w.questions(config.split))
        tasks += w.questions(config.split)
    data = build_sft_data(envs, tasks, tokenizer.pad_token_id)
    model_config = config.model_config(len(tokenizer))
    fingerprint = _fingerprint(config, model_config, world, data)

    mesh = mesh if mesh is not None else make_mesh()
    model = create_sharded(lambda: create_model(model_config, nnx.Rngs(config.seed)), mesh)
    if config.embed_init_std is not None:
        embed = model.embed.value
        fresh = config.embed_init_std * jax.random.normal(jax.random.key(config.seed), embed.shape, embed.dtype)
        model.embed.value = jax.device_put(fresh, embed.sharding)  # keep its place on the mesh
    graphdef, params = nnx.split(model, nnx.Param)
    checkpointer = StateCheckpointer(paths.as_path(workdir) / "sft", keep=1)  # local or a bucket
    try:
        restored = checkpointer.restore_latest(target={"params": params})
        if restored is not None and restored.metadata.get("fingerprint") != fingerprint:
            restored = None  # another warm start's: trained again (and replaced) below
        if restored is not None and not restored.metadata.get("partial"):
            meta = restored.metadata
            log.info("SFT: reusing the warm start in %s (step %d)", checkpointer.directory, restored.step)
            return SFTResult(
                restored.state["params"],
                model_config,
                restored.step,
                meta["loss"],
                meta["seconds"],
                True,
                [tuple(x) for x in meta["losses"]],
                meta.get("reproducible", True),
            )

        optimizer = make_optimizer(
            learning_rate=config.learning_rate,
            warmup_steps=config.warmup_steps,
            total_steps=config.max_steps,
            weight_decay=config.weight_decay,
        )
        opt_state = optimizer.init(params)
        shardings = (state_shardings(params, mesh), state_shardings(opt_state, mesh))
        opt_state = jax.device_put(opt_state, shardings[1])
        train_step = make_train_step(graphdef, optimizer, shardings)
        sharding = batch_sharding(mesh)
        buckets = data.buckets(config.bucket_multiple)
        widths = np.asarray(sorted(buckets))
        # A bucket is drawn in proportion to its size, so every example is equally likely overall.
        bucket_p = np.asarray([len(buckets[w]) for w in widths], np.float64) / data.ids.shape[0]
        rng = np.random.default_rng(config.seed)
        budget = float("inf") if config.time_budget_s is None else config.time_budget_s
        step, losses, before, loss_value = 0, [], 0.0, float("nan")  # before: seconds of the runs SIGTERM stopped
        if restored is not None:  # a SIGTERM's progress: continue exactly where it stopped
            params, opt_state, rng, step, losses, before = _resume_partial(checkpointer, restored, params, opt_state)
            log.info("SFT: resuming the warm start at step %d (saved at a SIGTERM)", step)
            if progress is not None:
                progress.update(step)
        start, saved = time.monotonic() - before, step
        processes = Processes()  # with several, every process stops after the same step (any one's SIGTERM)
        stop_requested = lambda: processes.reduce({"stop": float(TERMINATION.requested)})["stop"] > 0
        # A SIGTERM lets the step under way finish, then saves the progress (params, optimizer, sampler of
        # batches) and stops: a rerun resumes from it and ends bit-identical to an uninterrupted warm start.
        with TERMINATION.grace(float("inf")):
            while step < config.max_steps and time.monotonic() - start < budget:
                if stop_requested():
                    if step > saved:
                        _save_partial(checkpointer, step, params, opt_state, rng, fingerprint, losses, start)
                    raise KeyboardInterrupt  # -> Preempted (exit 143) in the job; the rerun resumes at ``step``
                width = int(rng.choice(widths, p=bucket_p))
                rows = rng.choice(
                    buckets[width], size=config.batch_size, replace=len(buckets[width]) < config.batch_size
                )
                ids = jax.device_put(data.ids[rows, :width], sharding)
                mask = jax.device_put(data.loss_mask[rows, :width], sharding)
                params, opt_state, loss_value = train_step(params, opt_state, ids, mask)
                step += 1
                if step % config.log_every == 0 or step == 1:
                    losses.append((step, float(loss_value)))
                    log.info("SFT step %d loss %.4f (%.1fs)", step, losses[-1][1], time.monotonic() - start)
                    if progress is not None:
                        progress.set_postfix(loss=f"{losses[-1][1]:.3f}", refresh=False)
                if progress is not None:
                    progress.update(1)
        loss = float(loss_value)
        seconds = time.monotonic() - start
        reproducible = step == config.max_steps
        meta = {
            "fingerprint": fingerprint,
            "loss": loss,
            "seconds": seconds,
            "losses": losses,
            "reproducible": reproducible,
        }
        checkpointer.save(step, {"params": params}, metadata=meta, force=True)
        checkpointer.wait()
        return SFTResult(params, model_config, step, loss, seconds, False, losses, reproducible)
    finally:
        checkpointer.close()
