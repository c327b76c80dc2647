"""The pod user's launch, against a 2-host pod in a box: mistakes are refused before anything is created.

The box (``tests/pod/fake_gcloud.py``) is a fake ``gcloud`` first on ``PATH``: each host is a local folder, the
launcher's ssh commands run there as local processes (the real ``launch/tpu_worker.sh``), and every call is logged,
so a test can assert that no slice was created.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from tests.helpers import TINY_MAIN_JOB
from tests.pod import fake_gcloud

ROOT = pathlib.Path(__file__).resolve().parents[2]
TPU = "box"
JOB = [*TINY_MAIN_JOB, "--config.rl.steps=3"]


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
