"""A pod in a box: a fake ``gcloud`` that implements exactly the calls ``launch/tpu_pod.sh`` makes, for tests.

A slice is a folder of host folders under the box's root (``FAKE_GCLOUD_ROOT``); ``ssh --command`` runs the
command with ``bash`` in each addressed host's folder (its ``HOME``), as a local process, so the real
``launch/tpu_worker.sh`` runs there. Every call is logged, one JSON argv a line, in ``calls.jsonl``.

What a host gets (in place of a TPU VM's image and metadata):

- a minimal environment: ``HOME``, the system ``PATH``, and ``TRACE_JAX_VENV`` (this machine's environment, so
  the worker's install step links it instead of installing from the network: see ``launch/tpu_worker.sh``);
- its identity in the pod as variables that ``jax.distributed.initialize()`` auto-detects (the SLURM ones:
  process id, process count, the coordinator host and a port fixed when the slice is made), so the job's
  ``--config.distributed.mode=auto`` joins the hosts into one JAX job as on a real slice.

Faults, driven by the test through the functions below (or this module's CLI ``fault ...``):
``preempt`` (the slice reports ``PREEMPTED`` until it is deleted; every host's job gets a SIGTERM, then a SIGKILL
after a grace),
``kill_host`` (SIGKILL one host's job), and an ``ssh_fail/<worker>`` file (ssh to that host exits 255).

    gcloud compute tpus tpu-vm create|describe|delete|ssh|scp ...
    gcloud compute tpus queued-resources create|describe|delete ...   (create: --node-id, or --node-count and
                                                                     --node-prefix for several slices)
    gcloud storage buckets create gs://B [--project=P] [--location=L]
    gcloud storage cp -r SRC... gs://B/[PREFIX/]

The two ``storage`` calls (the README's step 1) act on the GCS emulator that ``STORAGE_EMULATOR_HOST`` names
(``tests/gcs_emulator.py``) through the real client (gcsfs behind epath), and are refused without it: nothing here
reaches a real bucket. ``cp`` keeps each source's basename under the destination, as ``gcloud storage cp -r`` does.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

HOSTS = int(os.environ.get("FAKE_GCLOUD_HOSTS", "2"))


def root() -> pathlib.Path:
    return pathlib.Path(os.environ["FAKE_GCLOUD_ROOT"])


def slice_dir(box: pathlib.Path, name: str) -> pathlib.Path:
    return box / "slices" / name


def host_dirs(box: pathlib.Path, name: str) -> list[pathlib.Path]:
    return sorted((slice_dir(box, name) / "hosts").glob("*"), key=lambda p: int(p.name))


def calls(box: pathlib.Path) -> list[list[str]]:
    """Every gcloud call so far, as argv lists."""
    log = box / "calls.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _meta(box, name):
    path = slice_dir(box, name) / "slice.json"
    return json.loads(path.read_text()) if path.exists() else None


def _save(box, name, meta):
    (slice_dir(box, name) / "slice.json").write_text(json.dumps(meta))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _job_groups(box, name):
    groups = []
    for host in host_dirs(box, name):
        pid_file = host / "trace_jax_run" / "job.pid"
        if pid_file.exists() and pid_file.read_text().strip():
            groups.append(int(pid_file.read_text()))
    return groups


def _signal(pgid, sig):
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


def preempt(box: pathlib.Path, name: str, grace_s: float = 120) -> None:
    """What a preemption does: the slice reports ``PREEMPTED`` from the notice on, every host's job gets a SIGTERM
    and a grace to checkpoint, then whatever still runs is killed. The slice stays until it is deleted."""
    meta = _meta(box, name)
    meta["state"] = "PREEMPTED"
    _save(box, name, meta)
    groups = _job_groups(box, name)
    for pgid in groups:
        _signal(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_signal(g, 0) for g in groups):
        time.sleep(0.5)
    for pgid in groups:
        _signal(pgid, signal.SIGKILL)


def job_group(box: pathlib.Path, name: str, worker: int) -> int:
    """The process group of the host's current job (its wrapper's pid, ``job.pid``)."""
    return int((host_dirs(box, name)[worker] / "trace_jax_run" / "job.pid").read_text())


def kill_host(box: pathlib.Path, name: str, worker: int) -> None:
    """SIGKILL one host's job (its whole process group), as a host that dies without notice."""
    _signal(job_group(box, name, worker), signal.SIGKILL)


def _flag(args, name, default=None):
    for a in args:
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
    return default


def _create(box, name, args, kind):
    """One slice named ``name`` (a TPU VM, or a queued resource's one node), or, for a queued resource with
    ``--node-count=N --node-prefix=P``, the request ``name`` and its N slices ``P-0`` .. ``P-(N-1)`` (TPU VMs)."""
    count, prefix = int(_flag(args, "node-count", "1")), _flag(args, "node-prefix")
    nodes = [f"{prefix}-{i}" for i in range(count)] if kind == "queued" and prefix else []
    if any(_meta(box, n) for n in (name, *nodes)):
        print(f"ERROR: (gcloud) {name} already exists", file=sys.stderr)
        return 1
    spot = "--spot" in args
    for node in nodes:
        _make_slice(box, node, {"state": "READY", "kind": "vm", "spot": spot, "request": name})
    hosts = 0 if nodes else HOSTS
    state = "ACTIVE" if kind == "queued" else "READY"
    _make_slice(box, name, {"state": state, "kind": kind, "spot": spot, "nodes": nodes}, hosts)
    return 0


def _make_slice(box, name, meta, hosts=HOSTS):
    for i in range(hosts):
        (slice_dir(box, name) / "hosts" / str(i)).mkdir(parents=True)
    slice_dir(box, name).mkdir(parents=True, exist_ok=True)
    _save(box, name, {**meta, "port": free_port()})


def _describe(box, name, kind, args=()):
    meta = _meta(box, name)
    if not meta or meta["kind"] != kind:
        print(f"ERROR: (gcloud) NOT_FOUND: {name}", file=sys.stderr)
        return 1
    if _flag(args, "format") == "value(networkEndpoints[0].ipAddress)":
        print("127.0.0.1")  # worker 0's internal IP: every host of the box is this machine
        return 0
    state = meta["state"]
    if kind == "queued" and state == "PREEMPTED":
        state = "SUSPENDED"  # a queued resource whose slice was preempted
    print(state)
    return 0


def delete(box: pathlib.Path, name: str) -> int:
    """Deletes the slice (its hosts' jobs are killed first); 1 with gcloud's message when there is none."""
    if not _meta(box, name):
        print(f"ERROR: (gcloud) NOT_FOUND: {name}", file=sys.stderr)
        return 1
    for node in _meta(box, name).get("nodes", []):  # a queued resource's slices go with it
        delete(box, node)
    for pgid in _job_groups(box, name):
        _signal(pgid, signal.SIGKILL)
    shutil.rmtree(slice_dir(box, name))
    return 0


def _workers(box, name, args):
    which = _flag(args, "worker", "0")
    hosts = host_dirs(box, name)
    return list(range(len(hosts))) if which == "all" else [int(which)]


def _host_env(box, name, worker):
    meta = _meta(box, name)
    return {
        "HOME": str(host_dirs(box, name)[worker]),
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "TRACE_JAX_VENV": sys.prefix,
        "SLURM_JOB_ID": "1",
        "SLURM_STEP_NODELIST": "127.0.0.1",
        "SLURM_NTASKS": str(len(host_dirs(box, name))),
        "SLURM_PROCID": str(worker),
        "SLURM_LOCALID": "0",
        "JAX_COORDINATOR_PORT": str(meta["port"]),
    }


def _ssh(box, name, args):
    if not _meta(box, name) or _meta(box, name)["state"] not in ("READY", "ACTIVE"):
        print(f"ERROR: (gcloud) ssh: {name} is not reachable", file=sys.stderr)
        return 255
    command = _flag(args, "command")
    procs = []
    for worker in _workers(box, name, args):
        if (box / "ssh_fail" / str(worker)).exists():
            print(f"ssh: connect to worker {worker}: Connection refused", file=sys.stderr)
            procs.append(None)
            continue
        host = host_dirs(box, name)[worker]
        procs.append(subprocess.Popen(["bash", "-c", command], cwd=host, env=_host_env(box, name, worker)))
    codes = [255 if p is None else p.wait() for p in procs]
    return next((c for c in codes if c), 0)


def _scp(box, args):
    src, dest = [a for a in args if not a.startswith("--")][:2]
    name, path = dest.split(":", 1)
    for worker in _workers(box, name, args):
        shutil.copy(src, host_dirs(box, name)[worker] / path)
    return 0


def _emulated(command: str) -> bool:
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        return True
    print(f"fake gcloud: storage {command} needs STORAGE_EMULATOR_HOST (a GCS emulator): refused", file=sys.stderr)
    return False


def _buckets_create(args):
    """``storage buckets create gs://B [--project=P] [--location=L]``: a new bucket on the emulator."""
    import gcsfs  # test-only dependency (the `gcs` extra)

    urls = [a for a in args if not a.startswith("--")]
    unknown = [a for a in args if a.startswith("--") and a.split("=", 1)[0] not in ("--project", "--location")]
    if len(urls) != 1 or not urls[0].startswith("gs://") or "/" in urls[0][5:].strip("/") or unknown:
        print(
            f"fake gcloud: storage buckets create takes gs://BUCKET [--project --location], got {args}", file=sys.stderr
        )
        return 2
    bucket = urls[0][5:].strip("/")
    fs = gcsfs.GCSFileSystem(project=_flag(args, "project", "box"))
    if fs.exists(bucket):
        print(f"ERROR: (gcloud) HTTPError 409: the bucket gs://{bucket} already exists", file=sys.stderr)
        return 1
    fs.mkdir(bucket, location=_flag(args, "location"))
    return 0


def _cp(args):
    """``storage cp -r SRC... gs://B/[PREFIX/]``: each local file or folder to ``gs://B/[PREFIX/]<basename>``."""
    from etils import epath

    from trace_jax import paths

    if not args or args[0] not in ("-r", "--recursive"):
        print(f"fake gcloud: storage cp takes -r SRC... gs://BUCKET/, got {args}", file=sys.stderr)
        return 2
    *sources, dest = args[1:]
    if not sources or not dest.startswith("gs://") or any(s.startswith("-") for s in sources):
        print(f"fake gcloud: storage cp -r takes local sources and a gs:// destination, got {args}", file=sys.stderr)
        return 2
    missing = [s for s in sources if not os.path.exists(s)]
    if missing:
        print(f"ERROR: (gcloud) The following URLs matched no objects or files: {' '.join(missing)}", file=sys.stderr)
        return 1
    for source in map(pathlib.Path, sources):
        target = epath.Path(dest.rstrip("/")) / source.name
        if source.is_dir():
            paths.copy_tree(source, target)
        else:
            epath.Path(source).copy(target, overwrite=True)
    return 0


STORAGE = {("buckets", "create"): _buckets_create, ("cp",): _cp}


def _storage(argv):
    for words, command in STORAGE.items():
        if tuple(argv[1 : 1 + len(words)]) == words:
            return command(argv[1 + len(words) :]) if _emulated(" ".join(words)) else 2
    print(f"fake gcloud: not implemented: {argv}", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    box = root()
    box.mkdir(parents=True, exist_ok=True)
    with open(box / "calls.jsonl", "a") as log:
        log.write(json.dumps(argv) + "\n")
    if argv[:1] == ["fault"]:  # the test's own door: fault preempt NAME | fault kill NAME WORKER
        if argv[1] == "preempt":
            preempt(box, argv[2])
        else:
            kill_host(box, argv[2], int(argv[3]))
        return 0
    if argv[:1] == ["storage"]:
        return _storage(argv)
    if argv[:3] != ["compute", "tpus", "tpu-vm"] and argv[:3] != ["compute", "tpus", "queued-resources"]:
        print(f"fake gcloud: not implemented: {argv}", file=sys.stderr)
        return 2
    kind = "vm" if argv[2] == "tpu-vm" else "queued"
    verb, args = argv[3], argv[4:]
    name = args[0] if verb != "scp" else None
    if verb == "create":
        return _create(box, name, args, kind)
    if verb == "describe":
        return _describe(box, name, kind, args)
    if verb == "delete":
        return delete(box, name)
    if verb == "ssh":
        return _ssh(box, name, args)
    if verb == "scp":
        return _scp(box, args)
    print(f"fake gcloud: not implemented: {argv}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
