"""The RL update compiled by the TPU compiler for two v5p slices joined over DCN (``2 x v5p:2x2x1``, libtpu's
abstract devices): the only traffic between slices is the gradient reduction, once per optimizer step; each
process's engine and the weight copy to it stay within a slice. Skips without libtpu, as ``test_tpu_compile.py``
does."""

import dataclasses
import gzip

import jax
import pytest
from jax.sharding import NamedSharding

from tests.plan.test_tpu_compile import SLICE, TINY
from trace_jax.parallel import multihost, slices
from trace_jax.parallel.mesh import make_mesh
from trace_jax.plan import compile as plan_compile
from trace_jax.plan.dcn import dcn_traffic
from trace_jax.rollout.engine.layout import SamplingLayout

pytestmark = pytest.mark.skipif(
    not plan_compile.libtpu_available(), reason='needs libtpu: pip install "jax[tpu]==<the installed jax version>"'
)
ENGINE = dataclasses.replace(TINY, param_dtype="bfloat16")  # the engine's weights


@pytest.fixture(scope="module")
def two_slices(tmp_path_factory):
    """The update's programs (zero, accumulate, apply) for 2 slices x fsdp 4, each program's DCN traffic, and the
    bytes of one device's gradient shard."""
    devices = plan_compile.target_devices(SLICE, slices=2)
    assert sorted({d.slice_index for d in devices}) == [0, 1] and len(devices) == 8  # premise: two slices
    mesh = make_mesh(fsdp=4, slices=2, devices=devices)
    hlo_dir = tmp_path_factory.mktemp("hlo")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plan_compile, "HLO_DIR", str(hlo_dir))
        report = plan_compile.update_programs(TINY, mesh, micro_rows=8, seq_len=128, rows=16)
    traffic = {}
    for path in hlo_dir.iterdir():
        with gzip.open(path, "rt") as f:
            traffic[path.name.split("_")[0]] = dcn_traffic(f.read(), devices=8, slices=2)
    return traffic, report.by_kind["gradients"]


def test_micro_batches_accumulate_within_their_slice(two_slices):
    traffic, _ = two_slices
    assert set(traffic) == {"zero", "accumulate", "apply"}
    assert traffic["accumulate"].count == 0, traffic["accumulate"].as_dict()
    assert traffic["zero"].count == 0, traffic["zero"].as_dict()


def test_the_optimizer_step_reduces_the_gradient_over_dcn_once(two_slices):
    traffic, gradient_bytes = two_slices
    apply = traffic["apply"]
    assert set(apply.by_kind) == {"ALL_REDUCE"}, apply.as_dict()
    # One reduction of each device's f32 gradient shard (the params are bf16-free f32 here): the same bytes,
    # give or take the small replicated norms that no fsdp shard splits.
    assert 0.8 * gradient_bytes <= apply.bytes <= 1.05 * gradient_bytes, (apply.bytes, gradient_bytes)


@pytest.fixture(scope="module")
def slice_devices():
    devices = plan_compile.target_devices(SLICE, slices=2)
    assert slices.process_slices(devices) == {0: 0, 1: 1}  # premise: v5p-8 is one host, so a process is a slice
    return devices


def _megascale_transfers(text: str) -> int:
    return text.count("_xla_megascale_transfer_type")


def test_each_process_engine_decodes_within_its_slice(slice_devices, tmp_path):
    """The engine each process samples on (``Processes.sampling_mesh``: ``multihost.local_mesh``) lies in the
    process's slice, and is compiled with no transfer over DCN (process 0's: libtpu refuses a program on the
    second slice's devices alone, "Slice is empty")."""
    meshes = [multihost.local_mesh(devices=slice_devices, process=p) for p in (0, 1)]
    assert [{slices.slice_of(d) for d in mesh.devices.flat} for mesh in meshes] == [{0}, {1}]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plan_compile, "HLO_DIR", str(tmp_path))
        report = plan_compile.generate_memory(ENGINE, meshes[0], slots=16, max_len=256, steps_per_call=8)
    assert report.error is None and report.hlo["collectives"], report.hlo  # premise: the decode has collectives
    (path,) = tmp_path.iterdir()
    with gzip.open(path, "rt") as f:
        assert _megascale_transfers(f.read()) == 0


def test_weights_reach_each_engine_without_crossing_slices(slice_devices):
    """The weight copy to every process's engine (``multihost.copy_to_each_process``: the trainer's params, fsdp
    within each slice, resharded onto ``process_copies``) compiled by the TPU compiler: nothing crosses DCN."""
    train = make_mesh(fsdp=4, slices=2, devices=slice_devices)
    _, params = plan_compile.abstract_params(ENGINE, train)
    engine_mesh = multihost.local_mesh(data=1, fsdp=-1, tensor=1, devices=slice_devices, process=0)
    copies = multihost.process_copies(engine_mesh, devices=slice_devices, process=0)
    assert copies.shape["process"] == 2  # premise: one copy on each slice's host
    targets = jax.tree.map(lambda s: NamedSharding(copies, s.spec), SamplingLayout(engine_mesh).param_shardings(params))
    text = jax.jit(lambda p: p, out_shardings=targets).lower(params).compile().as_text()
    assert "all-gather" in text  # premise: each copy gathers the fsdp shards
    assert _megascale_transfers(text) == 0
