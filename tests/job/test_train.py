"""The main job end to end on a tiny world: what it writes, the same numbers under load, exact logs and params
after SIGKILL + rerun and after a SIGTERM (preemption: the step under way checkpointed, exit 143) + rerun with a
short KV page pool, and a finished run left untouched by a rerun.

The tiny config trains a warm start that answers about a third of its training questions, so rollout
rewards are mixed and RL gradients are non-zero: the resume test would catch a policy that never moved.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tests.helpers import TINY_MAIN_JOB, cpu_fingerprint, main_job_command, summary_digest
from trace_jax.checkpoint.state import StateCheckpointer

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = [
    *TINY_MAIN_JOB,
    "--config.rl.steps=3",
    "--config.rl.checkpoint_every=2",
    # Prompt selection and a predictor warm-up: the resume and same-seed tests cover them too.
    "--config.allocation.candidates_per_prompt=2.0",
    "--config.allocation.predictor_warmup_prompts=4",
    "--config.allocation.predictor_warmup_rollouts=2",
]


def command(workdir, cache):
    return main_job_command(workdir, cache, TINY)


def train(workdir, cache):
    done = subprocess.run(
        command(workdir, cache), cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=1800
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def records_without_timings(workdir):
    """metrics.jsonl, minus wall-clock figures (they differ between any two runs)."""
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if "time/" not in k} for line in lines]


def tensorboard_scalars(workdir):
    """{tag: [(step, value)]} as TensorBoard's reader shows it (purge markers applied), minus timings."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(workdir / "tensorboard"), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
        if "time/" not in tag
    }


def wait_until_logged(process, workdir, step):
    """Returns once ``workdir``'s metrics.jsonl has ``step`` (or the process ended)."""
    deadline = time.monotonic() + 1500
    while time.monotonic() < deadline and process.poll() is None:
        records = records_without_timings(workdir) if (workdir / "metrics.jsonl").exists() else []
        if any(r["step"] == step for r in records):
            return
        time.sleep(0.2)


def final_params(workdir):
    restored = StateCheckpointer(workdir / "checkpoints").restore_latest(keys=["params"])
    return restored.step, [np.asarray(x) for x in jax.tree.leaves(restored.state["params"])]


def without_run_facts(summary):
    return {k: v for k, v in summary.items() if k != "run"}


def computed_summary(summary):
    """What the run computed: the summary without its run facts and without the warm start's cache key, a hash
    of the code that trains it (``trace_jax.job.warm_start.CODE``) that moves with any edit of that code, even
    one that computes the same numbers."""
    kept = without_run_facts(summary)
    return {**kept, "warm_start": {k: v for k, v in kept["warm_start"].items() if k != "key"}}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("warm_start_cache")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, cache):
    workdir = tmp_path_factory.mktemp("run")
    return workdir, train(workdir, cache)


def test_main_job_writes_logs_plots_checkpoints_and_a_summary(finished_run):
    workdir, done = finished_run
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "alloc/effective_ratio" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["alloc/budget/rollouts"] <= 4 * 3 for r in steps)  # the rollout budget holds
    assert all(r["alloc/candidates"] == 8 and r["alloc/prompts"] == 4 for r in steps)  # 4 kept of 8 drawn
    assert [r["step"] for r in records if "eval/em" in r] == [0, 3]  # before RL (the SFT policy) and after
    assert [(r["step"], r["alloc/warmup/rollouts"]) for r in records if "alloc/warmup/rollouts" in r] == [(0, 8.0)]
    assert list((workdir / "tensorboard").glob("events.out.tfevents.*"))
    for plot in ("reward.png", "effective_ratio.png"):
        assert (workdir / "plots" / plot).read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["policy"] == "trace" and summary["reproducible"] is True
    assert summary["warm_start"]["steps"] == 200 and summary["warm_start"]["stopped_by"] == "steps"
    assert {"warm_start", "setup", "evaluation", "rl", "total"} <= set(summary["run"]["timings_s"])
    assert {row["group"] for row in summary["eval_after"]} >= {"1-hop", "all"}
    assert "| group" in done.stdout and "EM after RL" in done.stdout and "steps, RL " in done.stdout
    assert "warm start (SFT)" in done.stderr and "evaluation before RL" in done.stderr  # progress bars
    assert "Traceback" not in done.stderr and "Building index" not in done.stderr  # no third-party chatter
    assert json.loads((workdir / "config.json").read_text())["rl"]["steps"] == 3


def test_evaluate_cli_reads_the_run(finished_run):
    workdir, _ = finished_run
    done = subprocess.run(
        [sys.executable, "-m", "trace_jax.evaluate", "--workdir", str(workdir), "--limit", "3", "--samples", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "policy: rl step 3" in done.stdout
    rows = json.loads((workdir / "eval_test.json").read_text())["rows"]
    assert rows[-1]["group"] == "all" and rows[-1]["n"] == 3 and "pass@2" in rows[-1]


def test_a_finished_run_rerun_changes_nothing_but_its_log(finished_run, cache):
    workdir, _ = finished_run
    log = workdir / "train.log"
    before = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file() and p != log}
    log_lines = log.read_text().splitlines()
    done = train(workdir, cache)
    assert "is already complete: 3 RL steps" in done.stderr and "--config.rl.steps=N" in done.stderr
    assert {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file() and p != log} == before
    new_lines = log.read_text().splitlines()
    assert new_lines[: len(log_lines)] == log_lines and len(new_lines) == len(log_lines) + 1


def test_sigkill_between_checkpoints_then_rerun_gives_the_uninterrupted_logs_and_params(finished_run, cache, tmp_path):
    reference, _ = finished_run
    workdir = tmp_path / "killed"
    process = subprocess.Popen(command(workdir, cache), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    # Checkpoints are at steps 0, 2 and 3: kill once step 1 is logged, before step 2 is checkpointed.
    wait_until_logged(process, workdir, step=1)
    assert process.poll() is None, "the run ended before it could be killed: " + process.stderr.read().decode()[-2000:]
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (workdir / "checkpoints" / "2").exists(), "killed too late: step 2 was already checkpointed"
    train(workdir, cache)

    # The premise: the policy moved away from the warm start (mixed rewards, non-zero gradients; a step whose kept
    # prompts all got equal rewards has none).
    records = records_without_timings(reference)
    assert any(r["train/grad_norm"] > 0 for r in records if r["step"] > 0)
    warm_start = pathlib.Path(json.loads((reference / "summary.json").read_text())["run"]["warm_start_dir"])
    sft = StateCheckpointer(warm_start / "sft").restore_latest()
    step_a, params_a = final_params(reference)
    sft_params = [np.asarray(x) for x in jax.tree.leaves(sft.state["params"])]
    assert any(not np.array_equal(a, b) for a, b in zip(params_a, sft_params, strict=True))

    step_b, params_b = final_params(workdir)
    assert step_a == step_b == 3
    for a, b in zip(params_a, params_b, strict=True):
        np.testing.assert_array_equal(a, b)
    # Each step once, step 0's evaluation included; the final greedy evaluation equal too (a pure function of
    # the params and the questions, whatever the engine decoded before).
    assert records_without_timings(workdir) == records
    assert tensorboard_scalars(workdir) == tensorboard_scalars(reference)
    assert len(list((workdir / "tensorboard").glob("events.out.tfevents.*"))) == 2  # the killed file is still there
    summary_a = json.loads((reference / "summary.json").read_text())
    summary_b = json.loads((workdir / "summary.json").read_text())
    assert without_run_facts(summary_b) == without_run_facts(summary_a) and summary_b["run"]["resumes"] == 1


def test_same_config_and_seed_give_the_same_summary_under_cpu_load(finished_run, tmp_path):
    reference, _ = finished_run
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # competes for the CPU all along
    try:
        train(tmp_path / "loaded", tmp_path / "own_cache")  # its own warm start: trained again, under load
    finally:
        busy.kill()
        busy.wait()
    summary_a = json.loads((reference / "summary.json").read_text())
    summary_b = json.loads((tmp_path / "loaded" / "summary.json").read_text())
    assert summary_b["run"]["warm_start_dir"].startswith(str(tmp_path / "own_cache"))
    assert summary_a["run"]["timings_s"] != summary_b["run"]["timings_s"]  # wall time did differ
    assert without_run_facts(summary_b) == without_run_facts(summary_a)


RECORD = pathlib.Path(__file__).parent / "records" / "tiny_run.json"


def test_the_tiny_run_prints_its_recorded_summary(finished_run):
    """The tiny run's summary equals the one recorded for this machine's CPU, so a change to the code that
    changes what the main job computes fails here (an edit that computes the same numbers does not: the warm
    start's cache key, a hash of its code, is left out). docs/benchmarks.md states the default run's figures, which
    the README quotes, beside this record's digest: whoever re-records it re-measures the default run
    (``tests/job/record_tiny_run.py``). XLA compiles for the host CPU, so another CPU may round differently: the
    record names its CPU."""
    workdir, _ = finished_run
    record = json.loads(RECORD.read_text())
    assert record["flags"] == TINY, "the record was made with other flags: re-record it"
    figures = (ROOT / "docs" / "benchmarks.md").read_text().partition("## The default run's figures")[2]
    assert summary_digest(record["summary"]) in figures, "the default run's figures cite another record"
    readme = (ROOT / "README.md").read_text()
    for figure in ("0.487", "0.547", "0.869", "101,212"):  # the README quotes the figures this record backs
        assert figure in figures and figure in readme, figure
    if record["cpu"] != cpu_fingerprint():
        pytest.skip(f"the record is of CPU {record['cpu']}; this one is {cpu_fingerprint()}")
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["warm_start"]["key"]  # premise: the key the record leaves out is there to leave out
    assert computed_summary(summary) == record["summary"]


def test_leaving_out_the_zero_advantage_trees_trains_the_same_first_step(cache, tmp_path):
    """The default recipe leaves the all-equal groups out of the update (``batch.skip_zero_advantage``): one
    optimizer step on the same trees gives the same loss and gradient norm with it on and off. Catches the
    mutant "the loop does not pass the skipped trees' denominator to the update" (the gradient then grows by
    the skipped trees' share of the batch)."""
    one_step = ["--config.rl.steps=1", "--config.ppo.ppo_epochs=1", "--config.ppo.mini_batches=1"]
    steps = {}
    for skip in (True, False):
        workdir = tmp_path / f"skip_{skip}"
        flags = [*TINY_MAIN_JOB, *one_step, f"--config.batch.skip_zero_advantage={skip}"]
        done = subprocess.run(main_job_command(workdir, cache, flags), cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-4000:]
        steps[skip] = next(r for r in records_without_timings(workdir) if "train/loss" in r)
    on, off = steps[True], steps[False]
    assert on["alloc/budget/generated_tokens"] == off["alloc/budget/generated_tokens"]  # premise: the same trees
    assert on["batch/trees_skipped"] >= 1 and off["batch/trees_skipped"] == 0, "premise: trees left out"
    assert on["batch/rows"] < off["batch/rows"]
    assert on["train/grad_norm"] == pytest.approx(off["train/grad_norm"], rel=1e-4)
    assert on["train/loss"] == pytest.approx(off["train/loss"], rel=1e-4, abs=1e-7)


# A world slice where a few RL steps reliably raise EM: 1-hop questions only, a warm start cut short (greedy
# answers 9 of its 13 training questions, samples at temperature 0.5 about half), every training question in
# every step, and EM measured on those questions by the policy RL trains (the tempered one, 8 samples each).
# Measured with seeds 0, 1, 2: sampled EM 0.45 -> 0.60, 0.56, 0.63; greedy EM 0.69 -> 0.92, 0.85, 0.69.
LEARNS = [
    "--config.world.scale=1",
    "--config.world.max_hops=1",
    "--config.world.ood_hops=2",
    "--config.world.questions_per_hop=16",
    "--config.world.ood_questions=4",
    "--config.tokenizer.vocab_size=400",
    "--config.sft.max_steps=40",
    "--config.sft.practice_worlds=0",
    "--config.engine.max_slots=16",
    "--config.engine.sampling.temperature=0.5",
    "--config.allocation.rollouts_per_prompt=8.0",
    "--config.rl.prompts_per_step=13",
    "--config.optim.learning_rate=3e-4",
    "--config.eval.split=train",
    "--config.eval.num_questions=1000",
]
LEARN_STEPS = 6


def test_a_few_rl_steps_raise_em_on_the_questions_they_train_on(tmp_path):
    from trace_jax.job import build
    from trace_jax.job.cli import Console
    from trace_jax.job.commands import load_config
    from trace_jax.job.evaluate import evaluate
    from trace_jax.job.metrics import PhaseTimer
    from trace_jax.job.training import Training

    config, _ = load_config(["train", *LEARNS, f"--config.warm_start.cache_dir={tmp_path / 'cache'}"])
    run = Training(config, tmp_path / "run", Console(verbosity=-1), PhaseTimer())
    tasks = run.world.world.questions("train")
    engine = run.sampler.runner.engine
    sampler = build.build_runner(config, run.model_config, None, run.world, seed=10_000, engine=engine)

    def sampled_em() -> float:
        sampler.load_state_dict({"next_seed": 10_000})  # the same draws before and after
        return evaluate(sampler, run.world.env, tasks, samples=8).overall["em"]

    before = sampled_em()
    start = [np.asarray(x) for x in jax.tree.leaves(run.state.params)]
    grad_norms = [run.rl_step()["train/grad_norm"] for _ in range(LEARN_STEPS)]
    after = sampled_em()
    # The premise: every training question in each step, gradients flowed and the policy moved.
    assert len(tasks) == config.rl.prompts_per_step and min(grad_norms) > 0
    moved = zip(start, jax.tree.leaves(run.state.params), strict=True)
    assert any(not np.array_equal(a, np.asarray(b)) for a, b in moved)
    assert 0.2 < before < 0.8
    assert after >= before + 0.05, (before, after, grad_norms)


# The main job (k = 0) with a SIGTERM sent as step 2 starts sampling, whose rollouts then never finish: a step
# longer than the grace, abandoned at the deadline, at the same point whatever the load.
SIGTERM_WHILE_SAMPLING_STEP_2 = """
import os, signal, sys, time
from trace_jax.job.sampling import SamplingSide
from trace_jax.job.commands import train_and_exit

sample = SamplingSide.sample

def sample_after_a_notice(self, step, version):
    if step == 2:
        print("SIGTERM sent while sampling step 2", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        while True:
            time.sleep(0.05)
    return sample(self, step, version)

SamplingSide.sample = sample_after_a_notice
sys.argv = ["trace_jax.train", *sys.argv[1:]]
train_and_exit()
"""


def test_a_step_abandoned_at_the_deadline_keeps_the_completed_step_before_it(finished_run, cache, tmp_path):
    """k = 0, checkpoints every 2 steps: step 1 completes (not checkpointed), a SIGTERM comes while step 2 samples
    and the grace (0 s) runs out: step 2 is abandoned, step 1 is checkpointed (the stop loses only the step under
    way), and the rerun resumes at step 1 and ends as the uninterrupted run (records, summary, params). Catches a
    stop that keeps only the last periodic checkpoint (step 0: step 1 lost too)."""
    from trace_jax.job.cli import ExitCode

    reference, _ = finished_run
    workdir = tmp_path / "abandoned"
    command = main_job_command(workdir, cache, [*TINY, "--config.rl.preemption_grace_s=0"])
    driver = [sys.executable, "-c", SIGTERM_WHILE_SAMPLING_STEP_2, *command[3:]]
    stopped = subprocess.run(driver, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert stopped.returncode == ExitCode.PREEMPTED, stopped.stderr[-4000:]
    assert "SIGTERM sent while sampling step 2" in stopped.stderr  # premise: the notice came during step 2
    assert "stopped by SIGTERM before the step under way ended" in stopped.stderr  # premise: step 2 abandoned
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [0, 1]
    assert [r["step"] for r in records_without_timings(workdir)] == [0, 1]

    resumed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resuming at RL step 1 of 3" in resumed.stderr
    records = records_without_timings(reference)
    assert any(r["train/grad_norm"] > 0 for r in records if r["step"] == 1)  # premise: step 1 moved the policy
    assert records_without_timings(workdir) == records
    summary = lambda path: without_run_facts(json.loads((path / "summary.json").read_text()))
    assert summary(workdir) == summary(reference)
    (step_a, params_a), (step_b, params_b) = final_params(reference), final_params(workdir)
    assert step_a == step_b == 3
    for a, b in zip(params_a, params_b, strict=True):
        np.testing.assert_array_equal(a, b)


# A smaller KV page pool (160 pages of 16 positions) and an evaluation after every step, so the run crosses phases
# (warm-up, evaluation, step) that share the engine's pool. A resumed run starts from an empty pool: the run is
# exact only if nothing held outlives the phase that held it.
PRESSED = [
    *TINY_MAIN_JOB,
    "--config.rl.steps=3",
    "--config.rl.checkpoint_every=3",  # checkpoints 0 and 3 only: one at step 1 or 2 comes from the SIGTERM
    "--config.eval.every=1",
    "--config.engine.num_pages=160",
    "--config.allocation.candidates_per_prompt=2.0",
    "--config.allocation.predictor_warmup_prompts=4",
    "--config.allocation.predictor_warmup_rollouts=2",
]


def test_sigterm_during_a_step_checkpoints_it_exits_143_and_the_rerun_equals_the_uninterrupted_run(cache, tmp_path):
    """Catches a SIGTERM that kills at once (no checkpoint of the step under way, exit 130) and a rerun that does
    not resume from the SIGTERM's checkpoint or does not end as the uninterrupted run."""

    reference = tmp_path / "reference"
    done = subprocess.run(
        main_job_command(reference, cache, PRESSED), cwd=ROOT, capture_output=True, text=True, timeout=1800
    )
    assert done.returncode == 0, done.stderr[-4000:]
    workdir = tmp_path / "preempted"
    # A grace far longer than any step: the step under way always finishes (nothing here depends on timing).
    flags = [*PRESSED, "--config.rl.preemption_grace_s=1200"]
    stderr, saved = _stopped_by_sigterm_after_step_one(workdir, cache, flags)
    assert saved[-1] in (1, 2), saved  # the step under way (or the one just logged) was checkpointed on the SIGTERM
    assert f"stopped by SIGTERM after RL step {saved[-1]}" in stderr
    assert not (workdir / "summary.json").exists()
    train_flags = main_job_command(workdir, cache, flags)
    done = subprocess.run(train_flags, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"resuming at RL step {saved[-1]} of 3" in done.stderr

    # The premise: the policy moved (equal logs and params would otherwise prove nothing about the resume).
    records = records_without_timings(reference)
    assert any(r["train/grad_norm"] > 0 for r in records if r["step"] > 0)
    assert records_without_timings(workdir) == records
    step_a, params_a = final_params(reference)
    step_b, params_b = final_params(workdir)
    assert step_a == step_b == 3
    for a, b in zip(params_a, params_b, strict=True):
        np.testing.assert_array_equal(a, b)
    summary_a = json.loads((reference / "summary.json").read_text())
    summary_b = json.loads((workdir / "summary.json").read_text())
    assert without_run_facts(summary_b) == without_run_facts(summary_a) and summary_b["run"]["resumes"] == 1


def _stopped_by_sigterm_after_step_one(workdir, cache, flags):
    """Starts the main job on ``workdir`` and SIGTERMs it once RL step 1 is logged; asserts it exits with the
    preemption status. Returns its stderr and the RL steps checkpointed, in order."""
    from trace_jax.job.cli import ExitCode

    process = subprocess.Popen(
        main_job_command(workdir, cache, flags), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    wait_until_logged(process, workdir, step=1)
    assert process.poll() is None, "the run ended before the SIGTERM: " + process.stderr.read()[-2000:]
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=1200)
    assert process.returncode == ExitCode.PREEMPTED == 143, stderr[-3000:]
    return stderr, sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


LORA = [*TINY_MAIN_JOB, "--config.rl.steps=2", "--config.rl.checkpoint_every=2", "--config.lora.rank=4"]


def test_a_lora_run_checkpoints_only_the_adapters_and_a_preempted_run_resumes_to_the_uninterrupted_one(cache, tmp_path):
    """The checkpoints hold the adapters and their optimizer moments, not the frozen base (which the rerun takes
    from the run's start); stopped after step 1 and rerun, the run ends as the uninterrupted one. Catches a resume
    that restores the base but keeps fresh adapters, or a checkpoint that drops the adapters."""

    reference = tmp_path / "reference"
    done = subprocess.run(
        main_job_command(reference, cache, LORA), cwd=ROOT, capture_output=True, text=True, timeout=1800
    )
    assert done.returncode == 0, done.stderr[-4000:]
    saved = StateCheckpointer(reference / "checkpoints").restore_latest(keys=["params", "train"])
    names = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(saved.state["params"])]
    assert names and all("_lora_a'" in name or "_lora_b'" in name for name in names), names
    adapter_values = sum(x.size for x in jax.tree.leaves(saved.state["params"]))
    moments = sum(x.size for x in jax.tree.leaves(saved.state["train"]["opt_state"]) if np.ndim(x) > 0)
    assert moments == 2 * adapter_values  # Adam's two moments, of the adapters alone
    _the_export_of_a_lora_run_is_its_policy_merged_with_its_adapters_beside(reference, tmp_path / "export")

    workdir = tmp_path / "preempted"
    flags = [*LORA, "--config.rl.preemption_grace_s=1200"]  # the step under way always finishes
    _, saved = _stopped_by_sigterm_after_step_one(workdir, cache, flags)
    stopped_at = saved[-1]
    assert stopped_at in (1, 2), stopped_at
    done = subprocess.run(
        main_job_command(workdir, cache, flags), cwd=ROOT, capture_output=True, text=True, timeout=1800
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"resuming at RL step {stopped_at} of 2" in done.stderr

    records = records_without_timings(reference)
    assert any(r["train/grad_norm"] > 0 for r in records if r["step"] == 1)  # premise: step 1 moved the adapters
    assert records_without_timings(workdir) == records
    (step_a, params_a), (step_b, params_b) = final_params(reference), final_params(workdir)
    assert step_a == step_b == 2
    for a, b in zip(params_a, params_b, strict=True):
        np.testing.assert_array_equal(a, b)


def _the_export_of_a_lora_run_is_its_policy_merged_with_its_adapters_beside(workdir, out):
    """``hf export --workdir`` of a LoRA run: the checkpoint's adapters on the run's start (``latest_policy``),
    written merged (transformers computes our logits) with the PEFT adapters in ``adapter/``."""
    import jax.numpy as jnp
    from flax import nnx
    from transformers import AutoModelForCausalLM

    from tests.helpers import torch_logits
    from trace_jax.checkpoint import adapters
    from trace_jax.job import build, recipes
    from trace_jax.models import abstract_model

    assert recipes.export_run(workdir, out) == "rl step 2"
    start, params, _ = recipes.latest_policy(build.load_run_config(workdir), workdir)
    assert start.model_config.lora_rank == 4
    config = json.loads((out / recipes.ADAPTER_DIR / adapters.ADAPTER_CONFIG).read_text())
    assert (config["r"], config["peft_type"]) == (4, "LORA")
    ids = np.random.default_rng(0).integers(0, start.model_config.vocab_size, (2, 12))
    ours = np.asarray(nnx.merge(abstract_model(start.model_config)[0], params)(jnp.asarray(ids)).logits_btv)
    np.testing.assert_allclose(torch_logits(AutoModelForCausalLM.from_pretrained(out).eval(), ids), ours, atol=1e-4)
