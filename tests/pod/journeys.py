"""The pod in a box as a test fixture: a fake ``gcloud`` first on ``PATH`` (``tests/pod/fake_gcloud.py``), an
emulated bucket every host reaches (``tests/gcs_emulator.py``), and ``launch/tpu_pod.sh --create --watch`` run
against them as a user runs it, with the 2-host job on this machine's CPU."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys
import threading
import time

from tests.pod import fake_gcloud

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEARTBEAT_TIMEOUT_S = 10  # how long the surviving host waits on a silent peer before it stops (the job's key)


@dataclasses.dataclass
class Box:
    """The box's root (slices, call log) and the environment that puts its gcloud first on ``PATH``."""

    root: pathlib.Path
    env: dict[str, str]


def make_box(tmp_path: pathlib.Path, hosts: int = 2) -> Box:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{fake_gcloud.__file__}" "$@"\n')
    gcloud.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_GCLOUD_ROOT": str(tmp_path / "box"),
        "FAKE_GCLOUD_HOSTS": str(hosts),
        "PYTHON": sys.executable,
        "TMPDIR": str(tmp_path),
    }
    return Box(tmp_path / "box", env)


def launch_command(tpu, workdir, job_env, *flags, plan=("--skip-plan",), config=None):
    """``tpu_pod.sh --create --watch`` for a v5p-8 named ``tpu``; ``job_env``: variables every host's job gets;
    ``config``: the launcher's ``--config`` (a config file of the checkout; default: the launcher's own)."""
    envs = [arg for key, value in job_env.items() for arg in ("--env", f"{key}={value}")]
    return [
        "bash",
        str(ROOT / "launch" / "tpu_pod.sh"),
        *("--tpu", tpu, "--zone", "box-a", "--accelerator", "v5p-8", "--workdir", workdir),
        *(("--config", config) if config else ()),
        *("--create", "--watch", *plan, *envs, "--", *flags),
    ]  # fmt: skip


def host_log(box: Box, tpu: str, worker: int) -> str:
    """The host's current job log ("" before any start)."""
    hosts = fake_gcloud.host_dirs(box.root, tpu)
    log = hosts[worker] / "trace_jax_run" / "job.log" if len(hosts) > worker else None
    return log.read_text(errors="replace") if log is not None and log.exists() else ""


def host_logs(box: Box, tpu: str, worker: int) -> list[str]:
    """Every job log the host kept (one per start), oldest first."""
    hosts = fake_gcloud.host_dirs(box.root, tpu)
    logs = sorted((hosts[worker] / "trace_jax_run" / "logs").glob("*.log")) if len(hosts) > worker else []
    return [p.read_text(errors="replace") for p in logs]


class Launch:
    """The launcher running in the background, and a door to do something to the pod when a log line shows."""

    def __init__(self, box: Box, command: list[str], log: pathlib.Path):
        self.box, self.log_path = box, log
        self._log = open(log, "w")  # noqa: SIM115 (closed in finish)
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=box.env)

    def when(self, condition, action, timeout_s: float = 1500) -> dict:
        """Runs ``action()`` once ``condition()`` holds (polled in a thread while the launcher runs); the returned
        dict gets ``acted_at`` (``time.monotonic()``) when it ran, ``error`` if the action raised."""
        record: dict = {}

        def wait_then_act():
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    ready = condition()
                except Exception as e:  # an object being written, a busy server: look again
                    record["condition_error"] = repr(e)
                    ready = False
                if ready:
                    record["acted_at"] = time.monotonic()
                    try:
                        action()
                    except Exception as e:  # handed to the test, which asserts its premise
                        record["error"] = e
                    return
                time.sleep(0.2)

        threading.Thread(target=wait_then_act, daemon=True).start()
        return record

    def finish(self, timeout_s: float = 1500) -> tuple[int, str]:
        try:
            self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._log.close()
        return self.proc.returncode, self.log_path.read_text(errors="replace")
