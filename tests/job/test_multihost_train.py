"""The main job as 2 JAX processes x 2 fake CPU devices on 127.0.0.1 (explicit coordinator, gloo collectives),
against the same config as 1 process x 4 devices.

What a user running on a pod relies on: both processes finish; they split each step's prompts; one set of
logs (metrics.jsonl, TensorBoard, train.log, summary) comes out; the checkpoint both wrote resumes in a rerun;
and the run computes what the one-process run computes. Every process holds every tree (all-gathered turn by
turn) and samples each continuation with the seed the one-process run gives it, so the sampled tokens, rewards,
trees, allocation and train batch are identical (asserted exactly).

Not bit-exact, and why: each process decodes on its own 2 devices, the one-process engine on 4, so a
continuation sits in another slot of another batch layout, and XLA:CPU's kernels round the log-probs and hidden
states they return differently in the last bits (two one-process runs differing only in ``engine.max_slots`` show
the same). Those floats are the PPO behaviour log-probs and the predictor's features, so the train metrics and the
final parameters differ at float32 rounding level: measured 1.3e-7 at most on weights of magnitude up to 1.5
(about 1 ulp), 2e-4 of the last update's size. The bounds below are 10x that; the predictor's AUC, a rank
statistic, can flip on a near-tie and gets a looser one.
"""

import json
import os
import pathlib
import socket
import subprocess
import time

import jax
import numpy as np
import pytest

from tests.helpers import TINY_MAIN_JOB, fake_cpu_devices, main_job_command
from trace_jax.checkpoint.state import StateCheckpointer

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = [
    *TINY_MAIN_JOB,
    "--config.rl.checkpoint_every=1",
    "--config.rl.keep_checkpoints=3",
]
TIMEOUT = 1500


def _env(devices: int) -> dict[str, str]:
    return dict(
        os.environ,
        XLA_FLAGS=fake_cpu_devices(devices),
        JAX_PLATFORMS="cpu",
        JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
    )


def _command(workdir, cache, steps, *extra):
    return main_job_command(workdir, cache, [f"--config.rl.steps={steps}", *TINY, *extra])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_one_process(workdir, cache, steps):
    return subprocess.Popen(
        _command(workdir, cache, steps),
        cwd=ROOT,
        env=_env(4),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc, what):
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"{what}: {stderr[-4000:]}"
    return stdout, stderr


def run_two_processes(workdir, cache, steps, *extra):
    """Both processes of one job (``extra``: more command-line flags); their (stdout, stderr) in process order."""
    port = _free_port()
    distributed = [
        "--config.distributed.mode=explicit",
        f"--config.distributed.coordinator_address=127.0.0.1:{port}",
        "--config.distributed.num_processes=2",
    ]
    procs = [
        subprocess.Popen(
            _command(workdir, cache, steps, *distributed, *extra, f"--config.distributed.process_id={pid}"),
            cwd=ROOT,
            env=_env(2),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in (0, 1)
    ]
    try:
        return [finish(proc, f"process {pid}") for pid, proc in enumerate(procs)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def params_at(workdir, step=None):
    checkpointer = StateCheckpointer(workdir / "checkpoints")
    restored = (
        checkpointer.restore_latest(keys=["params"]) if step is None else checkpointer.restore(step, keys=["params"])
    )
    return restored.step, [np.asarray(x) for x in jax.tree.leaves(restored.state["params"])]


def records(workdir, timings=False):
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if timings or "time/" not in k} for line in lines]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 1-process run, which trains the warm start both use; once it is in the cache, the 2-process run of
    the same config alongside it (so the two start from the very same policy)."""
    cache = tmp_path_factory.mktemp("warm_start_cache")
    one, two = tmp_path_factory.mktemp("one_process"), tmp_path_factory.mktemp("two_processes")
    single = start_one_process(one, cache, steps=2)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not list(cache.glob("*/warm_start.json")) and single.poll() is None and time.monotonic() < deadline:
            time.sleep(2)
        outputs = run_two_processes(two, cache, steps=2)
    finally:
        finish(single, "the 1-process run")
    # Read now: the resume test below extends this run (and prunes old checkpoints).
    snapshot = {
        "params": params_at(two),
        "warm": params_at(two, 0),
        "summary": json.loads((two / "summary.json").read_text()),
        "records": records(two, timings=True),
    }
    return {"one": one, "two": two, "cache": cache, "outputs": outputs, **snapshot}


def test_both_processes_finish_and_only_process_0_writes_the_logs(runs):
    two = runs["two"]
    (out0, _err0), (out1, _err1) = runs["outputs"]
    assert "EM after RL" in out0 and "EM after RL" in out1  # both finished and print process 0's summary
    steps = [r["step"] for r in runs["records"]]
    assert steps == [0, 1, 2]  # one metrics.jsonl, each step once (a second writer would repeat them)
    assert len(list((two / "tensorboard").glob("events.out.tfevents.*"))) == 1
    assert (two / "train.log").read_text().count("start:") == 1
    assert runs["summary"]["steps"] == 2 and runs["summary"]["run"]["processes"]["processes"] == 2
    for name in ("config.json", "eval_before.json", "plots/reward.png"):
        assert (two / name).is_file()


def test_the_two_processes_sampled_different_prompts(runs):
    sampled = runs["summary"]["run"]["processes"]["last_step_questions"]
    assert len(sampled) == 2 and sampled[0] and sampled[1]
    assert not set(sampled[0]) & set(sampled[1])
    assert len(sampled[0]) + len(sampled[1]) == 4  # the step's prompts, split


def test_the_run_equals_the_one_process_run(runs):
    one = runs["one"]
    warm_step, warm = runs["warm"]
    step, two_params = runs["params"]
    one_step, one_params = params_at(one)
    assert warm_step == 0 and step == one_step == 2
    assert any(not np.array_equal(a, b) for a, b in zip(warm, two_params, strict=True))  # premise: it trained
    # Same sampled tokens, trees, allocation and batch: these figures match exactly.
    two_records = [{k: v for k, v in r.items() if "time/" not in k} for r in runs["records"]]
    one_records = records(one)
    float_level = ("train/", "alloc/predictor/")  # from the engine's log-probs and features (see the docstring)
    exact = lambda rs: [{k: v for k, v in r.items() if not k.startswith(float_level)} for r in rs]
    assert exact(two_records) == exact(one_records)
    assert any("alloc/budget/rollouts" in r for r in two_records)  # premise: the exact part covers the steps
    for mine, theirs in zip(two_records, one_records, strict=True):
        assert mine.keys() == theirs.keys()
        for key in mine:
            if key.startswith(float_level):
                rtol = 1e-2 if key.endswith("auc") else 1e-4
                # The behaviour gap is a mean |log-prob difference| of ~1e-2: the layouts' rounding of each
                # log-prob (~1e-6) is its own size, not a fraction of it (1.7e-6 measured on one CPU).
                atol = 5e-6 if "behaviour_gap" in key else 1e-6
                assert mine[key] == pytest.approx(theirs[key], rel=rtol, abs=atol), key
    updates = [np.abs(a - w).max() for a, w in zip(one_params, warm, strict=True)]
    for a, b, update in zip(one_params, two_params, updates, strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=min(1.5e-6, 2e-3 * update))


def test_a_checkpoint_written_by_both_processes_resumes_in_a_rerun(runs):
    two = runs["two"]
    (_out0, err0), _ = run_two_processes(two, runs["cache"], steps=3)
    summary = json.loads((two / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["run"]["resumes"] == 1
    assert "resuming at RL step 2" in err0
    assert [r["step"] for r in records(two)] == [0, 1, 2, 3]
    assert params_at(two)[0] == 3


def test_prompt_selection_and_a_predictor_warm_up_split_over_two_processes(runs, tmp_path):
    """Both processes select the same kept prompts (from features exchanged before selection) and report the
    step's kept prompts only, split between them; the warm-up's sampling is charged at step 0."""
    workdir = tmp_path / "selecting"
    selection = [
        "--config.allocation.candidates_per_prompt=2.0",
        "--config.allocation.predictor_warmup_prompts=4",
        "--config.allocation.predictor_warmup_rollouts=2",
    ]
    run_two_processes(workdir, runs["cache"], 1, *selection)
    logged = records(workdir)
    assert [(r["step"], r["alloc/warmup/rollouts"]) for r in logged if "alloc/warmup/rollouts" in r] == [(0, 8.0)]
    assert [(r["alloc/candidates"], r["alloc/prompts"]) for r in logged if "alloc/prompts" in r] == [(8.0, 4.0)]
    sampled = json.loads((workdir / "summary.json").read_text())["run"]["processes"]["last_step_questions"]
    assert sampled[0] and sampled[1] and not set(sampled[0]) & set(sampled[1])
    assert len(sampled[0]) + len(sampled[1]) == 4  # the kept prompts of step 1, not the warm-up's or the dropped
