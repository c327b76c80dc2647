"""Where the main job's memory goes: peak resident memory (VmHWM) of each phase of a run, in one process.

    python -m trace_jax.bench.memory [--steps 2] [--config.KEY=VALUE ...] [--out bench_results/memory.json]

Runs the main job's phases in order (imports, warm start, setup, the evaluation before RL, ``--steps`` RL
steps) on the given config (default: ``configs/default.py``; the warm start comes from, or goes to, the
shared cache) and prints, per phase, the resident memory when it ends, the peak reached during it, and the
resident memory left once freed heap pages are handed back (``malloc_trim``): what is really live. The peak is
reset between phases (``/proc/self/clear_refs``), so each figure is that phase's own high-water mark. Linux
(glibc) only.
"""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile
import time
from typing import Any

from trace_jax.bench.report import emit
from trace_jax.job import cli, heap
from trace_jax.job.metrics import PhaseTimer

MIB = 1024 * 1024


def _status_kib(field: str) -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> None:
    pathlib.Path("/proc/self/clear_refs").write_text("5")  # "5": reset the peak RSS to the current RSS


class PhaseMemory:
    """Records (phase, rss MiB at its end, peak MiB during it, seconds) as phases end."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self._start = time.perf_counter()

    def end(self, phase: str) -> None:
        row = {
            "phase": phase,
            "rss_mib": round(_status_kib("VmRSS") / 1024, 1),
            "peak_mib": round(_status_kib("VmHWM") / 1024, 1),
            "seconds": round(time.perf_counter() - self._start, 1),
        }
        # What is live, as opposed to freed but kept by the C allocator: RSS after returning free pages.
        heap.release()
        row["rss_after_trim_mib"] = round(_status_kib("VmRSS") / 1024, 1)
        self.rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        _reset_peak()
        self._start = time.perf_counter()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv if argv is None else argv)
    steps = int(next((a.split("=", 1)[1] for a in argv if a.startswith("--steps=")), 2))
    out = next((a.split("=", 1)[1] for a in argv if a.startswith("--out=")), "bench_results/memory.json")
    train_argv = [a for a in argv if not a.startswith(("--steps=", "--out="))]
    memory = PhaseMemory()
    _reset_peak()
    # The first phase measures what importing the job and starting JAX cost, so they are imported here.
    import jax

    from trace_jax.job import commands, training

    cli.quiet_third_party(0)
    config, _ = commands.load_config(train_argv)  # the run's RunConfig, checked
    jax.numpy.zeros(1).block_until_ready()
    memory.end("imports + jax runtime")
    console = cli.Console(verbosity=-1)
    with tempfile.TemporaryDirectory() as workdir:
        run = training.Training(config, pathlib.Path(workdir), console, PhaseTimer())
        memory.end("warm start + setup")
        run.evaluate("evaluation")
        memory.end("evaluation before RL")
        for step in range(1, steps + 1):
            run.rl_step()
            memory.end(f"rl step {step}")
        run.checkpointer.close()
    result = {"config": train_argv[1:], "phases": memory.rows, "peak_mib": max(r["peak_mib"] for r in memory.rows)}
    return emit(result, out)


if __name__ == "__main__":
    main()
