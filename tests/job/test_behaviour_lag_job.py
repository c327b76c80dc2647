"""The main job sampling one step ahead (``rl.max_staleness = 1``) in each behaviour mode: the behaviour log-probs
of trees sampled by the previous policy are that policy's, so the lag shows in the ratio of the step that trains
on them.

The runs (``tests/job/test_overlap_job.py``'s two-step job, one mini-batch an epoch) sample ahead at step 1 only:
step 2 trains on trees of the policy of step 0, which step 1's second epoch moved (its first has a learning rate
of 0, the warm-up's first step). With one mini-batch, ``epoch1/behaviour_gap`` is measured at the params the step
starts from, before any update of its own: at a step without lag it is 0 when the trainer recomputes the
behaviour log-probs, and at a lagged step it is the lag.
"""

import json

import pytest

from tests.helpers import main_job_command
from tests.job.test_overlap_job import OVERLAP, SAMPLE_AHEAD, _run

pytestmark = pytest.mark.slow

MODES = ("sampler", "recompute", "untruncated")
GAP = "train/epoch1/behaviour_gap"


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """{mode: {step: record}} of the k = 1 job in each behaviour mode (one warm start, one compilation cache)."""
    cache, compiled = tmp_path_factory.mktemp("warm_start"), tmp_path_factory.mktemp("compiled")
    out = {}
    for mode in MODES:
        workdir = tmp_path_factory.mktemp(mode)
        flags = [*OVERLAP, *SAMPLE_AHEAD, "--config.ppo.mini_batches=1", f"--config.ppo.behaviour_logprobs={mode}"]
        _run(main_job_command(workdir, cache, flags), 1, compiled)
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
