"""Sampling one RL step ahead of the trainer (``rl.max_staleness >= 1``): one-step-off-policy rollouts.

With ``max_staleness = 0`` a step samples its trees with the policy it then updates, and nothing overlaps.
With ``k >= 1``, while the trainer updates θ_{t-1} -> θ_t at step t, a background thread samples step t + 1's
trees with the weights the engine holds, θ_{t-1}: the trainer of step t + 1 (θ_t) trains on trees one version
old. The lag is bounded by 1 whatever k >= 1 allows, because one engine samples one step at a time and the
trainer never runs two steps ahead of it. Each tree records the policy version it was sampled under
(``RolloutTree.policy_version``); the PPO ratio corrects the lag because the behaviour log-probs are the
sampler's own, or, when the trainer recomputes them (``ppo.behaviour_logprobs`` "recompute" / "untruncated"),
computed under a copy of θ_{t-1} that the job keeps while the engine samples with it (one more copy of the
params on the training devices, at k >= 1 in those modes only; ``trace_jax.job.training``). Inside a sampled
step nothing changes: the scheduler's stage 2 waits for its own stage 1, and the predictor learns from the
trees as they finish, all on the sampling thread (the trainer never touches them).

Determinism. Which steps sample ahead is a function of the step number alone (:meth:`RolloutPipeline.ahead`),
so a run is reproducible and its schedule does not depend on the load: a step that ends at a checkpoint, an
evaluation or the run's last step does not sample ahead, and the step after it samples with the newest policy.
Checkpoints therefore never hold work in flight (the prompt stream, seeds and scheduler state they save are
exactly those of the steps done), and a resume is exact. A SIGTERM after a step that sampled ahead waits for
those rollouts within the grace (:attr:`RolloutPipeline.ready`), then checkpoints the step with the sampling
side's state after them and their trees beside it, which the rerun's next step trains on
(``trace_jax.job.training.Training.drain_and_save``): exact, and the completed step is kept. Rollouts not done in
time are dropped without waiting for them (:meth:`RolloutPipeline.abandon`; the process ends at once,
``os._exit``), and the step is checkpointed with the sampling side's state from before they began (the job keeps a
host copy of it at each launch) and the weights that sample them, the engine's, one version behind the trainer's:
the rerun samples the next step's trees again from there, the very trees (``Training.drop_and_save``; one process:
with several, the last checkpoint stays the resume point). A step abandoned after it took trees sampled ahead keeps
the step before it, with those trees beside its checkpoint (``Training.keep_last_step``), except where the trainer
recomputes the behaviour log-probs: the params that sampled those trees are no longer kept by then, so that step is
lost unless it was checkpointed.

Timeline. The pipeline records when its background rollouts ran; :meth:`RolloutPipeline.busy_during` is how long
they ran inside an interval (the trainer's), from which a step logs its overlap. The trainer's intervals come in
time order, so a rollout that ended before one of them starts can overlap none of the later ones: each query
forgets those, and the record stays a rollout or two long however long the run.

JAX releases the GIL inside compiled calls, so the thread's decode programs run while the main thread's
update does; on disjoint devices (``mesh.rollout_devices``) they do not compete for device memory either. With
the sampling side in a process of its own (``mesh.rollout_cpus``, ``trace_jax.job.sampling_process``) the thread
only waits for that process's answer, and the decode runs on its cores.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


@dataclasses.dataclass
class Sampled:
    """One step's sampled trees. ``result``: the scheduler's ``ScheduleResult``; ``version``: the policy version
    (RL updates behind the weights) they were sampled with; ``started`` / ``ended``: ``time.perf_counter``."""

    step: int
    version: int
    result: Any
    evicted_holds: int
    started: float
    ended: float

    @property
    def seconds(self) -> float:
        return self.ended - self.started


class RolloutPipeline:
    """A step's rollouts, sampled now or one step ahead on a background thread.

    Args:
      sample: ``sample(step, version) -> Sampled``: samples step ``step``'s trees with the engine's weights,
        which are policy version ``version``.
      max_staleness: ``rl.max_staleness`` (0: never ahead).
      boundary: ``boundary(step)``: whether step ``step`` ends where nothing may be in flight (a checkpoint, an
        evaluation, the last step).
      clock: seconds, for the timeline (``time.perf_counter``; a test's clock).
    """

    def __init__(
        self,
        sample: Callable[[int, int], Sampled],
        max_staleness: int,
        boundary: Callable[[int], bool],
        clock: Callable[[], float] = time.perf_counter,
    ):
        self._sample = sample
        self.max_staleness = max_staleness
        self._boundary = boundary
        self._clock = clock
        self._executor: ThreadPoolExecutor | None = None
        self._ahead: Future | None = None
        self._ahead_step = 0
        self._lock = threading.Lock()
        self._intervals: list[tuple[float, float]] = []  # background rollouts: (start, end)
        self._running_since: float | None = None

    @property
    def in_flight(self) -> bool:
        return self._ahead is not None

    @property
    def ready(self) -> bool:
        """Whether rollouts sampled ahead are in flight and done (``take`` returns them without waiting)."""
        return self._ahead is not None and self._ahead.done()

    def ahead(self, step: int) -> bool:
        """Whether step ``step`` samples step ``step + 1``'s trees while it trains."""
        return self.max_staleness >= 1 and not self._boundary(step)

    def take(self, step: int, version: int) -> Sampled:
        """Step ``step``'s trees: the ones sampled ahead for it (waiting for them), else sampled now (this thread)
        with the engine's weights (policy version ``version``)."""
        if self._ahead is not None:
            if self._ahead_step != step:
                raise RuntimeError(f"rollouts sampled ahead for step {self._ahead_step}, asked for step {step}")
            future, self._ahead = self._ahead, None
            return future.result()
        return self._sample(step, version)

    def launch(self, step: int, version: int) -> None:
        """Starts sampling step ``step``'s trees in the background with the engine's weights (``version``)."""
        if self._ahead is not None:
            raise RuntimeError(f"step {self._ahead_step}'s rollouts are still in flight")
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollouts-ahead")
        self._ahead_step = step
        self._ahead = self._executor.submit(self._timed, step, version)

    def _timed(self, step: int, version: int) -> Sampled:
        with self._lock:
            self._running_since = self._clock()
        try:
            return self._sample(step, version)
        finally:
            with self._lock:
                self._intervals.append((self._running_since, self._clock()))
                self._running_since = None

    def abandon(self) -> None:
        """Drops the rollouts in flight (if any) without waiting for them: a stop whose process ends next and
        saves nothing they changed. They may run on until the process ends (a thread cannot be stopped)."""
        self._ahead = None

    def busy_during(self, start: float, end: float) -> float:
        """Seconds within [start, end] during which background rollouts ran. Intervals are asked in time order
        (each ``start`` at or after the previous one's): the rollouts that ended before ``start`` are forgotten."""
        with self._lock:
            self._intervals = [(a, b) for a, b in self._intervals if b >= start]
            spans = list(self._intervals)
            if self._running_since is not None:
                spans.append((self._running_since, end))
        return sum(max(0.0, min(end, b) - max(start, a)) for a, b in spans)

    def close(self, wait: bool = True) -> None:
        """Ends the thread. ``wait``: first waits for what is in flight (dropped, its error too: the run is
        ending); else leaves it running (the process is about to end: :meth:`abandon`)."""
        if self._ahead is not None and wait:
            self._ahead.exception()
        self._ahead = None
        if self._executor is not None:
            self._executor.shutdown(wait=wait, cancel_futures=True)
            self._executor = None
