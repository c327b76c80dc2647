"""The main job with its sampling devices apart from the training ones, in turn (k = 0) and sampling one step ahead
(``rl.max_staleness = 1``), on 2 fake CPU devices, against the colocated run on 1 device (today's path).

The tiny run (``tests/job/test_train.TINY``: 3 steps, a checkpoint every 2) samples ahead only at step 1 (step 2
ends at a checkpoint, step 3 is the last), so at k = 1 step 2 trains on trees sampled by the policy of step 0.
"""

import json
import os
import subprocess

import numpy as np
import pytest

from tests.job.test_train import ROOT, command, final_params, records_without_timings, without_run_facts

pytestmark = pytest.mark.slow

APART = ["--config.mesh.rollout_devices=1"]
LAG_KEYS = ("rollout/staleness_mean", "rollout/staleness_max")


def _run(workdir, cache, flags, devices):
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    done = subprocess.run(
        command(workdir, cache) + flags, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return workdir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The colocated 1-device run first (it trains the warm start on 1 device, as the others then reuse it)."""
    cache = tmp_path_factory.mktemp("cache")
    base = tmp_path_factory.mktemp("run")
    return {
        "colocated": _run(base / "colocated", cache, [], devices=1),
        "apart": _run(base / "apart", cache, APART, devices=2),
        "ahead": _run(base / "ahead", cache, [*APART, "--config.rl.max_staleness=1"], devices=2),
    }


def _summary(workdir):
    return json.loads((workdir / "summary.json").read_text())


def test_sampling_devices_apart_give_the_colocated_run_bit_for_bit(runs):
    """k = 0 with the engine on its own device: the same records, summary and final params as the colocated run
    (fails if the weights reach the engine changed, late or not at all, or if k = 0 samples ahead)."""
    colocated, apart = runs["colocated"], runs["apart"]
    assert _summary(apart)["run"]["placement"] == {"training_devices": [1], "sampling_devices": [0]}
    assert records_without_timings(apart) == records_without_timings(colocated)
    assert without_run_facts(_summary(apart)) == without_run_facts(_summary(colocated))
    (step_a, params_a), (step_c, params_c) = final_params(apart), final_params(colocated)
    assert step_a == step_c == 3
    assert all(np.array_equal(a, c) for a, c in zip(params_a, params_c, strict=True))
    lines = [json.loads(line) for line in (apart / "metrics.jsonl").read_text().splitlines()]
    assert all("time/weight_sync_s" in r for r in lines if "alloc/effective_ratio" in r)
    assert not any(key in r for r in lines for key in LAG_KEYS)  # k = 0 logs no lag


def test_sampling_one_step_ahead_lags_by_one_version_where_it_overlaps_and_nowhere_else(runs):
    """k = 1: step 2's trees come from the policy of step 0 (lag 1), steps 1 and 3 sample in turn (lag 0); step 1
    itself is today's step 1; what follows from the sampled trees differs from step 2 on. Fails if the trees are
    sampled with the newest weights anyway (no lag: step 2 equals k = 0's), if the lag is logged wrong, if
    sampling ahead disturbs the step that launched it, or if a checkpoint step samples ahead."""
    ahead = {r["step"]: r for r in records_without_timings(runs["ahead"])}
    sync = {r["step"]: r for r in records_without_timings(runs["apart"])}
    assert [ahead[s]["rollout/staleness_max"] for s in (1, 2, 3)] == [0.0, 1.0, 0.0]
    assert [ahead[s]["rollout/staleness_mean"] for s in (1, 2, 3)] == [0.0, 1.0, 0.0]
    assert {k: v for k, v in ahead[1].items() if k not in LAG_KEYS} == sync[1]
    # Step 2 trains on other trees than k = 0's (sampled by the older policy): its figures move.
    assert {k: v for k, v in ahead[2].items() if k not in LAG_KEYS} != sync[2]
    timed = [json.loads(line) for line in (runs["ahead"] / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in timed}
    assert by_step[1]["time/overlap_s"] > 0.0 and by_step[2]["time/overlap_s"] == 0.0  # step 2 does not sample ahead
    summary, reference = _summary(runs["ahead"]), _summary(runs["apart"])
    for key in ("policy", "seed", "steps", "eval_before", "warm_start"):
        assert summary[key] == reference[key], key
