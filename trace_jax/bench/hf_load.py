"""Host memory and bytes read when every process of a 2-process job loads one HF checkpoint onto a shared mesh.

    python -m trace_jax.bench.hf_load --hf-dir gs://bucket/qwen3 [--devices-per-process 2]

Starts two JAX processes on 127.0.0.1 (``devices-per-process`` fake CPU devices each, one ``fsdp`` mesh over all of
them) twice: ``ranged`` (``load_hf``: each process reads only its shards' rows) and ``whole`` (each process first
reads every tensor whole, as the loader did before ranged reads, then places the same shards). Prints one JSON
object: per mode and process, the checkpoint's tensor bytes, the bytes read and the peak resident memory
(``ru_maxrss``), and the sum of all loaded parameters (to compare modes and loaders). The checkpoint
may be local or a URL; the environment (e.g. ``STORAGE_EMULATOR_HOST``) is passed to the processes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
from typing import Any

MODES = ("ranged", "whole")
_MODULE = (sys.executable, "-m", "trace_jax.bench.hf_load")


def _devices(count: int) -> list[str]:
    return ["--devices-per-process", str(count)]


def _worker(port: int, pid: int, hf_dir: str, mode: str, devices: int) -> dict[str, Any]:
    import jax  # in the worker only: the driver must not start jax before its children set their devices

    from trace_jax.checkpoint import hf, ranged
    from trace_jax.parallel import distributed
    from trace_jax.parallel import mesh as mesh_lib

    distributed.initialize(distributed.DistributedConfig("explicit", f"127.0.0.1:{port}", 2, pid))
    mesh = mesh_lib.make_mesh(fsdp=-1)
    files = ranged.CheckpointFiles(hf_dir)
    held = []
    if mode == "whole":  # the old loader: every tensor on the host, whole
        held = [files.rows(name, 0, e.shape[0] if e.shape else 1) for name, e in files.entries.items()]
    before = files.bytes_read
    _, params = hf.load_hf(hf_dir, mesh=mesh, files=files)
    leaves = jax.tree.leaves(params)
    checksum = float(jax.jit(lambda xs: sum(x.astype("float32").sum() for x in xs))(leaves))
    total = sum(e.end - e.start for e in files.entries.values())
    return {
        "process": pid,
        "devices": len(jax.devices()),
        "tensor_bytes": total,
        "bytes_read": files.bytes_read - before + sum(a.nbytes for a in held),
        "param_sum": checksum,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(hf_dir: str, mode: str, devices: int = 2, timeout: float = 600) -> list[dict[str, Any]]:
    """Runs the two processes for one mode; their reports in process order."""
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
        JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
    )
    port = _free_port()
    procs = [
        subprocess.Popen(
            [*_MODULE, "--worker", str(port), str(pid), "--hf-dir", hf_dir, "--mode", mode, *_devices(devices)],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for pid in (0, 1)
    ]
    reports = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            if proc.returncode:
                raise RuntimeError(f"hf_load worker failed:\n{stderr[-3000:]}")
            reports.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return reports


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--devices-per-process", type=int, default=2)
    parser.add_argument("--mode", choices=MODES, default=None, help="one mode only (default: both)")
    parser.add_argument("--worker", nargs=2, type=int, metavar=("PORT", "PROCESS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        port, pid = args.worker
        print(json.dumps(_worker(port, pid, args.hf_dir, args.mode, args.devices_per_process)))
        return
    modes = [args.mode] if args.mode else list(MODES)
    result = {"hf_dir": args.hf_dir, "processes": 2, "devices_per_process": args.devices_per_process}
    result.update({mode: measure(args.hf_dir, mode, args.devices_per_process) for mode in modes})
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
