"""The sampling side of a run: the engine and its runners, the scheduler with its predictor, the prompt stream.

``Training`` (``trace_jax.job.training``) trains; a ``SamplingSide`` grows the trees it trains on. Everything the
sampling side does goes through the few calls below (weights in; a step's trees, the predictor's warm-up, an
evaluation and checkpoint state out), so it can live in the trainer's process (this class, the default) or in a
process of its own (``trace_jax.job.sampling_process``, ``mesh.rollout_cpus``) without the loop telling the
difference.
"""

from __future__ import annotations

import time
from typing import Any

import jax
from jax.sharding import Mesh

from trace_jax.cluster.pipeline import Sampled
from trace_jax.cluster.processes import Processes
from trace_jax.configs import RunConfig
from trace_jax.job import build
from trace_jax.job.evaluate import evaluate
from trace_jax.models import ModelConfig
from trace_jax.rollout.tree import RolloutTree


class SamplingSide:
    """One engine (its own sampling-layout copy of the weights) serving both the rollouts and the evaluation.

    Args:
      config: the run's config.
      world: the run's ``build.World`` (questions, tokenizer, environment).
      model_config: the policy's architecture.
      prompts: the training prompt stream (``next_batch``, ``state_dict``, ``load_state_dict``).
      mesh: the devices the engine decodes on.
      processes: the job's JAX processes: with several, each samples the trees it owns (all hold every tree).
    """

    def __init__(
        self,
        config: RunConfig,
        world: build.World,
        model_config: ModelConfig,
        prompts: Any,
        mesh: Mesh,
        processes: Processes,
    ):
        self.config, self.world, self.prompts, self.processes = config, world, prompts, processes
        engine = build.build_engine(config, model_config, mesh=mesh)
        self.runner = build.build_runner(config, model_config, None, world, seed=config.seed, engine=engine)
        self.eval_runner = build.build_runner(config, model_config, None, world, greedy=True, engine=engine)
        # Each process samples the trees it owns; all hold every tree, so the allocation is the same everywhere.
        self.rollouts = processes.backend(self.runner)
        self.scheduler = build.build_scheduler(config, self.rollouts)

    @property
    def layout(self) -> Any:
        """The engine's ``SamplingLayout``: where and how its weights live."""
        return self.runner.engine.layout

    def set_weights(self, weights: Any) -> None:
        """The engine's new weights (the trainer's policy), waited for."""
        self.runner.set_params(weights)
        self.eval_runner.set_params(weights)  # the same engine: free
        jax.block_until_ready(self.runner.engine.params)

    def weights(self) -> Any:
        """A host copy of the engine's weights (its sampling copy, cast to ``engine.weight_dtype``); read while
        rollouts are in flight too (sampling never replaces them)."""
        return jax.device_get(self.runner.engine.params)

    def drop_held(self) -> None:
        """Each phase that grows trees (a step, the warm-up, an evaluation) starts from an engine that holds
        nothing: prefix pages held for the previous phase's trees would decide, through the pool's evictions,
        which later histories are prefilled whole and which continue a hold (different programs, different
        rounding), and a resumed run never saw those trees."""
        self.runner.drop_held()
        self.eval_runner.drop_held()

    def sample(self, step: int, version: int) -> Sampled:
        """Step ``step``'s trees, grown by the scheduler with the engine's weights (policy ``version``)."""
        started = time.perf_counter()
        self.drop_held()
        evicted = self.runner.evicted_holds
        trees = self._roots(self.prompts.next_batch())
        scheduled = self.scheduler.run(trees, batch_size=self.config.rl.prompts_per_step)
        for tree in scheduled.trees:
            tree.policy_version = version
        evicted = self.runner.evicted_holds - evicted
        return Sampled(step, version, scheduled, evicted, started, time.perf_counter())

    def _roots(self, tasks: list[Any]) -> list[RolloutTree]:
        """One unsampled tree per task, numbered by its position (the sharded backend's owner key)."""
        return [RolloutTree(self.world.env.prompt_ids(task), task, i) for i, task in enumerate(tasks)]

    def warm_up_predictor(self) -> dict[str, float]:
        """The scheduler's predictor warm-up on the next ``allocation.predictor_warmup_prompts`` prompts of the
        stream (the stream moves past them): its metrics, or {} when there is none."""
        wanted = self.scheduler.config.predictor_warmup_prompts
        if not wanted:
            return {}
        self.drop_held()
        tasks: list[Any] = []
        while len(tasks) < wanted:
            tasks += self.prompts.next_batch()
        trees = self._roots(tasks[:wanted])
        metrics = {f"alloc/warmup/{k}": v for k, v in self.scheduler.warm_up(trees).items()}
        self.processes.sampled_questions(self.rollouts, trees)  # the warm-up's, so step 1 reports only its own
        return metrics

    def evaluate(self, tasks: list[Any], chunk_size: int, progress: Any = None) -> list[dict[str, Any]]:
        """Greedy EM/F1 rows (per group, then ``all``) on ``tasks``, split across processes."""
        self.drop_held()
        backend = self.processes.backend(self.eval_runner)
        return evaluate(backend, self.world.env, tasks, samples=1, progress=progress, chunk_size=chunk_size).rows

    def sampled_questions(self, trees: list[RolloutTree]) -> list[list[str]]:
        """Per process, the questions of ``trees`` it sampled itself (``Processes.sampled_questions``)."""
        return self.processes.sampled_questions(self.rollouts, trees)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the sampling side: ``scheduler`` (an array pytree, saved in the orbax
        state), ``prompts`` and ``runner`` (JSON metadata)."""
        return {
            "scheduler": self.scheduler.state_dict(),
            "prompts": self.prompts.state_dict(),
            "runner": self.runner.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.prompts.load_state_dict(state["prompts"])
        self.runner.load_state_dict(state["runner"])

    def describe(self) -> dict[str, Any]:
        """Facts for a run's summary: none beyond the placement's (it samples in the trainer's process)."""
        return {}

    def close(self, wait: bool = True) -> None:
        """Nothing to release in this process (a ``SamplingProcess`` ends its child here)."""
