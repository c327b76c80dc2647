"""The update's windowed matmuls (``UpdateConfig.windowed_einsum``): what the TPU compiler does with the key, and
how ``python -m trace_jax.plan --windowed-einsum auto`` picks between the two compiles. TPU compiler (libtpu's
abstract devices), no TPU; skipped without libtpu."""

import json

import pytest

from trace_jax.models import ModelConfig
from trace_jax.parallel.mesh import make_mesh
from trace_jax.plan import compile as plan_compile
from trace_jax.plan.__main__ import Planner, build_parser
from trace_jax.plan.topology import parse_topology
from trace_jax.rl.trainer import WINDOWED_EINSUM_FLAGS, UpdateConfig

pytestmark = pytest.mark.skipif(
    not plan_compile.libtpu_available(), reason='needs libtpu: pip install "jax[tpu]==<the installed jax version>"'
)


def test_the_compiler_options_switch_windowing_off_on_tpu_only():
    """Fails if the key is read the wrong way round, or if the TPU flags reach another compiler (XLA:CPU
    refuses flags it does not know)."""
    assert UpdateConfig().compiler_options("tpu") is None  # the compiler's default
    assert UpdateConfig(windowed_einsum=False).compiler_options("tpu") == dict.fromkeys(WINDOWED_EINSUM_FLAGS, False)
    assert UpdateConfig(windowed_einsum=False).compiler_options("cpu") is None


def test_the_update_compiles_without_windowed_matmuls_when_the_key_is_off(tmp_path, monkeypatch):
    """One Qwen3-8B-shaped layer (a small vocabulary), fsdp over the 32 chips of v5p-64, one 512-token row a
    chip: the TPU compiler windows its all-gathered matmuls by default (loops of collective-permutes, partial
    sums in HBM). Fails if ``windowed_einsum=False`` does not reach the update's compile (the trainer's jit
    without the options: the same windowed program), or if the two programs' kept HLO texts share a name
    (``remake --recount`` would not know which one the plan chose)."""
    monkeypatch.setattr(plan_compile, "HLO_DIR", str(tmp_path))
    config = ModelConfig.preset("qwen3-8b", num_layers=1, vocab_size=1024, remat="none")
    mesh = make_mesh(fsdp=32, devices=plan_compile.target_devices(parse_topology("v5p-64")))
    hlo = {}
    for windowed in (True, False):
        update = UpdateConfig(windowed_einsum=windowed)
        report = plan_compile.update_programs(config, mesh, micro_rows=32, seq_len=512, rows=32, update=update)
        assert report.settings["windowed_einsum"] is windowed
        hlo[windowed] = report.programs["accumulate"]["hlo"]
    assert hlo[True]["collectives"]["collective-permute"]["count"] > 100  # premise: the default windows
    assert "collective-permute" not in hlo[False]["collectives"]
    assert hlo[False]["flops"] == hlo[True]["flops"]  # the same matmuls
    assert hlo[False]["bytes_accessed"] < hlo[True]["bytes_accessed"]
    assert len(list(tmp_path.glob("accumulate_*"))) == len(list(tmp_path.glob("accumulate-unwindowed_*"))) == 1


def _report(windowed: bool, seconds: float, peak_gib: float) -> dict:
    """A compiled update's report (``MemoryReport.as_dict``) whose accumulate call takes ``seconds`` on v5p."""
    return {
        "program": "update",
        "mesh": {"data": 1, "fsdp": 4, "expert": 1, "tensor": 1},
        "settings": {"micro_rows": 4, "micro_batches": 1, "remat": "none", "windowed_einsum": windowed},
        "per_device_gib": {"temporaries": peak_gib},
        "peak_gib": peak_gib,
        "platform": "tpu",
        "compile_seconds": 1.0,
        "programs": {"accumulate": {"hlo": {"flops": seconds * 459e12, "bytes_accessed": 0, "wire_bytes": 0}}},
    }


@pytest.mark.parametrize(
    "unwindowed_seconds, unwindowed_peak, picked",
    [(0.5, 10.0, False), (2.0, 10.0, True), (0.5, 1000.0, True)],
    ids=["faster-and-fits", "slower", "faster-but-too-big"],
)
def test_auto_keeps_the_unwindowed_compile_only_when_it_is_faster_and_fits(unwindowed_seconds, unwindowed_peak, picked):
    """The planner's ``auto`` with stand-in compiles of the chosen layout (1.0 s an accumulate call windowed):
    fails if it keeps the second compile whatever its time, or one that does not fit the chip."""
    topology = parse_topology("v5p-8")
    args = build_parser().parse_args(["--model", "qwen3-tiny", "--topology", "v5p-8", "--windowed-einsum", "auto"])
    planner = Planner(args, topology.chips, topology)
    assert planner.backend == "tpu"  # premise: auto only acts on the TPU compiler's programs
    stand_in = {False: _report(False, unwindowed_seconds, unwindowed_peak)}
    planner._report = lambda key, build: stand_in[json.loads(key)[-1]]
    chosen = {**_report(True, 1.0, 10.0), "fits": True}
    out = {"fits": chosen, "tried": [chosen]}
    candidate = {"remat": "none", "micro_batches": 1, "mesh": chosen["mesh"]}
    kept = planner._faster_unwindowed(topology, 90 * 2**30, candidate, out)
    assert kept["settings"]["windowed_einsum"] is picked
    assert [t["settings"]["windowed_einsum"] for t in out["tried"]] == [True, False]  # both on record
