"""The RL update's programs, the engine's decode and a mixture of experts compiled by the TPU compiler for a
v5p slice (``v5p:2x2x1``, 4 chips) on this host: libtpu's abstract devices, no TPU. CI installs libtpu at
the project's jax version; without it these tests skip (and say why)."""

import dataclasses
import gzip
import math
import re

import pytest

from trace_jax.models import ModelConfig
from trace_jax.parallel.mesh import make_mesh
from trace_jax.plan import compile as plan_compile
from trace_jax.plan.topology import GIB, parse_topology

pytestmark = pytest.mark.skipif(
    not plan_compile.libtpu_available(), reason='needs libtpu: pip install "jax[tpu]==<the installed jax version>"'
)

# TPU-shaped tiny Qwen3: head_dim 128 (the kernels' block rule), 2 layers.
TINY = ModelConfig.preset(
    "qwen3-tiny",
    num_layers=2,
    hidden_size=256,
    intermediate_size=512,
    num_heads=4,
    num_kv_heads=2,
    head_dim=128,
    vocab_size=1024,
    dtype="bfloat16",
)
MOE = ModelConfig.preset(
    "qwen3-moe-tiny", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=128, vocab_size=1024
)
SLICE = parse_topology("v5p:2x2x1")


def _tpu_mesh(**axes):
    devices = plan_compile.target_devices(SLICE)
    assert {d.platform for d in devices} == {"tpu"} and len(devices) == 4  # premise: abstract TPU devices
    return make_mesh(**axes, devices=devices)


# Rows of 384 tokens (3 kernel tiles), a length no weight has: an f32 [.., q, 384] array can only be scores.
SEQ = 384
SCORES = re.compile(rf"f32\[[\d,]*?(\d+),{SEQ}\]")


@pytest.fixture(scope="module")
def compiled_update(tmp_path_factory):
    """The update's programs compiled for v5p:2x2x1 on fsdp=4, and the folder their HLO texts were written to."""
    hlo_dir = tmp_path_factory.mktemp("hlo")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plan_compile, "HLO_DIR", str(hlo_dir))
        report = plan_compile.update_programs(TINY, _tpu_mesh(fsdp=4), micro_rows=8, seq_len=SEQ, rows=16)
    return report, hlo_dir


@pytest.fixture(scope="module")
def update_report(compiled_update):
    return compiled_update[0]


def _scores_bytes(layers: int) -> int:
    """float32 S x S attention scores of the accumulate step's rows on one device (8 rows over fsdp=4)."""
    return 8 // 4 * TINY.num_heads * SEQ * SEQ * 4 * layers


def test_the_update_programs_compile_for_a_v5p_slice_within_a_memory_bound(update_report):
    """Fails if ``RLTrainer.lower_update`` stops being the update's three programs, if any of them no longer
    compiles for TPU on fsdp=4 (weights all-gathered), or if the accumulate step's temporaries pass the
    reference path's bound: full float32 [rows, seq, vocab] logits plus six S x S float32 arrays a layer
    (scores, probabilities, mask and their gradients); a mutant that keeps every layer's attention
    intermediates twice, or the logits of every position at once beside them, breaks it."""
    report = update_report.as_dict()
    assert report["platform"] == "tpu" and set(report["programs"]) == {"zero", "accumulate", "apply"}
    full_logits = 8 // 4 * SEQ * TINY.vocab_size * 4
    temporaries = report["programs"]["accumulate"]["temporaries_gib"] * GIB
    assert 0 < temporaries < full_logits + 6 * _scores_bytes(TINY.num_layers), temporaries
    hlo = report["programs"]["accumulate"]["hlo"]
    assert hlo["collectives"].get("all-gather", {}).get("count", 0) > 0
    assert hlo["flops"] > 0 and hlo["unknown_loops"] == 0


def test_the_update_calls_a_mosaic_attention_kernel_and_writes_no_scores(compiled_update):
    """Fails while the training step compiled for a TPU slice calls the reference attention instead of a
    Mosaic kernel (``tpu_custom_call``), or any of its programs holds a float32 block of attention scores
    ([.., >= 128 queries, 384 keys]: what the reference attention writes). Mutant: the kernel chosen by the
    host's backend (cpu here), which gives the reference path and its score blocks."""
    report, hlo_dir = compiled_update
    assert report.programs["accumulate"]["hlo"]["kernels"], "no tpu_custom_call in the accumulate program"
    texts = [gzip.decompress(path.read_bytes()).decode() for path in sorted(hlo_dir.glob("*.hlo.txt.gz"))]
    assert len(texts) >= 3 and any("tpu_custom_call" in text for text in texts)  # premise: the programs' HLO
    blocks = [int(m) for text in texts for m in SCORES.findall(text) if int(m) >= 128]
    assert not blocks, "attention scores reached HBM"


def _expert_weight_products(text: str, experts: int, dims: tuple[int, int]) -> dict[str, list[str]]:
    """Instructions of an HLO text whose output is an [experts, d, f] or [experts, f, d] array (an expert weight's
    shape), by kind: ``mosaic`` (Mosaic kernel calls) and ``contraction`` (dot or convolution)."""
    d, f = dims
    found: dict[str, list[str]] = {"mosaic": [], "contraction": []}
    for line in text.splitlines():
        shape = re.search(r"= \w+\[(\d+),(\d+),(\d+)\]\S* (\S+)\(", line)
        if shape is None or int(shape.group(1)) != experts or {int(shape.group(2)), int(shape.group(3))} != {d, f}:
            continue
        if 'custom_call_target="tpu_custom_call"' in line:
            found["mosaic"].append(line.strip()[:160])
        elif shape.group(4) in ("dot", "convolution"):
            found["contraction"].append(line.strip()[:160])
    return found


def _interleaved_expert_sets(text: str, elements: int) -> list[str]:
    """Instructions writing a whole expert weight (``elements`` values) as an array of rank 5 or more: the
    gathered set in the stored layout's order (expert shard, fsdp shard, the shard's experts, its embed rows,
    width), which the compiler copies into ``[E, d, f]`` order for the grouped matmul."""
    found = []
    for line in text.splitlines():
        shape = re.search(r"= \w+\[([\d,]+)\]\S* (copy|fusion)\(", line)
        if shape and len(dims := [int(n) for n in shape.group(1).split(",")]) >= 5 and math.prod(dims) == elements:
            found.append(line.strip()[:160])
    return found


def test_a_mixture_of_experts_update_compiles_for_tpu_on_an_expert_axis(tmp_path, monkeypatch):
    """Fails if the expert-parallel dispatch or the grouped matmul stops compiling for TPU with the experts split
    over ``expert``=2 (x fsdp=2), for either dispatch; the all_to_all dispatch must move rows with an all-to-all
    collective (the mutant: experts gathered instead). In both, the experts' weight gradients must come from
    a grouped Mosaic kernel (``tgmm``, an [experts, d, f] output) and no dot or convolution may produce an
    [experts, d, f] array: the mutant, ``jax.lax.ragged_dot`` differentiated as is on TPU, gives its weight
    gradient as a dense contraction of every expert over all (token, expert) rows under a group mask. The
    gather dispatch must gather whole experts (``expert_dispatch._split_by_expert``), so no copy puts a gathered
    set in order."""
    mesh = _tpu_mesh(fsdp=2, expert=2)
    dims = (MOE.hidden_size, MOE.moe_intermediate_size)
    for dispatch, local_experts in (("gather", MOE.num_experts), ("all_to_all", MOE.num_experts // 2)):
        config = dataclasses.replace(MOE, expert_dispatch=dispatch, dtype="bfloat16")
        monkeypatch.setattr(plan_compile, "HLO_DIR", str(tmp_path / dispatch))
        report = plan_compile.update_programs(config, mesh, micro_rows=4, seq_len=256)
        assert report.platform == "tpu"
        hlo = report.programs["accumulate"]["hlo"]
        if dispatch == "all_to_all":
            assert hlo["collectives"].get("all-to-all", {}).get("count", 0) > 0, hlo["collectives"]
        (path,) = (tmp_path / dispatch).glob("accumulate_*.hlo.txt.gz")
        text = gzip.decompress(path.read_bytes()).decode()
        assert "ragged-dot" in str(hlo["kernels"]), hlo["kernels"]  # premise: the grouped forward, on TPU
        products = _expert_weight_products(text, local_experts, dims)
        assert not products["contraction"], (dispatch, products["contraction"])
        assert len(products["mosaic"]) >= 3, (dispatch, products)  # gate, up and down projections' gradients
        if dispatch == "gather":  # mutant: ``_split_by_expert`` returning the weights as stored (4 such)
            assert not _interleaved_expert_sets(text, MOE.num_experts * math.prod(dims))


ENGINE_AXES = pytest.mark.parametrize("axes", [{"data": 4}, {"data": 2, "tensor": 2}], ids=["data4", "data2xtensor2"])


def _decode_report(axes):
    config = dataclasses.replace(TINY, param_dtype="bfloat16")
    return plan_compile.generate_memory(config, _tpu_mesh(**axes), slots=8, max_len=512, steps_per_call=4)


@ENGINE_AXES
def test_the_engine_decode_compiles_for_a_v5p_slice(axes):
    """Fails if ``Engine.generate`` no longer compiles for TPU on the sampling layout, if its decode loop's
    trip counts cannot be read (the step-time model would count one step), or if its temporaries reach twice
    its weights and KV pool: a float32 copy of both (the mutant: float32 pools or weights cast per step)."""
    report = _decode_report(axes)
    kinds = report.by_kind
    assert report.platform == "tpu" and report.hlo["flops"] > 0
    assert 4 in report.hlo["loop_trip_counts"] and report.hlo["unknown_loops"] == 0, report.hlo["loop_trip_counts"]
    assert report.temporaries < 2 * (kinds["weights"] + kinds["kv_cache"]), (report.temporaries, kinds)


@ENGINE_AXES
def test_the_engine_decode_calls_the_paged_attention_kernel_on_tpu(axes):
    """Fails while the decode program compiled for a TPU slice carries no Mosaic kernel (``tpu_custom_call``):
    the kernel chosen by the host's backend instead of the target's."""
    assert _decode_report(axes).hlo["kernels"], "no tpu_custom_call in the decode program"
