"""The pod user's journey, run whole against a 2-host pod in a box: launched with ``tpu_pod.sh --create --watch``
into an emulated bucket, it ends with its outputs there (a); preempted mid-step, the watcher recreates the slice,
ships, starts, and the run resumes to the same end (b); with one host SIGKILLed mid-step, the other stops within
the heartbeat bound naming the lost process, the watcher relaunches, and the run ends the same (c); a mistake is
refused before anything is created (d).

The box (``tests/pod/fake_gcloud.py``, ``tests/pod/journeys.py``) is a fake ``gcloud`` first on ``PATH``: each host
is a local folder, the launcher's ssh commands run there as local processes (the real ``launch/tpu_worker.sh``),
the hosts join one JAX job over 127.0.0.1 (the synthetic recipe on CPU, the smallest config that does a few RL
steps), and every call is logged. The three runs share one warm-start cache (in the bucket) and one compilation
cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import jax
import numpy as np
import pytest
from etils import epath

from tests.gcs_emulator import gcs_emulator
from tests.helpers import TINY_MAIN_JOB
from tests.pod import fake_gcloud
from tests.pod.journeys import HEARTBEAT_TIMEOUT_S, Launch, host_log, host_logs, launch_command, make_box
from trace_jax.checkpoint.state import StateCheckpointer

STEPS = 3
JOB = [*TINY_MAIN_JOB, f"--config.rl.steps={STEPS}"]
LOST_HOST_BOUND_S = 60  # the promised bound on the surviving host's stop; the heartbeat timeout is well inside it


@pytest.fixture
def box(tmp_path):
    return make_box(tmp_path)


@pytest.fixture(scope="module")
def pod(tmp_path_factory):
    """A box, an emulated bucket, and the job's flags and environment for every run of this module."""
    tmp = tmp_path_factory.mktemp("pod")
    with gcs_emulator("bucket") as gcs:
        job_env = {
            **gcs.env,
            "JAX_PLATFORMS": "cpu",
            "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
            "JAX_COMPILATION_CACHE_DIR": str(tmp / "compiled"),  # one cache: the later runs skip most compiles
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        }
        flags = [
            *JOB,
            "--config.rl.checkpoint_every=1",
            f"--config.warm_start.cache_dir={gcs.gs('warm_start')}",  # in the bucket: no shared filesystem
            f"--config.distributed.heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}",
        ]
        box = make_box(tmp)
        try:
            yield {"box": box, "gcs": gcs, "job_env": job_env, "flags": flags, "tmp": tmp}
        finally:
            for slice_dir in (box.root / "slices").glob("*"):
                fake_gcloud.delete(box.root, slice_dir.name)  # kills whatever still runs there


def start(pod, tpu):
    command = launch_command(tpu, pod["gcs"].gs(tpu), pod["job_env"], *pod["flags"])
    return Launch(pod["box"], command, pod["tmp"] / f"{tpu}.launch.log")


def in_rl_step_1(pod, tpu):
    """True once host 0's job has opened its RL loop: step 1 (of 3) is under way, inside the job's SIGTERM grace
    (it finishes the step, checkpoints it and exits 143)."""
    return lambda: f"TRACE RL: 0/{STEPS}" in host_log(pod["box"], tpu, 0)


def outcome(pod, tpu):
    """What the run left in the bucket: its final params, summary (timings aside) and metrics (timings aside)."""
    workdir = epath.Path(pod["gcs"].gs(tpu))
    restored = StateCheckpointer(workdir / "checkpoints").restore_latest(keys=["params"])
    summary = json.loads((workdir / "summary.json").read_text())
    metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {
        "step": restored.step,
        "params": [np.asarray(x) for x in jax.tree.leaves(restored.state["params"])],
        "summary": drop_timings(summary),
        "metrics": [drop_timings(m) for m in metrics],
    }


def drop_timings(record):
    if isinstance(record, dict):
        return {k: drop_timings(v) for k, v in record.items() if "time" not in k and not k.endswith("_s")}
    if isinstance(record, list):
        return [drop_timings(v) for v in record]
    return record


def assert_same_run(got, want, resumes):
    """Equal runs but for timings and the count of resumes (the relaunched run's own record of them)."""
    assert got["summary"]["run"].pop("resumes") == resumes and want["summary"]["run"].pop("resumes", 0) == 0
    assert got["step"] == want["step"] == STEPS
    assert [m.get("step") for m in got["metrics"]] == [m.get("step") for m in want["metrics"]]
    assert got["metrics"] == want["metrics"]
    assert got["summary"] == want["summary"]
    for a, b in zip(got["params"], want["params"], strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def uninterrupted(pod):
    """Journey a, run once: its exit status, launcher output and outcome (the reference of b and c)."""
    code, output = start(pod, "box-a").finish()
    assert code == 0, output[-5000:]
    return {"output": output, **outcome(pod, "box-a")}


def test_a_an_uninterrupted_run_ends_with_its_outputs_in_the_bucket(pod, uninterrupted):
    """Fails if the job's outputs (summary, metrics, the final checkpoint) do not reach the bucket."""
    assert "watch: the job finished (exit status 0)" in uninterrupted["output"]
    workdir = epath.Path(pod["gcs"].gs("box-a"))
    assert {"summary.json", "metrics.jsonl", "checkpoints"} <= {p.name for p in workdir.iterdir()}
    assert [m["step"] for m in uninterrupted["metrics"] if "step" in m][-1] == STEPS
    assert uninterrupted["step"] == STEPS
    assert any(n.endswith("/warm_start.json") for n in pod["gcs"].names("warm_start/")), "the warm start, complete"
    creates = [c for c in fake_gcloud.calls(pod["box"].root) if c[3:5] == ["create", "box-a"]]
    assert len(creates) == 1


def test_b_a_run_preempted_mid_step_is_recreated_and_resumes_to_the_same_end(pod, uninterrupted):
    """Mutants caught: a watcher that relaunches without shipping to the recreated slice (its hosts have no code:
    the start fails), and a job that resumes from step 0 (its metrics repeat steps)."""
    launch = start(pod, "box-b")
    preempted = launch.when(in_rl_step_1(pod, "box-b"), lambda: fake_gcloud.preempt(pod["box"].root, "box-b"))
    code, output = launch.finish()
    assert "acted_at" in preempted and "error" not in preempted, f"premise: preempted mid-step {preempted}"
    assert code == 0, output[-5000:]
    assert "relaunch 1 of" in output and "slice PREEMPTED" in output, "premise: the slice was preempted"
    creates = [c for c in fake_gcloud.calls(pod["box"].root) if c[3:5] == ["create", "box-b"]]
    assert len(creates) == 2, "the watcher recreates the preempted slice once"
    resumed = host_logs(pod["box"], "box-b", 0)[-1]  # the preempted slice's hosts went with it
    assert f"resuming at RL step 1 of {STEPS}" in resumed, resumed[-3000:]  # premise: step 1 was checkpointed
    assert_same_run(
        outcome(pod, "box-b"), dict(uninterrupted, summary=json.loads(json.dumps(uninterrupted["summary"]))), 1
    )


def test_c_a_host_killed_mid_step_stops_its_peer_within_the_bound_and_the_run_ends_the_same(pod, uninterrupted):
    """Mutants caught: peers that wait on (``distributed.heartbeat_timeout_s`` not passed to jax: the default 100 s
    overruns the bound), and a watcher that gives up on a job that failed on a healthy slice."""
    box, tpu = pod["box"], "box-c"
    stopped = {}

    def kill_host_1_and_time_host_0():
        survivor = fake_gcloud.job_group(box.root, tpu, 0)
        fake_gcloud.kill_host(box.root, tpu, 1)
        killed_at = time.monotonic()
        while time.monotonic() - killed_at < 300:
            try:
                os.killpg(survivor, 0)
            except ProcessLookupError:
                stopped["after_s"] = time.monotonic() - killed_at
                return
            time.sleep(0.2)

    launch = start(pod, tpu)
    killed = launch.when(in_rl_step_1(pod, tpu), kill_host_1_and_time_host_0)
    code, output = launch.finish()
    assert "acted_at" in killed and "error" not in killed, f"premise: host 1 killed mid-step {killed}"
    assert "after_s" in stopped, f"premise: host 1 was killed mid-step and host 0 stopped:\n{output[-5000:]}"
    print(f"host 0 stopped {stopped['after_s']:.1f} s after host 1 was killed")
    assert stopped["after_s"] <= LOST_HOST_BOUND_S
    first = host_logs(box, tpu, 0)[0]
    assert "heartbeat" in first and "Task 1" in first, first[-3000:]  # names the lost process
    assert code == 0, output[-5000:]
    assert "relaunch 1 of" in output
    assert_same_run(outcome(pod, tpu), dict(uninterrupted, summary=json.loads(json.dumps(uninterrupted["summary"]))), 1)


def test_d_a_typo_in_an_override_is_refused_before_anything_is_created(box):
    """Fails if the launcher reaches gcloud (creates a slice) before finding the misspelt key."""
    done = subprocess_run(launch_command("box", "gs://bucket/run", {}, "--config.rl.stepz=2"), box.env, 120)
    assert done.returncode == 2, done.stderr
    assert "rl.stepz" in done.stderr
    assert fake_gcloud.calls(box.root) == []


@pytest.mark.slow
def test_d_a_job_that_does_not_fit_is_refused_before_anything_is_created(box):
    """The plan step (XLA:CPU stand-in, a chip given 1 MiB) finds the job too big: exit 3 with the figures, and
    the box logs no gcloud call. Fails if the launcher creates the slice before it plans, or goes on after a
    refusal."""
    plan = ("--plan", "--plan-args", "--backend cpu --memory-gib 0.001")
    done = subprocess_run(launch_command("box", "gs://bucket/run", {}, *JOB, plan=plan), box.env, 900)
    assert done.returncode == 3, done.stderr[-3000:]
    assert "does not fit v5p-8" in done.stderr and "peak=" in done.stderr
    assert fake_gcloud.calls(box.root) == []


def subprocess_run(command, env, timeout):
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
