"""Launch scripts: --dry-run prints the exact commands, bad options fail clearly."""

import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def launch(script, *args):
    return subprocess.run(["bash", str(ROOT / "launch" / script), *args], capture_output=True, text=True, timeout=30)


def test_tpu_pod_dry_run_creates_then_runs_the_same_command_on_every_worker():
    done = launch(
        "tpu_pod.sh",
        "--dry-run",
        "--tpu",
        "pod1",
        "--zone",
        "us-east5-a",
        "--create",
        "--",
        "--config.rl.learning_rate=1e-5",
    )
    assert done.returncode == 0, done.stderr
    create, ssh = done.stdout.strip().splitlines()
    assert "tpu-vm create pod1" in create and "--accelerator-type=v5p-32" in create
    assert "--worker=all" in ssh
    assert "python\\ -m\\ trace_jax.train\\ --config=configs/default.py" in ssh
    assert "--config.rl.learning_rate=1e-5" in ssh and "--config.distributed.mode=auto" in ssh


def test_gpu_multi_host_passes_the_coordinator_as_config_overrides():
    done = launch("gpu.sh", "--dry-run", "--num-hosts", "2", "--host-id", "1", "--coordinator", "10.0.0.1:1234")
    assert done.returncode == 0, done.stderr
    assert "distributed.coordinator_address=10.0.0.1:1234" in done.stdout
    assert "distributed.process_id=1" in done.stdout and "distributed.num_processes=2" in done.stdout


def test_cpu_dry_run_prints_the_main_job():
    done = launch("cpu.sh", "--dry-run", "--workdir", "/tmp/w")
    assert done.returncode == 0
    assert "trace_jax.train\\ --config=configs/default.py\\ --workdir=/tmp/w" in done.stdout


@pytest.mark.parametrize(
    "script,args,message",
    [
        ("cpu.sh", ["--bogus"], "unknown option: --bogus"),
        ("tpu_pod.sh", ["--dry-run"], "--tpu NAME and --zone ZONE are required"),
        ("gpu.sh", ["--dry-run", "--num-hosts", "2"], "needs --coordinator"),
    ],
)
def test_bad_options_fail_with_a_message(script, args, message):
    done = launch(script, *args)
    assert done.returncode == 2 and message in done.stderr
