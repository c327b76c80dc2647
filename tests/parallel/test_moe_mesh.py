"""Expert parallelism: the tiny MoE on 2x2x2 fake-CPU-device meshes with an expert axis equals one device."""

import json

import jax
import pytest

from tests.helpers import run_with_fake_devices
from trace_jax.parallel import mesh as mesh_lib


@pytest.fixture(scope="module")
def eight_device_run():
    done = run_with_fake_devices("tests.parallel.moe_mesh_check", timeout=600)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_expert_sharded_forward_equals_one_device(eight_device_run):
    """Catches a wrong expert slice per device, a lost (token, expert) pair across shards, or mixed-up rows."""
    assert len(eight_device_run) == 6
    for name, result in eight_device_run.items():
        assert result["max_diff"] < 1e-4, name


def test_expert_weights_are_split_over_the_expert_axis(eight_device_run):
    # gate_proj [layers=2, experts=4, embed=64, mlp=32]: experts over "expert", embed over fsdp, mlp over tensor.
    assert eight_device_run["grouped/data-fsdp-expert"]["gate_proj_spec"] == "P(None, 'expert', 'fsdp', None)"
    assert eight_device_run["grouped/data-fsdp-expert"]["gate_proj_shard_shape"] == [2, 2, 32, 32]
    assert eight_device_run["grouped/fsdp-expert-tensor"]["gate_proj_shard_shape"] == [2, 2, 32, 16]


def test_optimizer_state_is_sharded_like_the_params(eight_device_run):
    """Adam keeps two moments per parameter: on every 2x2x2 mesh a device holds at most 2.1x its parameter
    bytes of optimizer state (fails if a moment, e.g. of the expert weights, is replicated instead)."""
    for name, result in eight_device_run.items():
        params, opt = result["param_bytes_per_device"], result["optimizer_bytes_per_device"]
        assert params < 0.75 * result["param_bytes_total"], name  # premise: the params themselves are split
        assert opt <= 2.1 * params, (name, opt, params)


def test_expert_axis_defaults_to_one_and_is_in_the_rules_table():
    mesh = mesh_lib.make_mesh(devices=jax.devices()[:1])
    assert mesh.shape["expert"] == 1 and mesh_lib.LOGICAL_AXIS_RULES["expert"] == "expert"
    assert "expert" in mesh_lib.LOGICAL_AXIS_RULES["batch"]
