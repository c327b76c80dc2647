"""The split of devices into sampling and training (``parallel.mesh.split_devices``), the split of a CPU host's
cores between a sampling process and the trainer (``trace_jax.job.sampling_process``) and the checks that refuse
impossible splits (``configs.validate``)."""

import pathlib

import pytest

from trace_jax.configs import MeshConfig, RLConfig, RunConfig
from trace_jax.configs.validate import check_mesh, check_sampling_process
from trace_jax.job.cli import ConfigError
from trace_jax.job.sampling_process import split_cpus
from trace_jax.parallel.mesh import split_devices


def test_split_devices_keeps_at_least_one_device_to_train():
    """Fails if the split takes sampling devices from the back or lets sampling take every device."""
    devices = ["d0", "d1", "d2"]
    assert split_devices(devices, 0) == ([], devices)
    assert split_devices(devices, 1) == (["d0"], ["d1", "d2"])
    for bad in (-1, 3):
        with pytest.raises(ValueError, match="at least one device must train"):
            split_devices(devices, bad)


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
