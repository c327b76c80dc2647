"""The RL update compiled by the TPU compiler for two v5p slices joined over DCN (``2 x v5p:2x2x1``, libtpu's
abstract devices): the only traffic between slices is the gradient reduction, once per optimizer step. Skips
without libtpu, as ``test_tpu_compile.py`` does."""

import gzip

import pytest

from tests.plan.test_tpu_compile import SLICE, TINY
from trace_jax.parallel.mesh import make_mesh
from trace_jax.plan import compile as plan_compile
from trace_jax.plan.dcn import dcn_traffic

pytestmark = pytest.mark.skipif(
    not plan_compile.libtpu_available(), reason='needs libtpu: pip install "jax[tpu]==<the installed jax version>"'
)


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
