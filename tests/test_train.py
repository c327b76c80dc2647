"""The main job end to end on a tiny world: what it writes, clear config errors, and an exact resume after SIGKILL."""

import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from trace_jax.checkpoint.state import StateCheckpointer

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = [
    "--config.world.scale=2",
    "--config.world.questions_per_hop=40",
    "--config.world.ood_questions=10",
    "--config.tokenizer.vocab_size=400",
    "--config.sft.max_steps=30",
    "--config.sft.practice_worlds=0",
    "--config.engine.max_slots=8",
    "--config.allocation.rollouts_per_prompt=3.0",
    "--config.rl.prompts_per_step=4",
    "--config.rl.checkpoint_every=1",
    "--config.eval.num_questions=6",
    "--config.eval.every=2",
]


def train(workdir, *extra, wait=True):
    command = [sys.executable, "-m", "trace_jax.train", f"--workdir={workdir}", *TINY, *extra]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if not wait:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def final_params(workdir):
    restored = StateCheckpointer(workdir / "checkpoints").restore_latest(keys=["params"])
    return restored.step, jax.tree.leaves(restored.state["params"])


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run")
    return workdir, train(workdir, "--config.rl.steps=4")


def test_main_job_writes_logs_plots_checkpoints_and_a_summary(finished_run):
    workdir, done = finished_run
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "alloc/effective_ratio" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["alloc/budget/rollouts"] <= 4 * 3 for r in steps)  # the rollout budget holds
    evals = [r["step"] for r in records if "eval/em" in r]
    assert evals[0] == 0 and evals[-1] == 4  # before RL (the SFT policy) and after
    assert list((workdir / "tensorboard").glob("events.out.tfevents.*"))
    for plot in ("reward.png", "effective_ratio.png"):
        assert (workdir / "plots" / plot).read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["policy"] == "trace"
    assert {row["group"] for row in summary["eval_after"]} >= {"1-hop", "all"}
    assert "| group" in done.stdout and "EM rl" in done.stdout
    assert json.loads((workdir / "config.json").read_text())["rl"]["steps"] == 4


def test_evaluate_cli_reads_the_run(finished_run):
    workdir, _ = finished_run
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "trace_jax.evaluate",
            "--workdir",
            str(workdir),
            "--split",
            "test",
            "--limit",
            "5",
            "--samples",
            "2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "policy: rl step 4" in done.stdout
    rows = json.loads((workdir / "eval_test.json").read_text())["rows"]
    assert rows[-1]["group"] == "all" and rows[-1]["n"] == 5 and "pass@2" in rows[-1]


def test_sigkill_then_resume_ends_with_the_uninterrupted_params(finished_run, tmp_path):
    reference_dir, _ = finished_run
    workdir = tmp_path / "killed"
    workdir.mkdir()
    for part in ("sft", "tokenizer"):  # the same warm start: SFT stops on a time budget, so share it
        shutil.copytree(reference_dir / part, workdir / part)
    kill_after = random.Random().randint(1, 3)
    process = train(workdir, "--config.rl.steps=4", wait=False)
    checkpoints = workdir / "checkpoints"
    deadline = time.monotonic() + 500
    while time.monotonic() < deadline and process.poll() is None:
        done_steps = [int(p.name) for p in checkpoints.glob("*") if p.name.isdigit()] if checkpoints.exists() else []
        if done_steps and max(done_steps) >= kill_after:
            break
        time.sleep(0.2)
    assert process.poll() is None, "the run ended before it could be killed: " + process.stderr.read().decode()[-2000:]
    process.send_signal(signal.SIGKILL)
    process.wait()
    train(workdir, "--config.rl.steps=4")
    (step_a, params_a), (step_b, params_b) = final_params(reference_dir), final_params(workdir)
    assert step_a == step_b == 4
    for a, b in zip(params_a, params_b, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_unknown_config_keys_name_the_near_matches(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "trace_jax.train", f"--workdir={tmp_path}", "--config.rl.learnin_rate=1e-5"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "unknown config key 'rl.learnin_rate'; near matches:" in done.stderr
    assert "optim.learning_rate" in done.stderr


@pytest.mark.parametrize("policy", ["uniform", "tree_random"])
def test_ablation_config_selects_the_policy(policy):
    from trace_jax.config_utils import load_config_file

    config = load_config_file(f"{ROOT}/configs/ablation.py:{policy}")
    assert config.allocation.policy == policy
    with pytest.raises(ValueError, match="oracle is simulator-only"):
        load_config_file(f"{ROOT}/configs/ablation.py:oracle")
