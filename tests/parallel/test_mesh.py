"""Meshes and shardings: a 2x2x2 (data, fsdp, tensor) forward on 8 fake CPU devices equals one device."""

import json
import os
import subprocess
import sys
import types

import jax
import pytest
from jax.sharding import PartitionSpec

from tests.helpers import build_hf_checkpoint, fake_cpu_devices
from trace_jax.parallel import mesh as mesh_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def eight_device_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    build_hf_checkpoint(path, "qwen3", tie_word_embeddings=False)
    env = dict(os.environ, XLA_FLAGS=fake_cpu_devices(8), JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, "-m", "tests.parallel.mesh_check", str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_sharded_forward_equals_single_device(eight_device_run):
    assert eight_device_run["max_diff"] <= 1e-5


def test_parameters_are_partitioned_by_the_rules_table(eight_device_run):
    specs = eight_device_run["specs"]
    # Stacked layers: the leading "layers" axis is never split.
    assert specs["layers.attn.q_proj"] == str(PartitionSpec(None, "fsdp", "tensor", None))
    assert specs["layers.attn.o_proj"] == str(PartitionSpec(None, "tensor", None, "fsdp"))
    assert specs["layers.mlp.down_proj"] == str(PartitionSpec(None, "tensor", "fsdp"))
    assert specs["lm_head"] == str(PartitionSpec("fsdp", "tensor"))
    assert specs["embed"] == str(PartitionSpec("tensor", "fsdp"))
    # 2 layers x hidden 64 x mlp 96 split over fsdp=2 and tensor=2: each device holds a quarter of each layer.
    assert eight_device_run["up_proj_shard_shape"] == [2, 32, 48]


def test_random_init_is_born_sharded(eight_device_run):
    assert eight_device_run["random_up_proj_spec"] == str(PartitionSpec(None, "fsdp", "tensor"))


def test_logical_rules_skip_axes_that_do_not_divide():
    mesh = mesh_lib.make_mesh(devices=jax.devices()[:1])
    assert mesh.shape == {"slice": 1, "data": 1, "fsdp": 1, "expert": 1, "tensor": 1}
    assert mesh_lib.logical_to_spec(("embed", "mlp"), mesh) == PartitionSpec(None, None)


def test_slices_group_devices_by_slice_index_and_refuse_a_mixed_slice():
    # Devices listed interleaved: slice i of the mesh must hold exactly the devices whose slice_index is i.
    fake = lambda i, s: types.SimpleNamespace(id=i, slice_index=s, process_index=0)
    devices = [fake(0, 0), fake(1, 1), fake(2, 0), fake(3, 1)]
    ordered = mesh_lib._slice_ordered(devices, slices=2)
    assert [d.slice_index for d in ordered] == [0, 0, 1, 1] and [d.id for d in ordered] == [0, 2, 1, 3]
    with pytest.raises(ValueError, match="mix slice_index"):
        mesh_lib._slice_ordered([*devices, fake(4, 2), fake(5, 2)], slices=2)  # 3 slices' devices in 2 groups


def test_only_the_batch_shards_across_slices():
    mesh = mesh_lib.make_mesh(fsdp=1, devices=jax.devices()[:1])
    assert mesh_lib.LOGICAL_AXIS_RULES["batch"][0] == mesh_lib.SLICE_AXIS
    others = [rule for name, rule in mesh_lib.LOGICAL_AXIS_RULES.items() if name != "batch" and rule]
    assert all(mesh_lib.SLICE_AXIS not in ((r,) if isinstance(r, str) else r) for r in others), others
    assert mesh.axis_names[0] == mesh_lib.SLICE_AXIS


def test_bad_mesh_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="needs 8 devices"):
        mesh_lib.make_mesh(data=2, fsdp=2, tensor=2, devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="at most one may be -1"):
        mesh_lib.make_mesh(data=-1, fsdp=-1)
    with pytest.raises(ValueError, match="no rule"):
        mesh_lib.logical_to_spec(("embedding",), mesh_lib.make_mesh(devices=jax.devices()[:1]))
