"""The pod user's journey, whole: ``launch/tpu_pod.sh --create --watch`` against a 2-host pod in a box.

The box (``tests/pod/fake_gcloud.py``) is a fake ``gcloud`` first on ``PATH``: each host is a local folder, the
launcher's ssh commands run there as local processes (the real ``launch/tpu_worker.sh``), and the hosts' jobs join
as one JAX job over 127.0.0.1. The workdir is ``gs://bucket/run`` in a local GCS emulator (tests/gcs_emulator.py).
The synthetic recipe exports no Hugging Face directory (only the real recipe does): a finished run is its final
checkpoint, ``summary.json`` and ``metrics.jsonl`` in the bucket. Its warm start is saved by every process
together (orbax), so the warm-start cache must be one directory all hosts share (here this machine's disk; on a
real pod a shared filesystem): a cache on each host's own disk hangs the hosts at that save.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from tests.helpers import TINY_MAIN_JOB, fake_cpu_devices
from tests.pod import fake_gcloud

ROOT = pathlib.Path(__file__).resolve().parents[2]
TPU = "box"
STEPS = 3
JOB = [*TINY_MAIN_JOB, f"--config.rl.steps={STEPS}", "--config.rl.checkpoint_every=1"]


@pytest.fixture
def box(tmp_path):
    """The box's root and the environment that puts its gcloud first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{fake_gcloud.__file__}" "$@"\n')
    gcloud.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_GCLOUD_ROOT": str(tmp_path / "box"),
        "FAKE_GCLOUD_HOSTS": "2",
        "PYTHON": sys.executable,
        "TMPDIR": str(tmp_path),
    }
    return tmp_path / "box", env


def launch_command(workdir, job_env, *flags):
    """``tpu_pod.sh --create --watch`` for a v5p-8 named box; ``job_env``: variables every host's job gets."""
    envs = [arg for key, value in job_env.items() for arg in ("--env", f"{key}={value}")]
    command = [
        "bash",
        str(ROOT / "launch" / "tpu_pod.sh"),
        *("--tpu", TPU, "--zone", "box-a", "--accelerator", "v5p-8", "--workdir", workdir),
        *("--create", "--watch", "--skip-plan", *envs, "--", *flags),
    ]  # fmt: skip
    return command


def launch_pod(env, workdir, job_env, *flags, timeout=1200):
    return subprocess.run(
        launch_command(workdir, job_env, *flags), capture_output=True, text=True, timeout=timeout, env=env
    )


def job_env(gcs):
    return {
        **gcs.env,
        "JAX_PLATFORMS": "cpu",
        "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
        "XLA_FLAGS": fake_cpu_devices(1),
    }


def creates(box):
    return [c for c in fake_gcloud.calls(box) if "create" in c]


def test_a_typo_in_an_override_is_refused_before_anything_is_created(box):
    """Fails if the launcher reaches gcloud (creates a slice) before finding the misspelt key."""
    root, env = box
    done = launch_pod(env, "gs://bucket/run", {}, "--config.rl.stepz=2", timeout=120)
    assert done.returncode == 2, done.stderr
    assert "rl.stepz" in done.stderr
    assert fake_gcloud.calls(root) == [] and not creates(root)


@pytest.mark.slow
def test_a_job_that_does_not_fit_is_refused_before_anything_is_created(box):
    """The plan step (XLA:CPU stand-in, a chip given 1 MiB) finds the job too big: exit 3 with the figures, and
    the box logs no gcloud call. Fails if the launcher creates the slice before it plans, or goes on after a
    refusal."""
    root, env = box
    command = launch_command("gs://bucket/run", {}, *JOB)
    at = command.index("--skip-plan")
    command[at : at + 1] = ["--plan", "--plan-args", "--backend cpu --memory-gib 0.001"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 3, done.stderr[-3000:]
    assert "does not fit v5p-8" in done.stderr and "peak=" in done.stderr
    assert fake_gcloud.calls(root) == []


def outcome(workdir):
    """What must not depend on a preemption: the summary and every step's metrics (timings aside), the final
    parameters."""
    import jax
    import numpy as np
    from etils import epath

    from trace_jax.checkpoint.state import StateCheckpointer

    run = epath.Path(workdir)
    summary = json.loads((run / "summary.json").read_text())
    summary.pop("run")  # timings, processes, resumes
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    records = [{k: v for k, v in r.items() if "time/" not in k} for r in records]
    restored = StateCheckpointer(workdir + "/checkpoints").restore_latest(keys=["params"])
    params = [np.asarray(x) for x in jax.tree.leaves(restored.state["params"])]
    return {"summary": summary, "records": records, "step": restored.step, "params": params}


def metrics_steps(workdir):
    from etils import epath

    path = epath.Path(workdir) / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


# Blocked: the two hosts' first orbax checkpoint into the emulated bucket fails in process 0 ("Error writing ...
# ocdbt.process_0/manifest.ocdbt: Malformed StorageGeneration", tensorstore's gcs driver against
# gcp-storage-emulator; one process saving there works) and process 1 then waits forever. Opt in to run it.
JOURNEYS = os.environ.get("TRACE_JAX_POD_JOURNEYS") == "1"


@pytest.mark.slow
@pytest.mark.skipif(not JOURNEYS, reason="blocked on multi-process orbax saves to the GCS emulator (see above)")
def test_a_preempted_pod_run_is_recreated_reshipped_and_ends_equal_to_an_uninterrupted_one(box, tmp_path):
    """An uninterrupted run (exit 0, both hosts one JAX job, its outputs in the bucket), then the same job
    preempted mid-run (SIGTERM to every host, the slice PREEMPTED): --watch deletes and recreates the slice, ships
    the code again and starts the same command, which resumes. Fails if the watcher does not re-ship (the
    recreated hosts have no code: the start fails), if the job resumes from step 0 or loses its data position
    (metrics repeat or differ), or if it ends other than the uninterrupted run (summary, metrics, parameters)."""
    import numpy as np

    from tests.gcs_emulator import gcs_emulator

    root, env = box
    shared = [*JOB, f"--config.warm_start.cache_dir={tmp_path / 'warm'}"]  # both runs: the same warm start
    with gcs_emulator("bucket") as gcs:
        whole = launch_pod(env, gcs.gs("whole"), job_env(gcs), *shared)
        assert whole.returncode == 0, whole.stderr[-6000:]
        assert len(creates(root)) == 1
        summary = json.loads(epath_text(gcs.gs("whole", "summary.json")))
        assert summary["steps"] == STEPS and summary["run"]["processes"]["processes"] == 2
        assert metrics_steps(gcs.gs("whole")) == list(range(STEPS + 1))
        watcher = subprocess.Popen(
            launch_command(gcs.gs("run"), job_env(gcs), *shared),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            deadline = time.monotonic() + 900
            while 1 not in metrics_steps(gcs.gs("run")) and watcher.poll() is None and time.monotonic() < deadline:
                time.sleep(1)
            assert watcher.poll() is None, watcher.communicate()[1][-6000:]
            fake_gcloud.preempt(root, TPU)
            _, stderr = watcher.communicate(timeout=1200)
        finally:
            if watcher.poll() is None:
                watcher.kill()
                watcher.wait()
        assert watcher.returncode == 0, stderr[-6000:]
        assert "relaunch 1 of" in stderr and len(creates(root)) == 2  # premise: it was preempted and recreated
        scps = [c for c in fake_gcloud.calls(root) if "scp" in c]
        assert len(scps) == 3  # shipped to each slice made: the first run's, then the preempted run's two
        summary = json.loads(epath_text(gcs.gs("run", "summary.json")))
        assert summary["run"]["resumes"] == 1
        preempted, uninterrupted = outcome(gcs.gs("run")), outcome(gcs.gs("whole"))
        assert preempted["step"] == uninterrupted["step"] == STEPS
        assert preempted["summary"] == uninterrupted["summary"]
        assert preempted["records"] == uninterrupted["records"]
        for a, b in zip(preempted["params"], uninterrupted["params"], strict=True):
            np.testing.assert_array_equal(a, b)


def epath_text(url):
    from etils import epath

    return epath.Path(url).read_text()
