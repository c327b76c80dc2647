"""Sampling ahead of the trainer (``trace_jax.cluster.pipeline``) and the default placement of sampling and
training (``trace_jax.cluster.placement``)."""

import threading
import time

import jax
import pytest

from trace_jax.cluster.pipeline import RolloutPipeline, Sampled
from trace_jax.cluster.placement import Placement
from trace_jax.configs import MeshConfig


class Recorder:
    """A ``sample`` function that records the thread and arguments of each call (and can be held running)."""

    def __init__(self, hold: threading.Event | None = None):
        self.calls: list[tuple[int, int, str]] = []
        self.hold = hold
        self.running = threading.Event()

    def __call__(self, step: int, version: int) -> Sampled:
        self.running.set()
        if self.hold is not None:
            assert self.hold.wait(30)
        self.calls.append((step, version, threading.current_thread().name))
        return Sampled(step, version, f"trees of step {step}", 0, 0.0, 0.0)


def test_without_staleness_every_step_samples_now_in_the_calling_thread():
    """Fails if k = 0 samples ahead anywhere or samples off the main thread (today's run, exactly)."""
    sample = Recorder()
    pipeline = RolloutPipeline(sample, max_staleness=0, boundary=lambda step: False)
    assert not any(pipeline.ahead(step) for step in range(1, 10))
    got = pipeline.take(1, version=0)
    assert got.result == "trees of step 1" and not pipeline.in_flight
    assert sample.calls == [(1, 0, threading.current_thread().name)]


def test_sampling_ahead_runs_on_another_thread_and_hands_its_trees_to_the_next_step():
    """Fails if the launched rollouts run on the caller's thread (no overlap), if ``take`` samples again
    instead of returning them, or if the version they were sampled with is lost."""
    hold = threading.Event()
    sample = Recorder(hold)
    pipeline = RolloutPipeline(sample, max_staleness=1, boundary=lambda step: step % 2 == 0)
    assert pipeline.ahead(1) and not pipeline.ahead(2)  # step 2 ends at a boundary
    pipeline.launch(2, version=0)
    assert sample.running.wait(30) and pipeline.in_flight
    with pytest.raises(RuntimeError, match="still in flight"):
        pipeline.launch(3, version=0)
    with pytest.raises(RuntimeError, match="for step 2, asked for step 3"):
        pipeline.take(3, version=1)
    hold.set()
    got = pipeline.take(2, version=1)
    assert (got.step, got.version, got.result) == (2, 0, "trees of step 2")
    assert len(sample.calls) == 1 and sample.calls[0][2] != threading.current_thread().name
    assert not pipeline.in_flight
    pipeline.close()


def test_abandoned_rollouts_are_dropped_without_waiting_for_them():
    """A stop on a SIGTERM: ``abandon`` and ``close(wait=False)`` return while the rollouts still run. Fails if
    either waits for them (the rollouts are held until both returned; a wait would outlast the hold's 30 s and
    find the thread ended)."""
    hold = threading.Event()
    sample = Recorder(hold)
    pipeline = RolloutPipeline(sample, max_staleness=1, boundary=lambda step: False)
    pipeline.launch(2, version=0)
    assert sample.running.wait(30) and pipeline.in_flight
    pipeline.abandon()
    assert not pipeline.in_flight
    pipeline.close(wait=False)
    alive = [t for t in threading.enumerate() if t.name.startswith("rollouts-ahead") and t.is_alive()]
    assert alive and sample.calls == []  # the rollouts still run, held: nothing waited for them
    hold.set()
    alive[0].join(30)


def test_busy_during_counts_the_background_rollouts_inside_an_interval():
    """Fails if a running rollout (no end yet) or a finished one is left out of the overlap."""
    hold = threading.Event()
    sample = Recorder(hold)
    pipeline = RolloutPipeline(sample, max_staleness=1, boundary=lambda step: False)
    assert pipeline.busy_during(0.0, 1e12) == 0.0
    pipeline.launch(2, version=0)
    assert sample.running.wait(30)
    now = time.perf_counter()
    assert pipeline.busy_during(now - 1e6, now) > 0.0  # running: counted up to the interval's end
    hold.set()
    pipeline.take(2, version=1)
    assert pipeline.busy_during(now - 1e6, time.perf_counter()) > 0.0
    assert pipeline.busy_during(-2.0, -1.0) == 0.0  # an interval before it ran
    pipeline.close()


class Clock:
    """A clock that a test sets (``now``) and a ``sample`` function that moves it: each rollout runs from the
    time it is launched at to ``ends[step]``."""

    def __init__(self, ends: dict[int, float]):
        self.now = 0.0
        self.ends = ends

    def __call__(self) -> float:
        return self.now

    def sample(self, step: int, version: int) -> Sampled:
        self.now = self.ends[step]
        return Sampled(step, version, None, 0, 0.0, 0.0)


def test_busy_during_forgets_only_the_rollouts_that_no_later_interval_can_overlap():
    """Rollouts at [0, 10] and [11, 30]; trainer intervals [5, 12], [8, 40], [35, 50] in time order. Fails if a
    query forgets a rollout that a later interval still overlaps (forgetting those that ended before the query's
    end, not its start, loses [0, 10] from [8, 40]: 19 s instead of 21) or if nothing is ever forgotten."""
    clock = Clock({2: 10.0, 3: 30.0})
    pipeline = RolloutPipeline(clock.sample, max_staleness=1, boundary=lambda step: False, clock=clock)
    for step, launched in ((2, 0.0), (3, 11.0)):
        clock.now = launched
        pipeline.launch(step, version=step - 2)
        pipeline.take(step, version=step - 1)
    assert pipeline._intervals == [(0.0, 10.0), (11.0, 30.0)]  # premise: both rollouts are on the record
    assert pipeline.busy_during(5.0, 12.0) == 5.0 + 1.0
    assert pipeline.busy_during(8.0, 40.0) == 2.0 + 19.0
    assert pipeline.busy_during(35.0, 50.0) == 0.0
    assert pipeline._intervals == []  # both ended before 35: no later interval can overlap them
    pipeline.close()


def test_colocated_placement_is_the_training_mesh_and_leaves_weights_alone():
    """Fails if the default placement moves the weights or builds a separate engine mesh."""
    placement = Placement.of(MeshConfig(data=1, fsdp=-1, tensor=1))
    assert not placement.apart
    assert placement.train_mesh.devices.size == jax.device_count()
    colocated = object()
    assert placement.engine_mesh(colocated) is colocated
    weights = {"w": 1}
    assert placement.to_engine(weights, layout=None) is weights
