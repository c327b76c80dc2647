"""The main job sampling one step ahead (``rl.max_staleness = 1``) in each behaviour mode: the behaviour log-probs
of trees sampled by the previous policy are that policy's, so the lag shows in the ratio of the step that trains
on them.

The runs (``tests/job/test_overlap_job.py``'s two-step job, one mini-batch an epoch) sample ahead at step 1 only:
step 2 trains on trees of the policy of step 0, which step 1's second epoch moved (its first has a learning rate
of 0, the warm-up's first step). With one mini-batch, ``epoch1/behaviour_gap`` is measured at the params the step
starts from, before any update of its own: at a step without lag it is 0 when the trainer recomputes the
behaviour log-probs, and at a lagged step it is the lag.

A SIGTERM whose rollouts sampled ahead miss the grace, in a mode that recomputes the behaviour log-probs, is the
last test here: the rerun samples them again and recomputes their log-probs under the params it kept for them.
"""

import json
import sys

import pytest

from tests.helpers import main_job_command
from tests.job.test_overlap_job import OVERLAP, SAMPLE_AHEAD, SIGTERM_AND_ROLLOUTS_THAT_MISS_THE_GRACE, _run
from tests.job.test_train import final_params, records_without_timings, without_run_facts

pytestmark = pytest.mark.slow

MODES = ("sampler", "recompute", "untruncated")
GAP = "train/epoch1/behaviour_gap"


def _flags(mode):
    return [*OVERLAP, *SAMPLE_AHEAD, "--config.ppo.mini_batches=1", f"--config.ppo.behaviour_logprobs={mode}"]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """(warm start cache, compilation cache, {mode: workdir}) of the k = 1 job in each behaviour mode."""
    cache, compiled = tmp_path_factory.mktemp("warm_start"), tmp_path_factory.mktemp("compiled")
    workdirs = {}
    for mode in MODES:
        workdirs[mode] = tmp_path_factory.mktemp(mode)
        _run(main_job_command(workdirs[mode], cache, _flags(mode)), 1, compiled)
    return cache, compiled, workdirs


@pytest.fixture(scope="module")
def records(jobs):
    """{mode: {step: record}} of the k = 1 job in each behaviour mode (one warm start, one compilation cache)."""
    out = {}
    for mode, workdir in jobs[2].items():
        lines = (workdir / "metrics.jsonl").read_text().splitlines()
        out[mode] = {r["step"]: r for r in map(json.loads, lines) if GAP in r}
    return out


@pytest.mark.parametrize("mode", MODES)
def test_a_lagged_step_measures_its_lag_in_every_behaviour_mode(records, mode):
    """Fails if "recompute" or "untruncated" recomputes the behaviour log-probs of lagged trees under the params
    being trained (their first ratio is then exactly 1 and the gap 0: the lag ignored), or if a mode that keeps
    the sampler's log-probs loses them."""
    steps = records[mode]
    assert steps[1]["rollout/staleness_max"] == 0.0 and steps[2]["rollout/staleness_max"] == 1.0  # premise
    assert steps[1]["train/grad_norm"] > 0  # premise: step 1 moves the policy that sampled step 2's trees
    assert steps[2][GAP] > 5e-3
    if mode != "sampler":  # in turn, the recomputed behaviour policy is the trained one: no gap at all
        assert steps[1][GAP] == pytest.approx(0.0, abs=1e-6)


def test_rollouts_dropped_by_a_sigterm_are_sampled_again_and_recomputed_under_the_params_kept_for_them(jobs, tmp_path):
    """ "recompute" on one device (the engine beside the trainer), the SIGTERM of
    ``test_overlap_job.SIGTERM_AND_ROLLOUTS_THAT_MISS_THE_GRACE``: step 2's rollouts are dropped, step 1 is
    checkpointed with the weights that sampled them, and the rerun ends as the uninterrupted run: records (the
    lagged step's behaviour gap among them), summary, params. Fails if the rerun recomputes the behaviour log-probs
    under the trainer's params (the gap of step 2 is 0) or loses the kept params (the step raises), or if the
    engine's weights are not the policy of step 0 again."""
    from trace_jax.job.cli import ExitCode

    cache, compiled, workdirs = jobs
    workdir = tmp_path / "dropped"
    command = main_job_command(workdir, cache, [*_flags("recompute"), "--config.rl.preemption_grace_s=1200"])
    driver = [sys.executable, "-c", SIGTERM_AND_ROLLOUTS_THAT_MISS_THE_GRACE, *command[3:]]
    stopped = _run(driver, 1, compiled, ExitCode.PREEMPTED, timeout=600)
    assert "the next step's rollouts dropped" in stopped.stderr  # premise: they were dropped, step 1 checkpointed
    resumed = _run(command, 1, compiled)
    assert "resuming at RL step 1 of 2" in resumed.stderr
    reference = workdirs["recompute"]
    records = records_without_timings(workdir)
    assert records[2][GAP] > 5e-3  # the lag, measured under the params that sampled the trees
    assert records == records_without_timings(reference)
    summary = lambda path: json.loads((path / "summary.json").read_text())
    assert without_run_facts(summary(workdir)) == without_run_facts(summary(reference))
    (step, params), (_, expected) = final_params(workdir), final_params(reference)
    assert step == 2 and all((a == b).all() for a, b in zip(params, expected, strict=True))
