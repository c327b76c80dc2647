"""The planner: XLA memory analysis of the real train step / engine, remat and vocabulary effects, the CLI."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import pytest

from trace_jax.models import ModelConfig, num_params
from trace_jax.parallel.mesh import make_mesh
from trace_jax.plan import compile as plan_compile
from trace_jax.plan.__main__ import build_parser, slots_per_chip
from trace_jax.plan.compile import generate_memory, update_programs
from trace_jax.plan.topology import GIB, parse_topology

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Narrow attention, wide MLP: the layers' activations, not one attention block, dominate the step.
FOUR_LAYERS = ModelConfig.preset(
    "qwen3-tiny",
    num_layers=4,
    hidden_size=128,
    intermediate_size=1024,
    num_heads=2,
    num_kv_heads=1,
    head_dim=32,
    vocab_size=256,
)


def _one_device():
    return make_mesh(devices=jax.devices()[:1])


def test_full_remat_keeps_at_most_a_third_of_the_temporaries():
    temps = {
        remat: update_programs(dataclasses.replace(FOUR_LAYERS, remat=remat), _one_device(), 1, 2048, 256).temporaries
        for remat in ("none", "full")
    }
    assert temps["full"] <= temps["none"] / 3, temps


def test_the_loss_path_does_not_grow_with_the_vocabulary_beyond_one_chunk():
    rows, seq, chunk = 1, 1024, 128
    small, large = 256, 4096
    reports = {
        v: update_programs(dataclasses.replace(FOUR_LAYERS, vocab_size=v), _one_device(), rows, seq, chunk)
        for v in (small, large)
    }
    grown = reports[large].temporaries - reports[small].temporaries
    params_grown = reports[large].by_kind["weights"] - reports[small].by_kind["weights"]
    full_logits = rows * seq * (large - small) * 4  # what one float32 [rows, T, V] would add
    one_chunk = rows * chunk * (large - small) * 4
    assert grown < full_logits / 4, (grown, full_logits)
    # Params-shaped temporaries (gradient accumulator, optimizer update) plus a few chunk-sized buffers.
    assert grown <= 4 * params_grown + 4 * one_chunk, (grown, params_grown, one_chunk)


def test_every_plan_option_has_help_text():
    actions = [a for a in build_parser()._actions if a.dest != "help"]
    assert any(a.dest == "depth_check" for a in actions)  # the premise: add_arguments' options are in it
    assert [a.option_strings for a in actions if not (a.help or "").strip()] == []


def test_topologies_count_chips_and_memory():
    v5p = parse_topology("v5p-64")
    assert (v5p.chips, v5p.memory_bytes) == (32, 95 * GIB)  # v5p names count TensorCores, 2 per chip
    assert parse_topology("v5e-64").chips == parse_topology("v5litepod-64").chips == 64
    assert parse_topology("v6e-64").memory_bytes == 32 * GIB
    with pytest.raises(ValueError, match="unknown topology 'tpu9-8'"):
        parse_topology("tpu9-8")
    with pytest.raises(ValueError, match="not a whole number of chips"):
        parse_topology("v5p-7")


def _plan(tmp_path, *extra, backend="cpu"):
    out = tmp_path / "plan.json"
    args = ["--model", "qwen3-tiny", "--topology", "v5p-16", "--rows", "16", "--seq-len", "256", "--slots", "16"]
    args += ["--backend", backend]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # the planner sets the fake device count itself
    done = subprocess.run(
        [sys.executable, "-m", "trace_jax.plan", *args, "--no-depth-check", "--json", str(out), *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout, json.loads(out.read_text())


@pytest.mark.slow
def test_the_planner_compiles_the_step_and_the_engine_and_picks_what_fits(tmp_path):
    stdout, plan = _plan(tmp_path)
    assert "XLA:CPU stand-ins" in stdout and "train: FITS" in stdout and "engine: FITS" in stdout
    assert plan["compiler"] == "cpu" and plan["train"]["fits"]["platform"] == "cpu"
    train, engine = plan["train"]["fits"], plan["engine"]["fits"]
    assert sum(train["mesh"].values()) and train["mesh"]["fsdp"] * train["mesh"]["tensor"] == 8
    assert train["per_device_gib"]["temporaries"] > 0 and engine["per_device_gib"]["kv_cache"] >= 0
    assert train["peak_gib"] <= plan["budget_gib"] and engine["peak_gib"] <= plan["budget_gib"]


@pytest.mark.slow
def test_the_planner_says_plainly_when_nothing_fits(tmp_path):
    stdout, plan = _plan(tmp_path, "--memory-gib", "0.001", "--prune", "1e9", "--max-compiles", "1")
    assert plan["train"]["fits"] is None and plan["train"]["tried"]
    assert "train: nothing fits" in stdout


# Layer weights and the KV pool of about the same size, so a float32 copy of either breaks the bound below.
DECODE_MODEL = dataclasses.replace(FOUR_LAYERS, dtype="bfloat16", param_dtype="bfloat16")


def test_the_decode_program_keeps_temporaries_under_half_its_weights_and_cache():
    """Fails if the KV pools go back to float storage (XLA:CPU then scatters each token into a float32 copy of the
    whole pool) or if the layer scan slices the weight stack dynamically on CPU (the float32 cast of every
    layer's weights is hoisted out of the decode loop): either adds about twice that array to the temporaries."""
    report = generate_memory(DECODE_MODEL, _one_device(), slots=8, max_len=512, steps_per_call=8)
    kinds = report.by_kind
    assert kinds["kv_cache"] > 0.3 * kinds["weights"]  # premise: the pool weighs as much as the layers
    assert report.temporaries <= 0.5 * (kinds["weights"] + kinds["kv_cache"]), (report.temporaries, kinds)


def test_slots_per_chip_solve_the_line_through_two_compiles_per_shard():
    """Fails if the slots are not divided by the shards that split them (data x fsdp) or the line is mis-solved."""
    one = {"mesh": {"data": 4, "fsdp": 2, "tensor": 1}, "settings": {"slots": 64, "max_len": 4096}, "peak_gib": 20.0}
    twice = {**one, "settings": {"slots": 128, "max_len": 4096}, "peak_gib": 24.0, "per_device_gib": {"temporaries": 1}}
    fit = slots_per_chip(one, twice, int(60 * GIB))
    # 8 -> 16 slots a chip add 4 GiB: 0.5 GiB a slot over 16 GiB fixed; (60 - 16) / 0.5 = 88.
    assert (fit["per_slot_gib"], fit["fixed_gib"], fit["fit"], fit["max_len"]) == (0.5, 16.0, 88, 4096)


def test_a_mixture_of_experts_plans_over_an_expert_axis_and_a_dense_model_does_not():
    """Fails if the candidate layouts lose the expert axis for a MoE (or grow one for a dense model), or if a
    candidate's batch rows do not split over (fsdp, expert) x micro-batches."""
    from trace_jax.plan.__main__ import _engine_candidates, _train_candidates

    moe, dense = ModelConfig.preset("qwen3-30b-a3b"), ModelConfig.preset("qwen3-8b")
    v5p = parse_topology("v5p-64")
    train = [c for c, _ in _train_candidates(moe, v5p, 256, 4096, 512)]
    assert {c["mesh"]["expert"] for c in train} == {1, 2, 4, 8, 16}
    assert train[0]["mesh"] == {"data": 1, "fsdp": 2, "expert": 16, "tensor": 1}  # most expert-parallel first
    for c in train:
        mesh = c["mesh"]
        assert mesh["fsdp"] * mesh["expert"] * mesh["tensor"] == v5p.chips
        assert 256 % (mesh["fsdp"] * mesh["expert"] * c["micro_batches"]) == 0
    assert all("expert" not in c["mesh"] for c, _ in _train_candidates(dense, v5p, 256, 4096, 512))
    assert {c["mesh"]["expert"] for c in _engine_candidates(v5p, 256, moe)} == {1, 2, 4, 8, 16}
    # MoE parameter counting: all experts are held, a token uses its top-k (the names' 30B and 3B).
    assert 30e9 < num_params(moe) < 31e9
    assert 3.0e9 < moe.active_params() < 3.5e9


@pytest.mark.slow
def test_the_planner_compiles_a_mixture_of_experts_on_an_expert_axis(tmp_path):
    """The real MoE train step and engine compile and fit on a mesh with an expert axis (4 experts, 8 chips)."""
    stdout, plan = _plan(tmp_path, "--model", "qwen3-moe-tiny")
    assert "train: FITS" in stdout and "engine: FITS" in stdout
    train, engine = plan["train"]["fits"], plan["engine"]["fits"]
    assert train["mesh"]["expert"] == 4 and train["mesh"]["fsdp"] * train["mesh"]["expert"] == 8
    assert engine["mesh"]["expert"] == 4
    assert plan["active_params"] < plan["params"]


@pytest.mark.slow
def test_the_update_and_the_engine_each_take_their_own_expert_dispatch(tmp_path):
    """``--expert-dispatch gather --engine-expert-dispatch all_to_all``: one plan whose engine is compiled with
    expert parallelism and whose update gathers the experts, each program's settings naming the dispatch of the
    config it was compiled from. Mutant caught: the engine compiled with the update's dispatch."""
    per_program = ("--expert-dispatch", "gather", "--engine-expert-dispatch", "all_to_all", "--no-slots-fit")
    _, plan = _plan(tmp_path, "--model", "qwen3-moe-tiny", *per_program)
    train, engine = plan["train"]["fits"], plan["engine"]["fits"]
    assert train["mesh"]["expert"] == engine["mesh"]["expert"] == 4  # premise: experts split in both programs
    assert engine["settings"]["expert_dispatch"] == "all_to_all"
    assert train["settings"]["expert_dispatch"] == "gather"


def test_the_moe_estimate_counts_the_dispatch_rows_and_the_gathered_experts():
    """Fails if the rough estimate drops a mixture of experts' terms (top-k copies of each token's row, one
    layer's experts gathered and kept for the backward pass): it then says ~104 GiB for a qwen3-30b-a3b
    candidate whose compiled step held 320.1 GiB of temporaries per chip (docs/log/benchmarks-2026-12-01-to-05.md,
    "Will it fit")."""
    from trace_jax.plan.__main__ import _activation_estimate, _moe_terms

    moe = ModelConfig.preset("qwen3-30b-a3b", dtype="bfloat16")
    assert _moe_terms(ModelConfig.preset("qwen3-8b"), 1, 2) == (0.0, 0.0)  # a dense model's estimate is unchanged
    rows = 256 // 32 // 4  # fsdp 2 x expert 16, 4 micro-batches
    none = _activation_estimate(moe, rows * 4096, 1, "none", rows, 512) / 2**30
    full = _activation_estimate(moe, rows * 4096, 1, "full", rows, 512) / 2**30
    assert 0.8 * 320.1 < none < 1.2 * 320.1
    assert full < none / 10  # full remat keeps no layer's experts


def test_the_all_to_all_estimate_trades_gathered_experts_for_dispatch_buffers():
    """qwen3-30b-a3b on fsdp 2 x expert 16: the all_to_all dispatch holds 1/16 of a layer's experts and a send
    and a receive buffer of 16 blocks of the device's top-k rows. Fails if the estimate still counts the
    gathered expert set, drops the buffers, or applies either where the expert axis is 1 (it runs as gather)."""
    from trace_jax.plan.__main__ import _activation_estimate, _moe_terms

    gather = ModelConfig.preset("qwen3-30b-a3b", dtype="bfloat16")
    a2a = ModelConfig.preset("qwen3-30b-a3b", dtype="bfloat16", expert_dispatch="all_to_all")
    rows_g, experts_g = _moe_terms(gather, 1, 2, 16)
    rows_a, experts_a = _moe_terms(a2a, 1, 2, 16)
    assert experts_a == experts_g / 16
    assert rows_a == rows_g * (1 + 2 * 16)
    assert _moe_terms(a2a, 1, 2, 1) == _moe_terms(gather, 1, 2, 1)
    rows = 256 // 32 // 4
    full_g, full_a = (_activation_estimate(c, rows * 4096, 1, "full", rows, 512, 16) for c in (gather, a2a))
    assert full_a > full_g  # full remat keeps no experts: only the buffers differ


@pytest.mark.slow
@pytest.mark.skipif(not plan_compile.libtpu_available(), reason="needs libtpu (the TPU compiler)")
def test_the_planner_compiles_with_the_tpu_compiler_and_predicts_times(tmp_path):
    """Fails if the planner falls back to XLA:CPU where libtpu is installed, loses the TPU figures' label, or
    stops predicting the update's and the decode's times from the compiled programs."""
    stdout, plan = _plan(tmp_path, backend="auto")
    assert plan["compiler"] == "tpu" and plan["topology"]["libtpu"] == "v5p:2x2x2"
    assert "TPU compiler (libtpu)" in stdout and "predicted times on v5p" in stdout
    assert plan["train"]["fits"]["platform"] == plan["engine"]["fits"]["platform"] == "tpu"
    timing = plan["timing"]
    assert timing["update"]["optimizer_step_s"] > 0 and 0 < timing["update"]["mfu"] < 1
    assert timing["decode"]["tokens_per_s"] > 0
    assert set(timing["rl_step"]["phases_s"]) == {"update", "prefill", "decode"}
