"""The main job's view of its JAX processes: what ``Training`` asks when the run spans several hosts.

One object, ``Processes``, so the trainer-side code reads the same with one process or many:

- ``is_main``: only process 0 writes logs, plots, summaries and the tokenizer (others wait at ``barrier``);
- ``sampling_mesh`` / ``engine_weights``: every process decodes on its *own* devices with its own full copy of
  the policy (``multihost.copy_to_each_process``), so sampling never waits on another host;
- ``backend``: the rollout backend under which each process samples the trees it owns
  (``sharded_rollouts.ProcessShardedBackend``) while every process keeps every tree;
- ``reduce``: the step's scalar metrics made identical on every process.

How the method's whole-batch decisions stay global: every process runs the same scheduler on the same trees
(all-gathered turn by turn), so stage 1 (across prompts), the stage-2 budget and the predictor's training
anchors are *decomposed exactly*: no float is all-gathered for a decision, the inputs are, and each process
computes the same decision from them. The train batch is built on every process from those same trees, and
each process hands the mesh only the rows its own devices hold (``multihost.rows_to_global``).

With one process every method is a cheap pass-through, so the one-process run is unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import jax
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from trace_jax.cluster.sharded_rollouts import ProcessShardedBackend
from trace_jax.parallel import multihost
from trace_jax.rollout.tree import RolloutTree

T = TypeVar("T")


class Processes:
    """This process's place in the job (``jax.process_index`` of ``jax.process_count``)."""

    def __init__(self) -> None:
        self.index = jax.process_index()
        self.count = jax.process_count()

    @property
    def multi(self) -> bool:
        return self.count > 1

    @property
    def is_main(self) -> bool:
        """Process 0: the one that writes files other than checkpoints (orbax writes those collectively)."""
        return self.index == 0

    def barrier(self, name: str) -> None:
        """Every process waits here until all have arrived (e.g. until process 0 wrote a file all read)."""
        if self.multi:
            multihost_utils.sync_global_devices(name)

    def sampling_mesh(self, train_mesh: Mesh) -> Mesh:
        """The mesh the engine decodes on: the training mesh with one process; else this process's devices,
        split over ``tensor`` as in training (when they can be) and over ``fsdp`` for slots."""
        if not self.multi:
            return train_mesh
        tensor = train_mesh.shape["tensor"]
        local = jax.local_device_count()
        return multihost.local_mesh(data=1, fsdp=-1, tensor=tensor if local % tensor == 0 else 1)

    def engine_weights(self, params: Any, layout: Any) -> Any:
        """``params`` as the engine on ``layout`` (a ``SamplingLayout`` over ``sampling_mesh``) can take them.

        One process: unchanged (the engine reshards them itself). Several: each process receives a full copy
        laid out in the sampling layout on its own devices (collective: every process calls it each update).
        """
        if not self.multi:
            return params
        return multihost.copy_to_each_process(params, layout.mesh, layout.param_shardings(params))

    def backend(self, inner: Any) -> Any:
        """``inner`` (a runner) wrapped so this process samples only the trees it owns; unchanged with one."""
        return ProcessShardedBackend(inner) if self.multi else inner

    def reduce(self, metrics: Mapping[str, float]) -> dict[str, float]:
        """The step's scalars, the same on every process (collective).

        Metrics computed from the trees or the trainer are already equal everywhere (every process holds
        every tree and the replicated train metrics): ``max`` returns them bit for bit. Wall-clock figures
        (``time/...``) differ per process: ``max`` is the slowest process, which the step waits for.
        """
        if not self.multi:
            return dict(metrics)
        return multihost.reduce_metrics(metrics, default="max")

    def from_main(self, value: T) -> T:
        """Process 0's ``value`` on every process (collective; pickled)."""
        return multihost.exchange(value)[0] if self.multi else value

    def sampled_questions(self, backend: Any, trees: Sequence[RolloutTree]) -> list[list[str]]:
        """Per process, the questions (task ``id``, else prompt index) whose rollouts it sampled itself since
        the last call, as every process sees it (collective). One process: all of ``trees``.

        ``trees`` are the ones sampled since the last call, found by ``prompt_index`` (with prompt selection a
        step's trees are some of its candidates, so an index is not a position in ``trees``). A candidate sampled
        but not in ``trees`` (a dropped prompt's first-search probe, ``allocation.select_on``) is not listed.
        """

        def name(tree: Any) -> str:
            return str(tree.task.get("id", tree.prompt_index) if isinstance(tree.task, dict) else tree.prompt_index)

        if not self.multi:
            return [[name(tree) for tree in trees]]
        by_index = {tree.prompt_index: tree for tree in trees}
        mine = [name(by_index[index]) for index in backend.take_sampled() if index in by_index]
        return multihost.exchange(mine)

    def describe(self) -> dict[str, Any]:
        """Facts for a run's summary."""
        return {"processes": self.count, "devices": jax.device_count(), "local_devices": jax.local_device_count()}
