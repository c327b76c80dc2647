"""One run's state between RL steps (policy, optimizer, engine, scheduler, prompt stream) and the step itself.

``trace_jax.job.train`` orchestrates it: warm start, evaluation, the RL loop, checkpoints and logs.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import pathlib
import pickle
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.checkpoint.state import StateCheckpointer
from trace_jax.cluster.pipeline import RolloutPipeline
from trace_jax.cluster.placement import Placement
from trace_jax.cluster.processes import Processes
from trace_jax.configs import RunConfig, schema
from trace_jax.job import recipes, rundir
from trace_jax.job.cli import TERMINATION, Console
from trace_jax.job.sampling import SamplingSide
from trace_jax.job.sampling_process import SamplingProcess
from trace_jax.models import abstract_model, adapt, lora
from trace_jax.optim import make_optimizer
from trace_jax.parallel.mesh import shard_state
from trace_jax.rl.advantages import compute_advantages
from trace_jax.rl.batch import build_batch
from trace_jax.rl.trainer import RLTrainer
from trace_jax.rollout import figures
from trace_jax.rollout.tree import RolloutTree

# Rollouts sampled ahead that a SIGTERM's checkpoint kept (``Training.drain_and_save``): ``<dir>/<step>.pkl`` holds
# the trees step + 1 trains on, beside checkpoint ``step``.
SAMPLED_AHEAD_DIR = "sampled_ahead"
# Rollouts sampled ahead that a SIGTERM's checkpoint dropped (``Training.drop_and_save``): ``<dir>/<step>.pkl`` holds
# what samples them again, beside checkpoint ``step``: (policy version, the engine's weights, the behaviour params).
DROPPED_AHEAD_DIR = "dropped_ahead"


def eval_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    return {f"eval/em/{row['group']}" if row["group"] != "all" else "eval/em": row["em"] for row in rows}


def evaluates_after(config: RunConfig, step: int) -> bool:
    """Whether the held-out evaluation runs after RL step ``step`` (every ``eval.every`` steps and the last)."""
    return step == config.rl.steps or bool(config.eval.every and step % config.eval.every == 0)


def staleness(trees: list[RolloutTree], version: int) -> dict[str, float]:
    """How many versions behind policy ``version`` the trees' generated tokens were sampled (token-weighted mean
    and max over the trees that generated any)."""
    lags = [(version - tree.policy_version, sum(node.token_ids.size for node in tree.nodes[1:])) for tree in trees]
    tokens = sum(n for _, n in lags)
    return {
        "rollout/staleness_mean": float(sum(lag * n for lag, n in lags) / tokens) if tokens else 0.0,
        "rollout/staleness_max": float(max((lag for lag, n in lags if n), default=0)),
    }


class Training:
    """Everything one run holds between steps, and the step itself."""

    def __init__(self, config: RunConfig, workdir: pathlib.Path, console: Console, timer: Any):
        self.config, self.workdir, self.console, self.timer = config, workdir, console, timer
        self.step = 0  # RL updates done: the trainer's policy version
        # Which devices train, and which sample (if apart).
        self.placement = Placement.of(config.mesh)
        self.mesh = self.placement.train_mesh
        self.processes = Processes()  # one or several JAX processes: who samples what, who writes
        # config.recipe.kind: the synthetic world + SFT warm start, or a HF checkpoint + Search-R1 data.
        self.source = recipes.source_of(config)
        with timer.phase("warm_start"):
            self.start = self.source.start(config, workdir, self.mesh, progress=console.progress, notify=console.info)
        console.info(self.start.message)
        self.world = self.start.world
        with timer.phase("setup"):
            # lora.rank > 0: the policy is the warm start's weights, frozen, plus fresh adapters (the only ones
            # trained); the reference policy is the base, the adapters off.
            self.model_config, params = adapt(self.start.model_config, self.start.params, config.lora, config.seed)
            params = shard_state(params, self.mesh)
            self.start.params = None  # the train state holds the policy from here on
            loss_config = config.loss
            optimizer = make_optimizer(schema.optimizer_config(config))  # the schedule in optimizer steps, from rl.*
            reference = lora.without_adapters(params) if lora.has_adapters(params) else params
            self.trainer = RLTrainer(
                abstract_model(config.ppo.trained_model(self.model_config))[0],  # ppo.remat
                lora.frozen_base(optimizer, params) if lora.has_adapters(params) else optimizer,
                loss_config,
                mesh=self.mesh,
                reference_params=reference if loss_config.kl_coef else None,  # the trainer keeps its own copy
                update=config.ppo,
                sampling=config.engine.sampling,  # the policy trained is the one sampled
                # None: the trainer's own default chunk.
                **({} if config.rl.logprob_chunk is None else {"logprob_chunk": config.rl.logprob_chunk}),
            )
            self.state = self.trainer.init_state(params, jax.random.key(config.seed))
            del params
            # Rows padded to whole micro-batches of ``ppo.micro_rows``, what ``update`` runs (it drops the padding
            # rows and cuts the rest into fixed micro-batches itself), so the tree packing keeps the cut of the
            # trees that fills fewer of them (``trace_jax.rl.packing.tree_layout``).
            self.batch_config = dataclasses.replace(
                config.batch,
                row_buckets=None,
                row_multiple=self.trainer.micro_rows,
                pad_id=self.world.tokenizer.pad_token_id,
            )
            # One engine (its own sampling copy of the weights) serves both the rollouts and the evaluation; with
            # several processes each has its own, on its own devices; with sampling devices apart, on those; with
            # sampling cores apart (a CPU host), in a process of its own.
            self.sampler = self._sampling_side()
            self.engine_version = -1  # the policy version (RL updates) of the engine's weights
            # (version, params): a copy of the weights sampling ahead, kept for the trainer's recomputed behaviour
            # log-probs of those rollouts (``ppo.behaviour_logprobs`` "recompute" / "untruncated" at k >= 1).
            self.sampling_params: tuple[int, Any] | None = None
            self._sync_weights()
            self.checkpointer = StateCheckpointer(
                workdir / rundir.CHECKPOINTS, save_every=config.rl.checkpoint_every, keep=config.rl.keep_checkpoints
            )
            # Where nothing may be in flight: a checkpoint, an evaluation, the last step (trace_jax.cluster.pipeline).
            boundary = lambda step: self.checkpointer.should_save(step) or evaluates_after(config, step)
            self.pipeline = RolloutPipeline(self.sampler.sample, config.rl.max_staleness, boundary)
        self.resumes = 0
        self.slowest_save_s = 0.0  # wall-clock seconds of the slowest checkpoint so far (the SIGTERM grace)
        self.saved_step = -1  # the newest step checkpointed
        # (step, sampling state, None) of the completed step ``self.step`` while it is not checkpointed, from the
        # start of the next step to its update (which donates the state): what a SIGTERM then checkpoints
        # (``keep_last_step``). (step, None, trees) when the next step's trees were sampled ahead: those trees go
        # beside it, with the sampling side's state after them.
        self._completed: tuple[int, dict[str, Any] | None, Any] | None = None
        self._primed: Any = None  # the next step's rollouts, kept by a SIGTERM's checkpoint (``drain_and_save``)
        # The sampling side's state from before the rollouts in flight began, while they are: what a SIGTERM's
        # checkpoint that drops them saves (``drop_and_save``).
        self._launched: dict[str, Any] | None = None
        self.eval_before: list[dict[str, Any]] = []
        self.last_eval: list[dict[str, Any]] = []
        self.sampled_by_process: list[list[str]] = []  # the last step's questions, per process that sampled them

    # ------------------------------------------------------------------------------------ checkpoints
    def save(self, force: bool = False) -> None:
        if not (force or self.checkpointer.should_save(self.step)):
            return  # nothing read: the scheduler, prompts and runner may be sampling ahead on another thread
        self._engine_idle("a checkpoint")
        self._write(self.step, self.sampler.state_dict(), force)

    def _write(
        self, step: int, sampling: dict[str, Any], force: bool, sampled_ahead: bool = False, dropped_ahead: bool = False
    ) -> None:
        """Checkpoints the train state as step ``step`` with the sampling side's state ``sampling``."""
        # The policy is its own entry (evaluation restores just it); "train" holds the rest of the state once. With
        # adapters, the policy entry holds them alone: the frozen base comes from the run's start on resume.
        state = {
            "params": lora.trained_part(self.state.params),
            "train": self.state._replace(params=None),
            "scheduler": sampling["scheduler"],
        }
        metadata = {
            "prompts": sampling["prompts"],
            "runner": sampling["runner"],
            "eval_before": self.eval_before,
            "last_eval": self.last_eval,
            "timings": self.timer.state_dict(),
            "resumes": self.resumes,
            "sampled_ahead": sampled_ahead,  # the next step's trees are in SAMPLED_AHEAD_DIR/<step>.pkl
            "dropped_ahead": dropped_ahead,  # what samples them again is in DROPPED_AHEAD_DIR/<step>.pkl
        }
        start = time.perf_counter()
        self.checkpointer.save(step, state, metadata, force=force)
        if force or self.checkpointer.should_save(step):
            self.slowest_save_s = max(self.slowest_save_s, time.perf_counter() - start)
            self.saved_step = step

    def keep_last_step(self, abandoned: bool = False) -> None:
        """Checkpoints the last completed step when it is not yet and a SIGTERM came (any process's), so a stop
        loses at most the step under way; when the step under way trains on trees sampled ahead, with those trees
        beside it (as ``drain_and_save``). Called before a step's update (it donates that state) and, with
        ``abandoned``, when the grace ran out during the step before its update (one process only: the others
        may not have stopped where this one did, and a checkpoint is collective)."""
        completed, self._completed = self._completed, None
        if completed is None:
            return
        step, sampling, sampled = completed
        if abandoned:
            if not TERMINATION.requested or self.processes.multi:
                return
        elif not self.processes.reduce({"stop": float(TERMINATION.requested)})["stop"]:
            return
        with TERMINATION.grace(float("inf")):  # a second notice does not interrupt the checkpoint
            if sampled is None:
                self._write(step, sampling, force=True)
            else:  # as ``drain_and_save`` keeps them; the state from before any rollouts launched since
                self._keep_sampled_ahead(step, sampled, None)
                sampling = self._launched if self._launched is not None else self.sampler.state_dict()
                self._write(step, sampling, force=True, sampled_ahead=True)
            self.checkpointer.wait()
        self.console.info(f"SIGTERM: checkpointed the completed RL step {step}")

    def drain_and_save(self, abandon_after_s: float) -> bool:
        """A SIGTERM after a step that sampled the next one ahead (``rl.max_staleness >= 1``): waits for those
        rollouts until ``abandon_after_s`` seconds after the notice, then checkpoints this step with the sampling
        side's state after them and their trees beside it, so the rerun trains the next step on the very trees
        (exact). Returns False, having saved nothing, when they are not done in time on every process (then
        ``drop_and_save``)."""
        deadline = (TERMINATION.received_at or time.monotonic()) + abandon_after_s
        while not self.pipeline.ready and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.processes.reduce({"late": float(not self.pipeline.ready)})["late"]:
            return False
        kept = None
        if self.sampling_params is not None:  # recomputed behaviour log-probs: the trees' sampler goes with them
            if self.processes.multi:  # its params are sharded across processes; keep the last checkpoint instead
                return False
            kept = (self.sampling_params[0], jax.device_get(self.sampling_params[1]))
        sampled = self.pipeline.take(self.step + 1, self.engine_version)  # done: no wait
        self._keep_sampled_ahead(self.step, sampled, kept)
        self._write(self.step, self.sampler.state_dict(), force=True, sampled_ahead=True)
        self.checkpointer.wait()
        return True

    def _keep_sampled_ahead(self, step: int, sampled: Any, kept: Any) -> None:
        """Writes the trees step ``step + 1`` trains on (and the params that sampled them, or None) beside
        checkpoint ``step``, before the checkpoint that names them."""
        if self.processes.is_main:
            path = self.workdir / SAMPLED_AHEAD_DIR / f"{step}.pkl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(pickle.dumps((sampled, kept)))
        self.processes.barrier("sampled ahead: written")

    def drop_and_save(self) -> bool:
        """A SIGTERM after a step whose next step's rollouts, sampled ahead, were not done within the grace
        (``drain_and_save`` returned False): drops them without waiting, and checkpoints this step with the sampling
        side's state from before they began and, beside it, the weights that sample them (the engine's, policy
        version ``engine_version``: one behind the trainer's) with the behaviour params kept for them, so the rerun
        samples the next step again from that state with those weights: the very trees (exact). Returns False,
        having saved nothing, with several processes (a checkpoint is collective and the weights are sharded
        across them: the last checkpoint stays the resume point)."""
        launched, self._launched = self._launched, None
        self.pipeline.abandon()  # not waited for: the process ends next (``trace_jax.job.commands.train_and_exit``)
        if launched is None or self.processes.multi:
            return False
        kept = None
        if self.sampling_params is not None:  # recomputed behaviour log-probs: the same weights, in full precision
            kept = (self.sampling_params[0], jax.device_get(self.sampling_params[1]))
        path = self.workdir / DROPPED_AHEAD_DIR / f"{self.step}.pkl"
        path.parent.mkdir(parents=True, exist_ok=True)  # written before the checkpoint that names it
        path.write_bytes(pickle.dumps((self.engine_version, self.sampler.weights(), kept)))
        self._write(self.step, launched, force=True, dropped_ahead=True)
        self.checkpointer.wait()
        return True

    def resume(self) -> bool:
        # The scheduler state has data-dependent shapes (a replay buffer that grows): restore it as saved.
        policy = lora.trained_part(self.state.params)  # with adapters: those alone (the base is this run's start)
        target = {"params": policy, "train": self.state._replace(params=None), "scheduler": None}
        restored = self.checkpointer.restore_latest(target=target)
        if restored is None:
            return False
        meta = restored.metadata
        params = lora.with_trained_part(self.state.params, restored.state["params"])
        self.state = restored.state["train"]._replace(params=params)
        self.sampler.load_state_dict(
            {"scheduler": restored.state["scheduler"], "prompts": meta["prompts"], "runner": meta["runner"]}
        )
        self.eval_before, self.last_eval = meta.get("eval_before", []), meta.get("last_eval", [])
        self.timer.load_state_dict(meta.get("timings", {}))
        self.resumes = meta.get("resumes", 0) + 1
        self.step = self.saved_step = restored.step
        kept, engine = None, None
        if meta.get("sampled_ahead"):  # a SIGTERM's checkpoint: the next step trains on the trees it kept
            self._primed, kept = pickle.loads((self.workdir / SAMPLED_AHEAD_DIR / f"{self.step}.pkl").read_bytes())
        elif meta.get("dropped_ahead"):  # a SIGTERM's checkpoint: the next step samples its trees again, as before
            version, weights, kept = pickle.loads((self.workdir / DROPPED_AHEAD_DIR / f"{self.step}.pkl").read_bytes())
            engine = (version, weights)
        shardings = jax.tree.map(lambda array: array.sharding, self.state.params)
        if kept is not None:  # the params that sampled them, for their recomputed behaviour log-probs
            self.sampling_params = (kept[0], jax.device_put(kept[1], shardings))
        if engine is None:
            self._sync_weights()
        else:  # the engine's older weights, sent as a sync sends the trainer's (its dtypes and layout)
            version, weights = engine
            weights = jax.tree.map(lambda saved, own: np.asarray(saved, own.dtype), weights, self.state.params)
            self._set_engine_weights(jax.device_put(weights, shardings), version)
        return True

    def _sync_weights(self) -> float:
        """The trainer's policy (version ``self.step``) as the engine's weights, in its sampling layout on its
        devices; returns the seconds it took (transfer and reshard, waited for)."""
        return self._set_engine_weights(self.state.params, self.step)

    def _set_engine_weights(self, params: Any, version: int) -> float:
        """``params`` (policy ``version``, laid out as the trainer's) as the engine's weights; returns the seconds.
        Once the engine holds the policy, a LoRA policy's sync sends its adapters alone (the base is frozen)."""
        start = time.perf_counter()
        layout = self.sampler.layout
        sent = params if self.engine_version < 0 else lora.trained_part(params)
        self.sampler.set_weights(self.placement.to_engine(self.processes.engine_weights(sent, layout), layout))
        self.engine_version = version
        return time.perf_counter() - start

    def _sampled_by(self, version: int) -> Any:
        """The params of policy ``version`` for ``RLTrainer.prepare``: None when they are the trainer's own, else
        the copy kept when the engine started sampling ahead with them (handed over: the run keeps no reference)."""
        kept, self.sampling_params = self.sampling_params, None
        if version == self.step or not self.trainer.recomputes_behaviour:
            return None
        if kept is None or kept[0] != version:
            raise RuntimeError(f"trees of policy version {version} but no copy of its params was kept")
        return kept[1]

    def _engine_idle(self, phase: str) -> None:
        if self.pipeline.in_flight:
            raise RuntimeError(f"{phase} needs the engine, but rollouts sampled ahead are in flight")

    # ------------------------------------------------------------------------------------------- step
    def rl_step(self) -> dict[str, float]:
        """One RL update; returns its metrics (rollout, allocation, loss, timings). With ``rl.max_staleness >= 1``
        the next step's trees are sampled while this one trains (``trace_jax.cluster.pipeline``)."""

        start = time.perf_counter()
        step = self.step + 1
        if not self.pipeline.in_flight and self.saved_step != self.step:  # what a SIGTERM would checkpoint
            self._completed = (self.step, copy.deepcopy(self.sampler.state_dict()), None)
        if self._primed is not None:  # sampled ahead before a SIGTERM's checkpoint (``drain_and_save``)
            sampled, self._primed = self._primed, None
        else:
            ahead = self.pipeline.in_flight
            sampled = self.pipeline.take(step, self.engine_version)  # sampled ahead, or now
            self._launched = None
            # Trees of older weights: a SIGTERM checkpoints the completed step with them (their recomputed behaviour
            # log-probs would need the params that sampled them kept too: not then).
            if ahead and self.saved_step != self.step and not self.trainer.recomputes_behaviour:
                self._completed = (self.step, None, sampled)
        waited = time.perf_counter() - start
        sync_seconds = 0.0
        if self.engine_version != self.step:  # the engine sampled ahead with older weights; it is idle now
            sync_seconds += self._sync_weights()
        if self.pipeline.ahead(step):
            # Host work, before the sampling thread changes it: what a SIGTERM that drops these rollouts saves.
            self._launched = copy.deepcopy(self.sampler.state_dict())
            self.pipeline.launch(step + 1, self.engine_version)
        scheduled = sampled.result
        train_start = time.perf_counter()
        advantages = compute_advantages(self.config.rl.advantage, scheduled.trees)
        batch, info = build_batch(scheduled.trees, advantages, self.batch_config, self.trainer.loss_config)
        self.keep_last_step()  # a SIGTERM before this update: the completed step is checkpointed now
        # Behaviour log-probs under the weights that sampled the trees (kept when they were sampled ahead).
        batch = self.trainer.prepare(self.state, batch, behaviour_params=self._sampled_by(sampled.version))
        if self.pipeline.in_flight and self.trainer.recomputes_behaviour:  # the next trees' sampler: these params
            self.sampling_params = (self.step, jax.tree.map(jnp.copy, self.state.params))
        # Every process: all rows, its own fed.
        self.state, train_metrics = self.trainer.update(
            self.state, batch, info.path_tokens, info.skipped_denominator, already_prepared=True
        )
        train_end = time.perf_counter()
        version, self.step = self.step, step
        if not self.pipeline.in_flight:  # the new weights now; else once the engine is done sampling ahead
            sync_seconds += self._sync_weights()
        rewards = np.concatenate([tree.leaf_rewards() for tree in scheduled.trees])
        metrics = {f"alloc/{k}": v for k, v in scheduled.metrics.items()}
        metrics.update({f"train/{k}": v for k, v in train_metrics.items()})
        metrics.update(
            {
                "rollout/mean_reward": float(rewards.mean()),
                "rollout/leaves": float(rewards.size),
                # Held prefixes the KV pool gave back for room (each one continued costs a re-prefill).
                "rollout/evicted_holds": float(sampled.evicted_holds),
                "rollout/retrieval_failures": float(
                    sum(bool(node.info.get("retrieval_failed")) for tree in scheduled.trees for node in tree.nodes)
                ),
                "alloc/effective_ratio": figures.effective_ratio(scheduled.trees),
                "alloc/nonzero_adv_token_share": figures.nonzero_advantage_share(scheduled.trees)["tokens"],
                "batch/rows": float(info.num_rows),
                "batch/trained_tokens": float(info.num_trained_tokens),
                "batch/trees_skipped": float(info.num_trees_skipped),
                "time/rollout_s": sampled.seconds,
                "time/train_s": train_end - train_start,
                "time/weight_sync_s": sync_seconds,
                "time/step_s": time.perf_counter() - start,
            }
        )
        if self.pipeline.max_staleness:
            metrics.update(staleness(scheduled.trees, version))
            metrics["time/rollout_wait_s"] = waited
            # Seconds of this step's training during which the next step's rollouts ran.
            metrics["time/overlap_s"] = self.pipeline.busy_during(train_start, train_end)
        self.sampled_by_process = self.sampler.sampled_questions(scheduled.trees)
        return self.processes.reduce(metrics)

    def warm_up_predictor(self) -> dict[str, float]:
        """The scheduler's predictor warm-up on the next ``allocation.predictor_warmup_prompts`` prompts of the
        stream (before RL step 1; the stream moves past them). Its metrics, or {} when there is none."""

        start = time.perf_counter()
        self._engine_idle("the predictor warm-up")
        metrics = self.sampler.warm_up_predictor()
        if not metrics:
            return {}
        metrics["time/warmup_s"] = time.perf_counter() - start
        return self.processes.reduce(metrics)

    def evaluate(self, description: str, leave: bool = True) -> list[dict[str, Any]]:
        """Greedy EM/F1 rows (per hop group, then ``all``) on ``config.eval``'s questions, with a progress bar."""

        config = self.config
        self._engine_idle("an evaluation")
        tasks = self.world.world.questions(config.eval.split)
        if config.eval.num_questions < len(tasks):  # evenly spaced: the split is ordered by hops, keep every group
            picked = np.linspace(0, len(tasks) - 1, config.eval.num_questions).round().astype(int)
            tasks = [tasks[i] for i in picked]
        # A handful of chunks, each at least the engine's slot count: progress and ETA at little cost.
        chunk = max(config.engine.max_slots, math.ceil(len(tasks) / 4))
        with self.timer.phase("evaluation"):
            bar = self.console.progress(len(tasks), description, unit="question", leave=leave)
            try:
                return self.sampler.evaluate(tasks, chunk, progress=bar)  # questions split across processes
            finally:
                bar.close()

    def close(self, wait: bool = True) -> None:
        """Ends the rollouts sampled ahead (waited for, or ``wait=False``: left behind, the process ends next),
        the sampling side and the checkpointer."""
        try:
            self.pipeline.close(wait=wait)
            self.sampler.close(wait=wait)
        finally:
            self.checkpointer.close()

    # --------------------------------------------------------------------------------------- placement
    def _sampling_side(self) -> Any:
        """The sampling side: in this process (``SamplingSide``), or in one of its own on its own cores
        (``mesh.rollout_cpus``, ``SamplingProcess``)."""
        config = self.config
        cpus = config.mesh.rollout_cpus
        if cpus:
            return SamplingProcess(config, self.model_config, self.start.world_dir or self.start.directory, cpus)
        prompts = self.source.prompt_stream(config, self.world)
        mesh = self.placement.engine_mesh(self.processes.sampling_mesh(self.mesh))
        return SamplingSide(config, self.world, self.model_config, prompts, mesh, self.processes)
