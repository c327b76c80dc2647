"""Sampling ahead of the trainer (``trace_jax.cluster.pipeline``), the split of devices into sampling and training
(``trace_jax.cluster.placement``, ``parallel.mesh.split_devices``), the split of a CPU host's cores between a sampling
process and the trainer (``trace_jax.job.sampling_process``) and the checks that refuse impossible splits."""

import pathlib
import threading
import time

import jax
import pytest

from trace_jax.cluster.pipeline import RolloutPipeline, Sampled
from trace_jax.cluster.placement import Placement
from trace_jax.configs import MeshConfig, RLConfig, RunConfig
from trace_jax.configs.validate import check_mesh, check_sampling_process
from trace_jax.job.cli import ConfigError
from trace_jax.job.sampling_process import split_cpus
from trace_jax.parallel.mesh import split_devices


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


def test_split_devices_keeps_at_least_one_device_to_train():
    """Fails if the split takes sampling devices from the back or lets sampling take every device."""
    devices = ["d0", "d1", "d2"]
    assert split_devices(devices, 0) == ([], devices)
    assert split_devices(devices, 1) == (["d0"], ["d1", "d2"])
    for bad in (-1, 3):
        with pytest.raises(ValueError, match="at least one device must train"):
            split_devices(devices, bad)


def test_colocated_placement_is_the_training_mesh_and_leaves_weights_alone():
    """Fails if the default placement moves the weights or builds a separate engine mesh."""
    placement = Placement.of(MeshConfig(data=1, fsdp=-1, tensor=1))
    assert not placement.apart
    assert placement.train_mesh.devices.size == jax.device_count()
    colocated = object()
    assert placement.engine_mesh(colocated) is colocated
    weights = {"w": 1}
    assert placement.to_engine(weights, layout=None) is weights


def _config(rollout_devices, staleness=0, rollout_cpus=0, **axes):
    mesh = MeshConfig(**{"rollout_devices": rollout_devices, "rollout_cpus": rollout_cpus, **axes})
    return RunConfig(mesh=mesh, rl=RLConfig(max_staleness=staleness))


@pytest.mark.parametrize(
    "config, devices, processes, fragment",
    [
        (_config(2), 2, 1, "rollout_devices=2 leaves no device to train"),
        (_config(1, data=2, fsdp=1), 2, 1, "does not fit the 1 training device(s) (2 minus mesh.rollout_devices=1)"),
        (_config(1), 4, 2, "config.mesh.rollout_devices=1 needs one JAX process"),
        (_config(0, staleness=1), 4, 2, "config.rl.max_staleness=1 needs one JAX process"),
        (_config(0, rollout_cpus=1), 4, 2, "config.mesh.rollout_cpus=1 needs one JAX process"),
    ],
)
def test_impossible_splits_are_config_errors(config, devices, processes, fragment):
    """Fails if a split that leaves nothing to train, axes that count the sampling devices, or a split or
    sampling ahead with several processes get past the check."""
    with pytest.raises(ConfigError) as error:
        check_mesh(config, devices, processes)
    assert fragment in str(error.value)


def test_possible_splits_pass():
    check_mesh(_config(1), 2)
    check_mesh(_config(1, data=3, fsdp=1), 4)
    check_mesh(_config(0, staleness=2), 1)


def test_the_sampling_process_gets_the_last_cores_and_the_trainer_the_rest():
    """Fails if the two sides share a core, if one is left none, or if a count that leaves the trainer nothing
    is accepted."""
    assert split_cpus(1, [0, 1]) == ([1], [0])
    assert split_cpus(2, [4, 0, 2, 6]) == ([4, 6], [0, 2])
    for impossible in (0, 2, 3):
        with pytest.raises(ValueError, match="must leave the trainer a core"):
            split_cpus(impossible, [0, 1])


@pytest.mark.parametrize(
    "config, platform, cores, fragment",
    [
        (_config(0, rollout_cpus=1), "tpu", 8, "is for CPU hosts, and this backend is tpu"),
        (_config(1, rollout_cpus=1), "cpu", 2, "and mesh.rollout_devices exclude each other"),
        (_config(0, rollout_cpus=2), "cpu", 2, "leaves no core to train: this process may use 2; allowed 1 to 1"),
    ],
)
def test_a_sampling_process_that_cannot_run_here_is_a_config_error(config, platform, cores, fragment):
    """Fails if sampling in a process of its own gets past the check on an accelerator, beside apart devices,
    with a recipe whose world the child cannot rebuild, or with no core left to train."""
    with pytest.raises(ConfigError) as error:
        check_sampling_process(config, platform, cores)
    assert fragment in str(error.value)


def test_a_sampling_process_is_the_synthetic_recipes_alone():
    """Fails if a search_r1 config (whose world the child could not rebuild) may set mesh.rollout_cpus."""
    from trace_jax.configs import load_config_file
    from trace_jax.configs.validate import problems

    config = load_config_file(f"{pathlib.Path(__file__).resolve().parents[2]}/configs/search_r1.py:tiny")
    assert problems(config) == []  # premise: the recipe is fine without it
    config.mesh.rollout_cpus = 1
    assert problems(config) == [
        "config.mesh.rollout_cpus=1 is read only by the synthetic recipe; this run's recipe.kind='search_r1' does "
        "not read it: leave it out"
    ]


def test_a_sampling_process_that_can_run_here_passes():
    check_sampling_process(_config(0, rollout_cpus=1), "cpu", 2)
    check_sampling_process(_config(1), "tpu", 8)  # no sampling process: nothing to check
