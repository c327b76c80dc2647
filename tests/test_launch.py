"""Launch scripts: --dry-run prints the exact commands, bad options and bad overrides fail before any cost.

The pod launcher's worker side (``launch/tpu_worker.sh``) runs here for real against a temporary run
directory: a detached job, its log and exit status, and stopping a leftover.
"""

import dataclasses
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tarfile
import time

import pytest

from trace_jax.configs import load_config_file, unknown_overrides
from trace_jax.plan.layout_overrides import layout_overrides

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHON": sys.executable}
POD = ["--tpu", "pod1", "--zone", "us-east5-a", "--workdir", "gs://bucket/run"]


def launch(script, *args):
    return subprocess.run(
        ["bash", str(ROOT / "launch" / script), *args], capture_output=True, text=True, timeout=60, env=ENV
    )


def commands(stdout: str) -> list[list[str]]:
    """The printed commands as argv lists (comment lines dropped)."""
    return [shlex.split(line) for line in stdout.splitlines() if line.strip() and not line.startswith("#")]


def gcloud(cmds, *words):
    return [c for c in cmds if c[0] == "gcloud" and all(w in c for w in words)]


def flag(cmd, name):
    return next(a.split("=", 1)[1] for a in cmd if a.startswith(f"--{name}="))


def test_tpu_pod_dry_run_ships_installs_and_starts_the_same_valid_command_on_every_worker():
    done = launch(
        "tpu_pod.sh",
        "--dry-run",
        *POD,
        "--create",
        "--env",
        "LIBTPU_INIT_ARGS=--x",
        "--",
        "--config.optim.learning_rate=1e-5",
    )
    assert done.returncode == 0, done.stderr
    cmds = commands(done.stdout)
    (create,) = gcloud(cmds, "create")
    assert create[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "create"] and create[5] == "pod1"
    assert "--accelerator-type=v5p-64" in create and "--version=v2-alpha-tpuv5" in create
    # The local checkout is packed and copied to every worker: no repository URL is involved.
    pack = next(c for c in cmds if "pod_helper.py" in " ".join(c) and "pack" in c)
    (scp,) = gcloud(cmds, "scp")
    assert scp[scp.index("scp") + 1] == pack[-1] and flag(scp, "worker") == "all"
    assert "git clone" not in done.stdout and "github" not in done.stdout
    ssh = gcloud(cmds, "ssh")
    install, start, stream = ssh
    assert [flag(c, "worker") for c in ssh] == ["all", "all", "0"]
    assert "tpu_worker.sh install 3.11" in flag(install, "command")
    assert "tar -xzf trace_jax_code.tgz" in flag(install, "command")
    assert flag(stream, "command").endswith("tpu_worker.sh logs")
    # One start command for all workers, so every host runs exactly the same job.
    remote = shlex.split(flag(start, "command"))
    assert remote[:3] == ["bash", "trace_jax_run/code/launch/tpu_worker.sh", "start"]
    env, job = remote[3 : remote.index("--")], remote[remote.index("--") + 1 :]
    assert env == ["LIBTPU_INIT_ARGS=--x"]
    assert job[:3] == ["python", "-m", "trace_jax.train"]
    assert "--config=configs/default.py" in job and "--workdir=gs://bucket/run" in job
    overrides = [a for a in job if a.startswith("--config.")]
    assert overrides == ["--config.distributed.mode=auto", "--config.optim.learning_rate=1e-5"]
    config = load_config_file(str(ROOT / "configs" / "default.py"))
    assert unknown_overrides(overrides, config) == []  # the config accepts what the workers will run


def test_tpu_pod_rejects_an_override_the_config_lacks_before_any_gcloud_command():
    bad = "--config.rl.learning_rate=1e-5"
    assert unknown_overrides([bad], load_config_file(str(ROOT / "configs" / "default.py")))  # premise
    done = launch("tpu_pod.sh", "--dry-run", *POD, "--create", "--", bad)
    assert done.returncode == 2
    assert "unknown config key 'rl.learning_rate'" in done.stderr and "optim.learning_rate" in done.stderr
    assert not gcloud(commands(done.stdout))


def test_tpu_pod_checks_overrides_against_the_chosen_config_file():
    done = launch("tpu_pod.sh", "--dry-run", *POD, "--config", "configs/ablation.py:uniform", "--", "--config.seed=3")
    assert done.returncode == 0, done.stderr
    assert "--config=configs/ablation.py:uniform" in done.stdout
    done = launch("tpu_pod.sh", "--dry-run", *POD, "--config", "configs/nope.py")
    assert done.returncode == 2 and "cannot load configs/nope.py" in done.stderr
    done = launch("tpu_pod.sh", "--dry-run", *POD, "--config", "/etc/elsewhere.py")
    assert done.returncode == 2 and "must be inside this checkout" in done.stderr
    done = launch("tpu_pod.sh", "--dry-run", *POD, "--config", str(ROOT / "configs" / "ablation.py") + ":uniform")
    assert done.returncode == 0, done.stderr
    assert "--config=configs/ablation.py:uniform" in done.stdout  # made relative: it runs from the shipped copy


def test_tpu_pod_queued_spot_slice_and_the_other_actions():
    done = launch("tpu_pod.sh", "--dry-run", *POD, "--queued", "--spot", "--accelerator", "v6e-16", "--no-stream")
    assert done.returncode == 0, done.stderr
    cmds = commands(done.stdout)
    (create,) = gcloud(cmds, "queued-resources", "create")
    assert "--node-id=pod1" in create and "--spot" in create and "--runtime-version=v2-alpha-tpuv6e" in create
    assert [flag(c, "worker") for c in gcloud(cmds, "ssh")] == ["all", "all"]  # no streaming
    stop = commands(launch("tpu_pod.sh", "--dry-run", "--tpu", "pod1", "--zone", "z", "--stop").stdout)
    assert (
        len(stop) == 1 and flag(stop[0], "worker") == "all" and flag(stop[0], "command").endswith("tpu_worker.sh stop")
    )
    logs = commands(launch("tpu_pod.sh", "--dry-run", "--tpu", "pod1", "--zone", "z", "--logs", "--worker", "3").stdout)
    assert flag(logs[0], "worker") == "3"
    delete = commands(launch("tpu_pod.sh", "--dry-run", "--tpu", "pod1", "--zone", "z", "--queued", "--delete").stdout)
    assert delete[-1][3:6] == ["queued-resources", "delete", "pod1"] and "--force" in delete[-1]


@pytest.mark.parametrize("how", ["--queued", "--create"])
def test_tpu_pod_watch_recreates_a_preempted_slice_and_relaunches_the_same_job_on_the_same_workdir(how):
    # --skip-check: the override check is covered above; this test reads the gcloud commands only.
    done = launch("tpu_pod.sh", "--dry-run", *POD, how, "--spot", "--watch", "--skip-check", "--", "--config.seed=3")
    assert done.returncode == 0, done.stderr
    cmds = commands(done.stdout)
    kind = "queued-resources" if how == "--queued" else "tpu-vm"
    ssh = lambda c: c[0] == "gcloud" and "ssh" in c
    starts = [i for i, c in enumerate(cmds) if ssh(c) and "tpu_worker.sh start" in flag(c, "command")]
    follow = [i for i, c in enumerate(cmds) if ssh(c) and flag(c, "command").endswith(" logs")]
    creates = [i for i, c in enumerate(cmds) if c[:6] == ["gcloud", "compute", "tpus", kind, "create", "pod1"]]
    (delete,) = [i for i, c in enumerate(cmds) if c[:6] == ["gcloud", "compute", "tpus", kind, "delete", "pod1"]]
    # The first start, then the watch follows worker 0 until the job ends; the relaunch round (printed as if
    # the slice were preempted) deletes the slice, makes it again the same way (spot) and starts again.
    assert len(starts) == 2 and len(creates) == 2 and len(follow) == 1
    assert creates[0] < starts[0] < follow[0] < delete < creates[1] < starts[1]
    assert all("--spot" in cmds[i] for i in creates)
    # The same job (same workdir, same overrides): the relaunched run resumes from the workdir's checkpoints.
    assert flag(cmds[starts[0]], "command") == flag(cmds[starts[1]], "command")
    job = shlex.split(flag(cmds[starts[1]], "command"))
    assert "--workdir=gs://bucket/run" in job and job[-1] == "--config.seed=3"
    assert "exited 143" in done.stdout  # the job's preemption exit code (trace_jax.job.cli.ExitCode.PREEMPTED)


def test_tpu_pod_help_prints_the_usage_block():
    """Fails if --help is refused as an unknown option or prints something other than the script's header."""
    done = launch("tpu_pod.sh", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Run the main job on every host")
    assert "--watch" in done.stdout and "set -euo" not in done.stdout and "\n#" not in done.stdout


@pytest.mark.parametrize("extra,kind", [([], "tpu-vm"), (["--queued"], "queued-resources")])
def test_tpu_pod_spot_alone_makes_a_spot_slice(extra, kind):
    """Fails if --spot without --create is refused, or makes anything but one spot slice (a spot create unless
    --queued asks for a queued spot request)."""
    done = launch("tpu_pod.sh", "--dry-run", *POD, "--spot", *extra, "--skip-check", "--no-stream")
    assert done.returncode == 0, done.stderr
    (create,) = gcloud(commands(done.stdout), "create")
    assert create[3:5] == [kind, "create"] and "--spot" in create


def test_the_launcher_and_the_job_agree_on_the_preemption_exit_code():
    from trace_jax.job.cli import ExitCode

    assert f"PREEMPTED={int(ExitCode.PREEMPTED)}" in (ROOT / "launch" / "tpu_pod.sh").read_text()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--dry-run"], "--tpu NAME and --zone ZONE are required"),
        ([*POD, "--watch"], "add --create or --queued"),
        ([*POD, "--create", "--watch", "--max-relaunches", "x"], "expected a number"),
        (["--dry-run", "--tpu", "p", "--zone", "z"], "--workdir gs://BUCKET/RUN is required"),
        (["--dry-run", "--tpu", "p", "--zone", "z", "--workdir", "/tmp/run"], "must be a gs:// bucket path"),
        ([*POD, "--create", "--queued"], "pick one"),
        ([*POD, "--accelerator", "v9-8"], "no default runtime"),
        ([*POD, "--env", "1X=2"], "expected KEY=VALUE"),
        ([*POD, "--python", "three"], "expected a version like 3.11"),
    ],
)
def test_tpu_pod_bad_options_fail_with_a_message(args, message):
    done = launch("tpu_pod.sh", *args)
    assert done.returncode == 2 and message in done.stderr


def test_pack_ships_the_working_tree_without_environments(tmp_path):
    out = tmp_path / "code.tgz"
    done = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "pod_helper.py"), "pack", str(out)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    with tarfile.open(out) as tar:
        names = tar.getnames()
    assert {"setup.py", "launch/tpu_worker.sh", "trace_jax/train.py", "configs/default.py"} <= set(names)
    assert not [n for n in names if n.startswith((".venv/", ".git/", "runs/")) or "__pycache__" in n]


# ------------------------------------------------------------------------------- the worker side, for real
def worker(run_dir, *args, timeout=60):
    env = {**ENV, "TRACE_JAX_RUN_DIR": str(run_dir), "TRACE_JAX_STOP_GRACE_S": "5"}
    return subprocess.run(
        ["bash", str(ROOT / "launch" / "tpu_worker.sh"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _pgid(run_dir):
    return int((run_dir / "job.pid").read_text())


def _alive(pgid):
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_worker_runs_the_job_detached_streams_its_log_and_reports_its_status(tmp_path):
    started = worker(tmp_path, "start", "GREETING=hello", "--", "bash", "-c", 'echo "$GREETING from the job"; exit 3')
    assert started.returncode == 0, started.stderr
    streamed = worker(tmp_path, "logs")
    assert "hello from the job" in streamed.stdout and "exit status 3" in streamed.stdout
    assert streamed.returncode == 3
    assert "finished with exit status 3" in worker(tmp_path, "status").stdout
    assert len(list((tmp_path / "logs").glob("*.log"))) == 1


def test_worker_stop_ends_a_leftover_job_and_its_children(tmp_path):
    # A job that ignores SIGTERM in a child, as a hung collective might: stop must still end the group.
    job = "trap '' TERM; sleep 300 & wait"
    assert worker(tmp_path, "start", "--", "bash", "-c", job).returncode == 0
    pgid = _pgid(tmp_path)
    try:
        assert _alive(pgid)
        refused = worker(tmp_path, "start", "--", "true")
        assert refused.returncode == 1 and "already running" in refused.stderr
        start = time.monotonic()
        stopped = worker(tmp_path, "stop")
        assert stopped.returncode == 0 and "SIGKILL" in stopped.stdout
        assert not _alive(pgid) and time.monotonic() - start < 30
        assert "stopped" in worker(tmp_path, "status").stdout
    finally:
        if _alive(pgid):
            os.killpg(pgid, 9)


def test_cpu_and_gpu_launchers_print_the_main_job():
    done = launch("cpu.sh", "--dry-run", "--workdir", "/tmp/w")
    assert done.returncode == 0
    assert "trace_jax.train\\ --config=configs/default.py\\ --workdir=/tmp/w" in done.stdout
    done = launch("gpu.sh", "--dry-run", "--num-hosts", "2", "--host-id", "1", "--coordinator", "10.0.0.1:1234")
    assert done.returncode == 0, done.stderr
    assert "distributed.coordinator_address=10.0.0.1:1234" in done.stdout
    assert "distributed.process_id=1" in done.stdout and "distributed.num_processes=2" in done.stdout


@pytest.mark.parametrize(
    "script,args,message",
    [
        ("cpu.sh", ["--bogus"], "unknown option: --bogus"),
        ("gpu.sh", ["--dry-run", "--num-hosts", "2"], "needs --coordinator"),
    ],
)
def test_bad_options_fail_with_a_message(script, args, message):
    done = launch(script, *args)
    assert done.returncode == 2 and message in done.stderr


def test_the_readme_pod_example_passes_the_launchers_own_checks():
    readme = (ROOT / "README.md").read_text()
    start = readme.index("launch/tpu_pod.sh --dry-run --project")
    parts = []  # the command's lines, up to the first that does not continue with a backslash
    for text in readme[start:].splitlines():
        parts.append(text.strip().removesuffix("\\"))
        if not text.rstrip().endswith("\\"):
            break
    line = " ".join(parts)
    for name, value in {"PROJECT": "p", "ZONE": "us-east5-a", "TPU_NAME": "t", "BUCKET": "b"}.items():
        line = line.replace(f"${name}", value)
    done = launch("tpu_pod.sh", *shlex.split(line)[1:])
    assert done.returncode == 0, done.stderr
    job = shlex.split(flag(gcloud(commands(done.stdout), "ssh")[1], "command"))
    assert "--config.model.hf_dir=gs://b/Qwen3-8B" in job and "--workdir=gs://b/runs/qwen3-8b" in job
    assert any(arg.startswith("--config=") and arg.endswith("configs/search_r1.py:qwen3-8b") for arg in job), job
    # The layout of the saved plan it names is the job's (not a mesh copied by hand).
    words = shlex.split(line)
    plan = json.loads((ROOT / words[words.index("--layout-from") + 1]).read_text())
    assert all(o in job for o in layout_overrides(plan)), job


# ------------------------------------------------------------------------------------------ the plan step
def test_tpu_pod_dry_run_prints_the_plan_step_before_the_slice_is_made():
    """Fails if the launcher stops compiling the job for the slice before creating it (the plan step missing,
    or placed after the create), or plans another accelerator than the one it creates."""
    done = launch("tpu_pod.sh", "--dry-run", *POD, "--create", "--accelerator", "v5p-128")
    assert done.returncode == 0, done.stderr
    cmds = commands(done.stdout)
    plan_at = next(i for i, c in enumerate(cmds) if "pod_helper.py" in " ".join(c) and "plan" in c)
    create_at = next(i for i, c in enumerate(cmds) if c[0] == "gcloud" and "create" in c)
    assert plan_at < create_at
    plan = cmds[plan_at]
    assert plan[plan.index("plan") + 1 : plan.index("plan") + 3] == ["v5p-128", "configs/default.py"]
    done = launch("tpu_pod.sh", "--dry-run", *POD, "--create", "--skip-plan")
    assert not any("plan" in c for c in commands(done.stdout) if "pod_helper.py" in " ".join(c))


def test_the_plan_step_compiles_the_configs_own_layout():
    """Fails if the plan step ignores the job's mesh, model preset, micro-batch rows, windowed matmuls, longest
    row or engine (it would check another program than the one the pod runs)."""
    sys.path.insert(0, str(ROOT / "launch"))
    import pod_helper

    overrides = ["--config.mesh.fsdp=8", "--config.ppo.micro_rows=16"]
    argv = pod_helper.plan_command("v5p-64", "configs/search_r1.py:qwen3-8b", overrides, ["--margin", "0.2"])
    value = lambda name: argv[argv.index(name) + 1]
    assert value("--model") == "qwen3-8b" and value("--topology") == "v5p-64"
    assert value("--mesh") == "data=1,fsdp=8,expert=1,tensor=4" and value("--micro-rows") == "16"
    assert value("--seq-len") == "4096" and value("--engine-len") == "4096" and value("--slots") == "128"
    assert "--require-fit" in argv and argv[-2:] == ["--margin", "0.2"]
    assert value("--windowed-einsum") == "on"
    unwindowed = [*overrides, "--config.ppo.windowed_einsum=false"]
    argv = pod_helper.plan_command("v5p-64", "configs/search_r1.py:qwen3-8b", unwindowed, [])
    assert value("--windowed-einsum") == "off"
    # --plan-layout's search compiles its pick both ways and keeps the faster
    argv = pod_helper.plan_command("v5p-64", "configs/search_r1.py:qwen3-8b", [], [], search=True)
    assert value("--windowed-einsum") == "auto" and "--mesh" not in argv


def _patch_default(monkeypatch, cls, name, value):
    """``cls()`` takes ``value`` for field ``name`` (a dataclass's defaults live in its ``__init__``)."""
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    defaults = list(cls.__init__.__defaults__)
    defaults[len(defaults) - len(names) + names.index(name)] = value
    monkeypatch.setattr(cls.__init__, "__defaults__", tuple(defaults))


def test_the_plan_step_reads_the_jobs_defaults_from_the_config_door(monkeypatch):
    """A section's default changed in its dataclass (``MeshConfig.expert``, which configs/default.py leaves alone)
    reaches the plan command: fails if pod_helper restates a default of its own (``mesh.get("expert", 1)``)."""
    sys.path.insert(0, str(ROOT / "launch"))
    import pod_helper

    from trace_jax.configs import MeshConfig

    value = lambda argv, name: argv[argv.index(name) + 1]
    argv = pod_helper.plan_command("v5p-8", "configs/default.py", [], [])
    assert value(argv, "--mesh") == "data=1,fsdp=-1,expert=1,tensor=1"
    _patch_default(monkeypatch, MeshConfig, "expert", 2)
    assert MeshConfig().expert == 2  # premise: the default changed
    argv = pod_helper.plan_command("v5p-8", "configs/default.py", [], [])
    assert value(argv, "--mesh") == "data=1,fsdp=-1,expert=2,tensor=1"


def _plan_launch(*plan_args):
    plan = ["--plan", "--plan-args", " ".join(("--backend", "cpu", *plan_args))]
    return subprocess.run(
        ["bash", str(ROOT / "launch" / "tpu_pod.sh"), "--dry-run", *POD, "--create", "--accelerator", "v5p-8", *plan],
        capture_output=True,
        text=True,
        timeout=900,
        env=ENV,
    )


@pytest.mark.slow
def test_tpu_pod_refuses_a_config_that_does_not_fit_before_any_gcloud_command():
    """Fails if a job whose compiled peak exceeds the chip's memory still reaches gcloud, or if the refusal
    hides the figures; the same job with the chip's real memory goes on to create the slice. (XLA:CPU
    stand-ins keep this fast; the TPU compiler is the default where libtpu is installed.)"""
    refused = _plan_launch("--memory-gib", "0.001")
    assert refused.returncode == 3, refused.stderr[-3000:]
    assert "does not fit v5p-8" in refused.stderr and "peak=" in refused.stderr
    assert not gcloud(commands(refused.stdout))
    accepted = _plan_launch()
    assert accepted.returncode == 0, accepted.stderr[-3000:]
    assert gcloud(commands(accepted.stdout), "create")


def test_worker_job_stopped_by_sigterm_reports_the_jobs_own_status(tmp_path):
    """A preemption notice (SIGTERM to the job's group) lets the job checkpoint and exit 143; `logs` must follow it
    to that end and report 143. Fails if the wrapper dies on the SIGTERM first (`logs` then ends while the job is
    still checkpointing, with no status: the watcher would take a preempted job for a failed one)."""
    job = "trap 'sleep 2; echo checkpointed; exit 143' TERM; echo ready; sleep 300 & wait"
    assert worker(tmp_path, "start", "--", "bash", "-c", job).returncode == 0
    pgid = _pgid(tmp_path)
    try:
        for _ in range(100):
            if "ready" in (tmp_path / "job.log").read_text():
                break
            time.sleep(0.1)
        os.killpg(pgid, 15)
        streamed = worker(tmp_path, "logs")
        assert "checkpointed" in streamed.stdout and streamed.returncode == 143, streamed.stdout
    finally:
        if _alive(pgid):
            os.killpg(pgid, 9)
