"""The main job with its sampling devices apart from the training ones, in turn (k = 0) and sampling one step ahead
(``rl.max_staleness = 1``), on 2 fake CPU devices, against the colocated run on 1 device (today's path); and a
SIGTERM that arrives while the rollouts sampled ahead are running.

The run here (``OVERLAP``: 2 steps, a checkpoint at step 2) samples ahead only at step 1 (step 2 ends at a
checkpoint and is the last), so at k = 1 step 2 trains on trees sampled by the policy of step 0. The runs share
one warm start and one JAX compilation cache: a program compiles once for the file, not once a run.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import TINY_MAIN_JOB, fake_cpu_devices, main_job_command
from tests.job.test_train import ROOT, final_params, records_without_timings, without_run_facts

pytestmark = pytest.mark.slow

OVERLAP = [
    *TINY_MAIN_JOB,
    "--config.rl.steps=2",
    "--config.rl.checkpoint_every=2",
    "--config.eval.num_questions=2",
    # Prompt selection and a predictor warm-up: the prompt stream and predictor advance on the sampling thread.
    # With these, step 1's rollouts get mixed rewards, so the policy moves at step 1 and the policy of step 0 that
    # samples step 2 ahead is another policy than step 1's.
    "--config.allocation.candidates_per_prompt=2.0",
    "--config.allocation.predictor_warmup_prompts=4",
    "--config.allocation.predictor_warmup_rollouts=2",
]
APART = ["--config.mesh.rollout_devices=1"]
SAMPLE_AHEAD = ["--config.rl.max_staleness=1"]
AHEAD = [*APART, *SAMPLE_AHEAD]
# Sampling in a process of its own on one core, the trainer on the others (one host device each).
OWN_PROCESS = ["--config.mesh.rollout_cpus=1"]
OWN_PROCESS_AHEAD = [*OWN_PROCESS, *SAMPLE_AHEAD]
LAG_KEYS = ("rollout/staleness_mean", "rollout/staleness_max")

# The main job with a SIGTERM sent from the sampling thread as it starts sampling step 2 ahead (while step 1
# trains), which then never finishes: the notice always comes with those rollouts in flight, whatever the load,
# and a stop that waits for them never comes.
SIGTERM_WHILE_SAMPLING_AHEAD = """
import os, signal, sys, threading
from trace_jax.job.sampling import SamplingSide
from trace_jax.job.commands import train_and_exit

sample = SamplingSide.sample

def sample_after_a_notice(self, step, version):
    if step == 2 and threading.current_thread() is not threading.main_thread():
        print("SIGTERM sent while sampling step 2 ahead", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait()
    return sample(self, step, version)

SamplingSide.sample = sample_after_a_notice
sys.argv = ["trace_jax.train", *sys.argv[1:]]
train_and_exit()
"""
# The same notice, with rollouts that then finish (in whatever time the load gives them).
SIGTERM_WHILE_SAMPLING_AHEAD_THEN_FINISH = SIGTERM_WHILE_SAMPLING_AHEAD.replace("threading.Event().wait()", "pass")
# The main job with step 2's rollouts sampled ahead (the sampling side's prompt stream, seeds and predictor moved
# past them; in this process or in the sampling process) that then never come back: the SIGTERM is sent from the
# sampling thread once they are sampled, step 1 waits for the notice before it returns (so the stop always finds
# them in flight), and the stop waits for them not at all (a drain with no time left): they are always dropped,
# whatever the load.
SIGTERM_AND_ROLLOUTS_THAT_MISS_THE_GRACE = """
import os, signal, sys, threading
from trace_jax.job.cli import TERMINATION
from trace_jax.job.sampling import SamplingSide
from trace_jax.job.sampling_process import SamplingProcess
from trace_jax.job.training import Training
from trace_jax.job.commands import train_and_exit

rl_step, drain_and_save = Training.rl_step, Training.drain_and_save
sent = threading.Event()

def hanging(sample):
    def sample_then_hang_after_a_notice(self, step, version):
        sampled = sample(self, step, version)
        if step == 2 and threading.current_thread() is not threading.main_thread():
            print("SIGTERM sent once step 2 was sampled ahead", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            sent.set()
            threading.Event().wait()
        return sampled
    return sample_then_hang_after_a_notice

def rl_step_then_wait_for_the_notice(self):
    metrics = rl_step(self)
    if self.step == 1:
        sent.wait()
        while not TERMINATION.requested:
            sent.wait(0.01)
    return metrics

SamplingSide.sample = hanging(SamplingSide.sample)
SamplingProcess.sample = hanging(SamplingProcess.sample)
Training.rl_step = rl_step_then_wait_for_the_notice
Training.drain_and_save = lambda self, abandon_after_s: drain_and_save(self, 0.0)
sys.argv = ["trace_jax.train", *sys.argv[1:]]
train_and_exit()
"""
# The main job with a SIGTERM sent as step 2 builds its batch (its trees were sampled ahead, during step 1), which
# then never finishes: with no grace the step is abandoned before its update, whatever the load.
SIGTERM_WHILE_STEP_2_BUILDS_ITS_BATCH = """
import os, signal, sys, time
from trace_jax.job import training
from trace_jax.job.commands import train_and_exit

build_batch, calls = training.build_batch, []

def build_batch_then_hang_at_step_2(*args, **kwargs):
    calls.append(None)
    if len(calls) == 2:
        print("SIGTERM sent as step 2 builds its batch", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        while True:
            time.sleep(0.01)
    return build_batch(*args, **kwargs)

training.build_batch = build_batch_then_hang_at_step_2
sys.argv = ["trace_jax.train", *sys.argv[1:]]
train_and_exit()
"""


def _env(devices, compiled):
    return dict(
        os.environ,
        XLA_FLAGS=fake_cpu_devices(devices),
        JAX_PLATFORMS="cpu",
        JAX_COMPILATION_CACHE_DIR=str(compiled),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )


def _run(command, devices, compiled, returncode=0, timeout=1800):
    done = subprocess.run(
        command, cwd=ROOT, env=_env(devices, compiled), capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == returncode, done.stderr[-4000:]
    return done


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """The warm start's cache and the compilation cache the runs share."""
    return tmp_path_factory.mktemp("warm_start"), tmp_path_factory.mktemp("compiled")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shared):
    """The colocated 1-device run first (it trains the warm start on 1 device, as the others then reuse it)."""
    cache, compiled = shared
    base = tmp_path_factory.mktemp("run")
    workdirs = {}
    runs = [("colocated", [], 1), ("apart", APART, 2), ("ahead", AHEAD, 2)]
    if len(os.sched_getaffinity(0)) >= 2:  # a core to sample on and one to train on
        runs += [("own_process", OWN_PROCESS, 1), ("own_process_ahead", OWN_PROCESS_AHEAD, 1)]
    for name, flags, devices in runs:
        workdirs[name] = base / name
        _run(main_job_command(workdirs[name], cache, [*OVERLAP, *flags]), devices, compiled)
    return workdirs


def _summary(workdir):
    return json.loads((workdir / "summary.json").read_text())


def _timed_records(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _assert_same_params(workdir, reference, step):
    (step_a, params_a), (step_b, params_b) = final_params(workdir), final_params(reference)
    assert step_a == step_b == step
    assert all(np.array_equal(a, b) for a, b in zip(params_a, params_b, strict=True))


def test_sampling_devices_apart_give_the_colocated_run_bit_for_bit(runs):
    """k = 0 with the engine on its own device: the same records, summary and final params as the colocated run
    (fails if the weights reach the engine changed, late or not at all, or if k = 0 samples ahead)."""
    colocated, apart = runs["colocated"], runs["apart"]
    assert _summary(apart)["run"]["placement"] == {"training_devices": [1], "sampling_devices": [0]}
    records = records_without_timings(colocated)
    assert records[1]["train/grad_norm"] > 0  # premise: the policy moved at step 1 (step 2 samples ahead with θ_0)
    assert records_without_timings(apart) == records
    assert without_run_facts(_summary(apart)) == without_run_facts(_summary(colocated))
    _assert_same_params(apart, colocated, step=2)
    lines = _timed_records(apart)
    assert all("time/weight_sync_s" in r for r in lines if "alloc/effective_ratio" in r)
    assert not any(key in r for r in lines for key in LAG_KEYS)  # k = 0 logs no lag


def test_sampling_one_step_ahead_lags_by_one_version_where_it_overlaps_and_nowhere_else(runs):
    """k = 1: step 2's trees come from the policy of step 0 (lag 1), step 1 samples in turn (lag 0) and is today's
    step 1; what follows from the sampled trees differs at step 2. Fails if the trees are sampled with the newest
    weights anyway (no lag: step 2 equals k = 0's), if the lag is logged wrong, if sampling ahead disturbs the
    step that launched it, or if a checkpoint step (step 2, also the last) samples ahead."""
    ahead = {r["step"]: r for r in records_without_timings(runs["ahead"])}
    sync = {r["step"]: r for r in records_without_timings(runs["apart"])}
    assert [ahead[s]["rollout/staleness_max"] for s in (1, 2)] == [0.0, 1.0]
    assert [ahead[s]["rollout/staleness_mean"] for s in (1, 2)] == [0.0, 1.0]
    assert {k: v for k, v in ahead[1].items() if k not in LAG_KEYS} == sync[1]
    # Step 2 trains on other trees than k = 0's (sampled by the older policy): its figures move.
    assert {k: v for k, v in ahead[2].items() if k not in LAG_KEYS} != sync[2]
    by_step = {r["step"]: r for r in _timed_records(runs["ahead"])}
    assert by_step[1]["time/overlap_s"] > 0.0 and by_step[2]["time/overlap_s"] == 0.0  # step 2 does not sample ahead
    summary, reference = _summary(runs["ahead"]), _summary(runs["apart"])
    for key in ("policy", "seed", "steps", "eval_before", "warm_start"):
        assert summary[key] == reference[key], key


@pytest.mark.parametrize("mode, reference", [("own_process", "apart"), ("own_process_ahead", "ahead")])
def test_sampling_in_a_process_of_its_own_on_its_own_core_gives_the_in_process_run_bit_for_bit(runs, mode, reference):
    """The sampling side in a child process pinned to one core (``mesh.rollout_cpus = 1``), at k = 0 and at k = 1:
    the same records, summary and final params as the in-process run, on cores that do not overlap. Fails if the
    weights reach the child changed, late or not at all (k = 0: step 2 samples with step 1's policy; a child that
    keeps its first weights was run and caught), if the child's prompt stream, seeds or predictor drift from the
    in-process ones, or if the two processes share a core."""
    if mode not in runs:
        pytest.skip("needs 2 cores: one to sample on, one to train on")
    own, same = runs[mode], runs[reference]
    placement = _summary(own)["run"]["placement"]
    assert placement["sampling"] and placement["training"]  # premise: the child ran on cores of its own
    assert not set(placement["sampling"]) & set(placement["training"])
    assert records_without_timings(own) == records_without_timings(same)
    assert without_run_facts(_summary(own)) == without_run_facts(_summary(same))
    _assert_same_params(own, same, step=2)
    by_step = {r["step"]: r for r in _timed_records(own)}
    if mode == "own_process_ahead":
        assert by_step[1]["time/overlap_s"] > 0.0  # step 2 was sampled in the child while step 1 trained


def test_sigterm_with_rollouts_in_flight_checkpoints_them_and_the_rerun_equals_the_uninterrupted_run(
    runs, shared, tmp_path
):
    """k = 1, a SIGTERM while step 2's trees are being sampled ahead (during step 1): step 1 finishes, the stop waits
    for those rollouts (within the grace), checkpoints step 1 with the sampling side's state after them and keeps
    their trees beside it (exit 143); the rerun resumes at step 1, trains step 2 on those very trees and ends as the
    uninterrupted k = 1 run: records, summary, params. Fails if the stop drops the completed step 1 (the last
    checkpoint, step 0, stays the resume point: a step lost), if it checkpoints step 1 without the trees (the rerun
    samples step 2 with step 1's policy, not step 0's: another run), or if the notice kills the step under way."""
    from trace_jax.job.cli import ExitCode

    cache, compiled = shared
    workdir = tmp_path / "preempted"
    # A grace far longer than any step: the step under way and the rollouts always finish (no timing here).
    flags = [*OVERLAP, *AHEAD, "--config.rl.preemption_grace_s=1200"]
    command = main_job_command(workdir, cache, flags)
    driver = [sys.executable, "-c", SIGTERM_WHILE_SAMPLING_AHEAD_THEN_FINISH, *command[3:]]
    stopped = _run(driver, 2, compiled, ExitCode.PREEMPTED, timeout=600)
    assert "SIGTERM sent while sampling step 2 ahead" in stopped.stderr  # premise: the notice came mid-rollouts
    assert "stopped by SIGTERM after RL step 1" in stopped.stderr
    assert [r["step"] for r in records_without_timings(workdir)] == [0, 1]  # step 2 never trained
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [0, 1]
    assert (workdir / "sampled_ahead" / "1.pkl").is_file()
    assert not (workdir / "summary.json").exists()

    resumed = _run(command, 2, compiled)
    assert "resuming at RL step 1 of 2" in resumed.stderr
    reference = runs["ahead"]
    by_step = {r["step"]: r for r in records_without_timings(reference)}
    assert by_step[2]["rollout/staleness_max"] == 1.0  # premise: step 2 trained on trees one version old
    assert records_without_timings(workdir) == records_without_timings(reference)
    assert without_run_facts(_summary(workdir)) == without_run_facts(_summary(reference))
    assert _summary(workdir)["run"]["resumes"] == 1
    _assert_same_params(workdir, reference, step=2)


@pytest.mark.parametrize("mode, flags, devices", [("ahead", AHEAD, 2), ("own_process_ahead", OWN_PROCESS_AHEAD, 1)])
def test_sigterm_with_rollouts_that_miss_the_grace_drops_them_and_the_rerun_samples_them_again_bit_for_bit(
    runs, shared, tmp_path, mode, flags, devices
):
    """k = 1, a SIGTERM while step 2's trees are sampled ahead (during step 1), the rollouts then not done when the
    grace has no time left for them: step 1 finishes, the stop drops the rollouts and checkpoints step 1 with the
    sampling side's state from before they began and the weights that sampled them (the policy of step 0) beside
    it (exit 143); the rerun resumes at step 1, samples step 2 again with those weights from that state (the same
    trees, lag 1) and ends as the uninterrupted k = 1 run: records, summary, params. Fails if the stop drops the
    completed step 1 (step 0 stays the resume point), if the dropped rollouts are sampled again with the trainer's
    newer weights (the policy of step 1: lag 0, another run), if the sampling side's state saved is the one at the
    stop instead of at the launch (step 2 samples the prompts after the dropped ones), or if the rollouts' seeds
    or prompts are not restored at all. With the sampling side in a process of its own (``own_process_ahead``),
    the weights saved are the host copy last sent to it (the process is not asked while it may be sampling)."""
    from trace_jax.job.cli import ExitCode

    if mode not in runs:
        pytest.skip("needs 2 cores: one to sample on, one to train on")
    cache, compiled = shared
    workdir = tmp_path / "dropped"
    command = main_job_command(workdir, cache, [*OVERLAP, *flags, "--config.rl.preemption_grace_s=1200"])
    driver = [sys.executable, "-c", SIGTERM_AND_ROLLOUTS_THAT_MISS_THE_GRACE, *command[3:]]
    stopped = _run(driver, devices, compiled, ExitCode.PREEMPTED, timeout=600)
    assert "SIGTERM sent once step 2 was sampled ahead" in stopped.stderr  # premise: the rollouts moved the state
    assert "the next step's rollouts dropped" in stopped.stderr
    assert [r["step"] for r in records_without_timings(workdir)] == [0, 1]  # step 2 never trained
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [0, 1]
    assert (workdir / "dropped_ahead" / "1.pkl").is_file() and not (workdir / "sampled_ahead").exists()
    assert not (workdir / "summary.json").exists()

    resumed = _run(command, devices, compiled)
    assert "resuming at RL step 1 of 2" in resumed.stderr
    reference = runs[mode]
    records = records_without_timings(workdir)
    assert records[2]["rollout/staleness_max"] == 1.0  # sampled again with the policy of step 0
    assert records == records_without_timings(reference)
    assert without_run_facts(_summary(workdir)) == without_run_facts(_summary(reference))
    assert _summary(workdir)["run"]["resumes"] == 1
    _assert_same_params(workdir, reference, step=2)


def test_a_grace_that_runs_out_during_step_1_abandons_it_and_leaves_the_rollouts_in_flight_behind(
    runs, shared, tmp_path
):
    """k = 1, the same notice while step 2's trees are being sampled ahead, with no grace to finish step 1
    (``rl.preemption_grace_s=0``): step 1 is abandoned where it is (exit 143), its record and checkpoint are never
    written, step 0's checkpoint stays the resume point, and the process ends without waiting for the rollouts
    that never finish. Fails if the deadline is ignored (step 1 completes and is logged) or if the abandoned step
    waits for the rollouts in flight (``run.close(wait=True)`` in ``trace_jax.job.train``'s ``finally``:
    the process never ends and the run times out)."""
    from trace_jax.job.cli import ExitCode

    cache, compiled = shared  # ``runs`` first: its warm start and compiled programs are reused here
    workdir = tmp_path / "abandoned"
    command = main_job_command(workdir, cache, [*OVERLAP, *AHEAD, "--config.rl.preemption_grace_s=0"])
    driver = [sys.executable, "-c", SIGTERM_WHILE_SAMPLING_AHEAD, *command[3:]]
    stopped = _run(driver, 2, compiled, ExitCode.PREEMPTED, timeout=600)
    assert "SIGTERM sent while sampling step 2 ahead" in stopped.stderr  # premise: the notice came mid-rollouts
    assert "stopped by SIGTERM before the step under way ended" in stopped.stderr
    assert [r["step"] for r in records_without_timings(workdir)] == [0]
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [0]
    assert not (workdir / "summary.json").exists()


def test_a_step_abandoned_after_training_on_trees_sampled_ahead_keeps_the_step_before_it_with_them(
    runs, shared, tmp_path
):
    """k = 1, a SIGTERM while step 2 (its trees sampled ahead during step 1) builds its batch, with no grace: step 2
    is abandoned before its update, and the completed step 1, not checkpointed yet, is checkpointed with step 2's
    trees beside it and the sampling side's state after them (exit 143); the rerun resumes at step 1, trains step 2
    on those trees and ends as the uninterrupted k = 1 run. Fails if the abandoned step loses step 1 too (step 0
    stays the resume point) or if step 1 is checkpointed without the trees (the rerun samples step 2 with the
    policy of step 1: lag 0, another run)."""
    from trace_jax.job.cli import ExitCode

    cache, compiled = shared
    workdir = tmp_path / "abandoned_step_2"
    command = main_job_command(workdir, cache, [*OVERLAP, *AHEAD, "--config.rl.preemption_grace_s=0"])
    driver = [sys.executable, "-c", SIGTERM_WHILE_STEP_2_BUILDS_ITS_BATCH, *command[3:]]
    stopped = _run(driver, 2, compiled, ExitCode.PREEMPTED, timeout=600)
    assert "SIGTERM sent as step 2 builds its batch" in stopped.stderr  # premise: the notice came in step 2
    assert "stopped by SIGTERM before the step under way ended" in stopped.stderr
    assert [r["step"] for r in records_without_timings(workdir)] == [0, 1]
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [0, 1]
    assert (workdir / "sampled_ahead" / "1.pkl").is_file()

    resumed = _run(command, 2, compiled)
    assert "resuming at RL step 1 of 2" in resumed.stderr
    reference = runs["ahead"]
    assert records_without_timings(workdir) == records_without_timings(reference)
    assert without_run_facts(_summary(workdir)) == without_run_facts(_summary(reference))
    _assert_same_params(workdir, reference, step=2)


# The main job with step 3's rollouts sampled ahead during step 2 (the sampling side's prompt stream, seeds and
# predictor moved past them) before a SIGTERM is sent as step 2 builds its batch, which then never finishes: with no
# grace, step 2 is abandoned before its update with those rollouts done, whatever the load.
SIGTERM_AS_STEP_2_BUILDS_ITS_BATCH_AFTER_STEP_3_WAS_SAMPLED = """
import os, signal, sys, threading, time
from trace_jax.job import training
from trace_jax.job.sampling import SamplingSide
from trace_jax.job.commands import train_and_exit

build_batch, sample, calls = training.build_batch, SamplingSide.sample, []
step_3_sampled = threading.Event()

def sample_then_tell(self, step, version):
    sampled = sample(self, step, version)
    if step == 3 and threading.current_thread() is not threading.main_thread():
        step_3_sampled.set()
    return sampled

def build_batch_then_hang_at_step_2(*args, **kwargs):
    calls.append(None)
    if len(calls) == 2:
        step_3_sampled.wait()
        print("SIGTERM sent as step 2 builds its batch, step 3 sampled", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        while True:
            time.sleep(0.01)
    return build_batch(*args, **kwargs)

SamplingSide.sample = sample_then_tell
training.build_batch = build_batch_then_hang_at_step_2
sys.argv = ["trace_jax.train", *sys.argv[1:]]
train_and_exit()
"""
# Three steps, a checkpoint only at the last: step 2 trains on trees sampled ahead during step 1 and samples step 3
# ahead itself.
THREE_STEPS_AHEAD = [*OVERLAP, *AHEAD, "--config.rl.steps=3", "--config.rl.checkpoint_every=3"]


def test_a_step_abandoned_while_the_next_rollouts_ran_keeps_the_sampling_state_from_before_they_launched(
    shared, tmp_path
):
    """k = 1 over 3 steps, a SIGTERM with no grace while step 2 (its trees sampled ahead during step 1) builds its
    batch, once step 3's rollouts, launched by step 2, are sampled: step 2 is abandoned, the completed step 1 is
    checkpointed with step 2's trees beside it and the sampling side's state from when step 3's rollouts were
    launched; the rerun resumes at step 1 and ends as the uninterrupted 3-step run: records, summary, params. Fails
    if the state saved is the one at the stop (``Training.keep_last_step`` taking ``sampler.state_dict()`` instead
    of ``_launched``): it holds the prompts and seeds step 3's dropped rollouts consumed, so the rerun samples step 3
    from the prompts after them."""
    from trace_jax.job.cli import ExitCode

    cache, compiled = shared
    reference = tmp_path / "reference"
    _run(main_job_command(reference, cache, THREE_STEPS_AHEAD), 2, compiled)
    workdir = tmp_path / "abandoned_step_2"
    command = main_job_command(workdir, cache, [*THREE_STEPS_AHEAD, "--config.rl.preemption_grace_s=0"])
    driver = [sys.executable, "-c", SIGTERM_AS_STEP_2_BUILDS_ITS_BATCH_AFTER_STEP_3_WAS_SAMPLED, *command[3:]]
    stopped = _run(driver, 2, compiled, ExitCode.PREEMPTED, timeout=600)
    assert "SIGTERM sent as step 2 builds its batch, step 3 sampled" in stopped.stderr  # premise
    assert [r["step"] for r in records_without_timings(workdir)] == [0, 1]
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [0, 1]
    assert (workdir / "sampled_ahead" / "1.pkl").is_file()

    resumed = _run(command, 2, compiled)
    assert "resuming at RL step 1 of 3" in resumed.stderr
    records = records_without_timings(workdir)
    assert [r["rollout/staleness_max"] for r in records[2:]] == [1.0, 1.0]  # premise: steps 2 and 3 sampled ahead
    assert records == records_without_timings(reference)
    assert without_run_facts(_summary(workdir)) == without_run_facts(_summary(reference))
    _assert_same_params(workdir, reference, step=3)
