"""A host that dies without notice (SIGKILL) does not hang the job: the surviving process stops, within the bound
``distributed.heartbeat_timeout_s`` sets, with an error naming the lost process. Two local processes over
127.0.0.1 (``tests/pod/lost_peer_check.py``). Mutant caught: ``distributed.initialize`` that does not pass the
key to ``jax.distributed.initialize`` (its default, 100 s, overruns the bound: a peer that waits on)."""

import contextlib
import os
import pathlib
import socket
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEARTBEAT_TIMEOUT_S = 5
BOUND_S = 45  # the timeout, the coordinator's next check and the abort, with room for a loaded machine


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_surviving_process_stops_within_the_heartbeat_bound_naming_the_lost_one(tmp_path):
    port = _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    script = str(ROOT / "tests" / "pod" / "lost_peer_check.py")
    with contextlib.ExitStack() as files:
        logs = [files.enter_context(open(tmp_path / f"process_{i}.log", "w")) for i in (0, 1)]
        code, waited = _kill_one_and_time_the_other(script, port, env, logs)
    log = (tmp_path / "process_0.log").read_text()
    assert "process 0: past barrier 3" in log, "premise: both processes were running the job together"
    assert code is not None, f"process 0 still waited {BOUND_S} s after its peer died:\n{log[-3000:]}"
    assert code != 0
    assert "heartbeat" in log and "Task 1" in log, log[-3000:]
    print(f"process 0 stopped {waited:.1f} s after process 1 died (heartbeat timeout {HEARTBEAT_TIMEOUT_S} s)")


def _kill_one_and_time_the_other(script, port, env, logs):
    """Starts both processes; once process 1 has killed itself, waits up to the bound for process 0: its exit
    status (None: still running) and the seconds it took."""
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(i), str(port), str(HEARTBEAT_TIMEOUT_S)],
            env=env,
            stdout=logs[i],
            stderr=subprocess.STDOUT,
        )
        for i in (0, 1)
    ]
    try:
        assert procs[1].wait(timeout=300) == -9, "premise: process 1 kills itself once both have joined"
        lost_at = time.monotonic()
        try:
            code = procs[0].wait(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            code = None
        waited = time.monotonic() - lost_at
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return code, waited
