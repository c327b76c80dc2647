"""``launch/tpu_pod.sh --slices N``: one multislice queued-resource request, the code shipped to every host of every
slice and the same job started everywhere with the MegaScale variables of its slice (``launch/slices.sh``).
``--dry-run`` prints the commands; the request's health check runs against a stand-in ``gcloud``."""

import shlex
import subprocess

import pytest

from tests.test_launch import POD, ROOT, commands, flag, gcloud, launch


def _slices_run(*args):
    done = launch("tpu_pod.sh", "--dry-run", *POD, "--slices", "2", "--skip-plan", *args)
    assert done.returncode == 0, done.stderr
    return commands(done.stdout)


def _starts(cmds):
    """(node, environment, job) of every start command, in order."""
    out = []
    for c in gcloud(cmds, "ssh"):
        remote = shlex.split(flag(c, "command"))
        if remote[:3] == ["bash", "trace_jax_run/code/launch/tpu_worker.sh", "start"]:
            env = dict(kv.split("=", 1) for kv in remote[3 : remote.index("--")])
            out.append((c[c.index("ssh") + 1], env, remote[remote.index("--") + 1 :]))
    return out


def test_one_request_for_all_slices_and_every_host_of_every_slice_starts_the_same_job():
    cmds = _slices_run("--", "--config.seed=3")  # the override check runs: the config accepts mesh.slices
    (create,) = gcloud(cmds, "queued-resources", "create")
    assert create[5] == "pod1" and "--node-count=2" in create and "--node-prefix=pod1" in create
    assert not any(a.startswith("--node-id") for a in create)
    # Slices are named PREFIX-0, PREFIX-1: each gets the code on all its workers and installs it, before any start.
    scps = gcloud(cmds, "scp")
    assert [c[c.index("scp") + 2].split(":")[0] for c in scps] == ["pod1-0", "pod1-1"]
    assert all(flag(c, "worker") == "all" for c in scps)
    installs = [c for c in gcloud(cmds, "ssh") if "tpu_worker.sh install" in flag(c, "command")]
    assert [c[c.index("ssh") + 1] for c in installs] == ["pod1-0", "pod1-1"]
    assert all(flag(c, "worker") == "all" for c in installs)
    starts = _starts(cmds)
    assert [node for node, _, _ in starts] == ["pod1-0", "pod1-1"]
    first_start = next(i for i, c in enumerate(cmds) if "tpu_worker.sh start" in " ".join(c))
    assert cmds.index(installs[-1]) < first_start
    # Each slice its own id; one coordinator (slice 0's worker 0), slice count and port for all.
    (describe,) = gcloud(cmds, "tpu-vm", "describe", "pod1-0")
    assert "networkEndpoints[0].ipAddress" in flag(describe, "format")
    assert [env["MEGASCALE_SLICE_ID"] for _, env, _ in starts] == ["0", "1"]
    for _, env, _ in starts:
        assert env["MEGASCALE_COORDINATOR_ADDRESS"] == "IP_OF_pod1-0_WORKER_0:8080"
        assert env["MEGASCALE_NUM_SLICES"] == "2" and env["MEGASCALE_PORT"] == "8080"
    # The same job everywhere, told how many slices it spans.
    jobs = [job for _, _, job in starts]
    assert jobs[0] == jobs[1] and "--config.mesh.slices=2" in jobs[0] and jobs[0][-1] == "--config.seed=3"


def test_watch_treats_a_preempted_slice_as_the_jobs_preemption_and_recreates_all_of_them():
    cmds = _slices_run("--spot", "--watch", "--skip-check")
    at = lambda *words: [i for i, c in enumerate(cmds) if c[0] == "gcloud" and all(w in c for w in words)]
    creates, (delete,) = at("queued-resources", "create"), at("queued-resources", "delete", "pod1")
    starts = [i for i, c in enumerate(cmds) if "tpu_worker.sh start" in " ".join(c)]
    assert len(creates) == 2 and len(starts) == 4
    assert creates[0] < starts[0] < starts[1] < delete < creates[1] < starts[2] < starts[3]
    assert all("--node-count=2" in cmds[i] and "--spot" in cmds[i] for i in creates)
    assert [flag(cmds[i], "command") for i in starts[:2]] == [flag(cmds[i], "command") for i in starts[2:]]


def test_the_other_actions_reach_every_slice():
    status = commands(
        launch("tpu_pod.sh", "--dry-run", "--tpu", "pod1", "--zone", "z", "--slices", "2", "--status").stdout
    )
    assert [c[c.index("ssh") + 1] for c in status] == ["pod1-0", "pod1-1"]
    delete = commands(
        launch("tpu_pod.sh", "--dry-run", "--tpu", "pod1", "--zone", "z", "--slices", "3", "--delete").stdout
    )
    assert [c[c.index("ssh") + 1] for c in delete[:-1]] == ["pod1-0", "pod1-1", "pod1-2"]
    assert delete[-1][3:6] == ["queued-resources", "delete", "pod1"]
    logs = commands(launch("tpu_pod.sh", "--dry-run", "--tpu", "pod1", "--zone", "z", "--slices", "2", "--logs").stdout)
    assert [c[c.index("ssh") + 1] for c in logs] == ["pod1-0"]


def _state(qr: str, nodes: dict[str, str]) -> str:
    """``slices_state`` of 2 slices with a stand-in ``gcloud`` answering the request's and each node's state."""
    cases = "".join(f'    *"describe {name} "*) echo {state} ;;\n' for name, state in nodes.items())
    script = f"""
set -euo pipefail
gcloud() {{
  case "$*" in
    *queued-resources*) echo {qr} ;;
{cases}    *) return 1 ;;
  esac
}}
. launch/slices.sh
TPU=pod1; SLICES=2; SCOPE=(--zone=z); VM=(gcloud compute tpus tpu-vm); QR=(gcloud compute tpus queued-resources)
slices_state
"""
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_any_slice_down_makes_the_request_unhealthy():
    assert _state("ACTIVE", {"pod1-0": "READY", "pod1-1": "READY"}) == "ACTIVE"
    assert _state("ACTIVE", {"pod1-0": "READY", "pod1-1": "PREEMPTED"}) == "PREEMPTED (pod1-1)"
    assert _state("ACTIVE", {"pod1-0": "READY"}) == "GONE (pod1-1)"
    assert _state("SUSPENDED", {"pod1-0": "READY", "pod1-1": "READY"}) == "SUSPENDED"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--slices", "0"], "--slices 0: expected a number of slices >= 1"),
        (["--slices", "two"], "--slices two: expected a number"),
        (["--slices", "2", "--create"], "several slices come from one queued-resource request; drop --create"),
    ],
)
def test_bad_slice_options_fail_with_a_message(args, message):
    done = launch("tpu_pod.sh", "--dry-run", *POD, *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_the_plan_step_plans_each_slice_and_the_engines_cache_as_the_job_runs_them():
    """The launch-time plan gets the job's ``mesh.slices`` and ``engine.cache_dtype``: fails if pod_helper drops
    either (a 2-slice job planned as one slice holding every row; an int8 cache planned as bf16)."""
    import sys

    sys.path.insert(0, str(ROOT / "launch"))
    import pod_helper

    plain = pod_helper.plan_command("v5p-8", "configs/default.py", [], [])
    assert "--slices" not in plain and "--kv-dtype" not in plain
    job = ["--config.mesh.slices=2", "--config.engine.cache_dtype=int8"]
    argv = pod_helper.plan_command("v5p-8", "configs/default.py", job, [])
    assert argv[argv.index("--slices") + 1] == "2" and argv[argv.index("--kv-dtype") + 1] == "int8"
