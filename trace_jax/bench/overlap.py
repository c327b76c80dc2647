"""Rollouts beside training: the main job's RL step time with sampling and training apart, sampling in turn
(``rl.max_staleness = 0``) against sampling one step ahead (``= 1``), side by side in one run.

    python -m trace_jax.bench.overlap [--steps=5] [--rounds=1] [--placement=process|devices] [--shared-cores]
                                      [--config.KEY=VALUE ...] [--out=FILE.json]

Where sampling runs (``--placement``):

- ``process`` (the default): in a process of its own pinned to one core, the trainer's threads on the other
  (``mesh.rollout_cpus = 1``, ``trace_jax.job.sampling_process``): one core each, each process with its own
  XLA runtime, as two chips would be.
- ``devices``: two XLA host devices in this process, one sampling (``mesh.rollout_devices = 1``) and one training
  (``--xla_force_host_platform_device_count=2``, set here before JAX starts). The two devices share XLA's one
  thread pool, so this is not a clean split of one core each: a program alone uses part of the other core too,
  and sampling in turn leaves less idle than on two chips.

Both run with Eigen's threading off (``ONE_CORE_EACH``) unless ``--shared-cores``. One ``Training`` runs blocks of
``--steps`` RL steps, alternately at k = 0 and k = 1 (each round swaps the order, so a drift in the machine's load
falls on both), on the same engine and trainer (nothing compiles twice).
Checkpoints are never written, but the checkpoint period is the block length, so a block's last step is a
boundary of the pipeline: nothing is in flight when the mode changes, and each block's first step samples in
turn and its last step samples nothing ahead (the pipeline's ends): the figures are those of steps 2..N-1
of each block, the steady state (the first one also compiles).

Per mode, over those steps: the median step time, the generated tokens and the step time per thousand of them (the
two modes sample different trees, so "equal tokens" is checked, not forced), the median rollout and train seconds,
the median rows the update ran and its seconds per row (the trees left out for zero advantage differ from step
to step, so the train seconds of the two modes compare only per row),
the overlap fraction: the share of the trainer's time (batch + update) during which rollouts ran, and the cores
this process kept busy (its CPU seconds over the step's wall seconds: with ``devices``, XLA:CPU runs both host
devices' programs on one shared thread pool, so a program can use both cores when the other device is idle; with
``process``, the trainer's side alone), and the programs this process compiled during them (``compiles``, from
JAX's compile event on any thread: 0 once warm, in either mode; the engine's own count is its
``programs.total``, in the child with ``process``). ``speedup`` is
the k = 0 median over the k = 1 median. The default config is the main job's (``configs/default.py``) with the tiny
world of the job tests' warm start (``TINY_WORLD`` below): the default RL step (16 questions, 8 rollouts' budget
each, 32 slots) on a warm start that trains in minutes.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from trace_jax.bench.report import emit

# A tiny world whose 200-step warm start answers about a third of its training questions (the job tests' world,
# ``tests/helpers.TINY_MAIN_JOB``, starts with it); the RL step on it is the default one.
TINY_WORLD = [
    "--config.world.scale=2",
    "--config.world.questions_per_hop=40",
    "--config.world.ood_questions=10",
    "--config.tokenizer.vocab_size=400",
    "--config.sft.max_steps=200",
    "--config.sft.practice_worlds=0",
]
DEVICES_FLAG = "--xla_force_host_platform_device_count=2"
# Where sampling runs (see the module's docstring): the config that puts it there and the host devices it needs.
PLACEMENTS = {
    "process": (["--config.mesh.rollout_cpus=1"], 1),
    "devices": (["--config.mesh.rollout_devices=1"], 2),
}
# Eigen's own threading off: each operation on one thread. XLA:CPU still runs a program's independent operations
# concurrently on the one thread pool that both host devices share, so this does not pin a device to a core:
# a device working alone keeps about 1.7 of the 2 cores busy (``median_cores_used`` at k = 0). ``--shared-cores``
# leaves Eigen's threading on as well.
ONE_CORE_EACH = "--xla_cpu_multi_thread_eigen=false"


def _flag(argv: list[str], name: str, default: str) -> str:
    return next((a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")), default)


class CompileCount:
    """Programs JAX compiles (or loads from its persistent cache: either means a program not seen before), on any
    thread, counted from JAX's backend-compile event."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        import jax.monitoring  # here: JAX starts after the flags are set (see main)

        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration_secs: float, **kwargs: Any) -> None:
        self.count += event == self.EVENT


# What a step trains, beside its timings: the update's cost follows its rows (the trees left out for zero
# advantage are not run), which differ between the steps each mode happens to run.
BATCH_FIGURES = ("batch/rows", "batch/trees_skipped", "train/micro_batches")


def _block(run: Any, staleness: int, steps: int, compiles: CompileCount) -> list[dict[str, float]]:
    """``steps`` RL steps at ``rl.max_staleness = staleness``; the metrics of each."""
    run.pipeline.max_staleness = staleness
    records = []
    for _ in range(steps):
        wall, cpu, compiled = time.perf_counter(), time.process_time(), compiles.count
        records.append(run.rl_step())
        records[-1]["bench/cores_used"] = (time.process_time() - cpu) / (time.perf_counter() - wall)
        records[-1]["bench/compiles"] = compiles.count - compiled
        shown = {k: round(v, 3) for k, v in records[-1].items() if k.startswith("time/") or k in BATCH_FIGURES}
        print(json.dumps({"k": staleness, "step": run.step, **shown}), file=sys.stderr, flush=True)
    return records


def _mode(blocks: list[list[dict[str, float]]]) -> dict[str, Any]:
    counted = [record for block in blocks for record in block[1:-1]]  # each block's steps 2..N-1
    tokens = sum(r["alloc/budget/generated_tokens"] for r in counted)
    step_s = [r["time/step_s"] for r in counted]
    train_s = sum(r["time/train_s"] for r in counted)
    return {
        "steps_counted": len(counted),
        "median_step_s": statistics.median(step_s),
        "step_s": [round(s, 3) for s in step_s],
        "generated_tokens": tokens,
        "step_s_per_1k_tokens": sum(step_s) / tokens * 1000 if tokens else None,
        "median_rollout_s": statistics.median(r["time/rollout_s"] for r in counted),
        "median_train_s": statistics.median(r["time/train_s"] for r in counted),
        "median_rows": statistics.median(r["batch/rows"] for r in counted),
        "train_s_per_row": train_s / sum(r["batch/rows"] for r in counted),
        "median_weight_sync_s": statistics.median(r["time/weight_sync_s"] for r in counted),
        "overlap_fraction": sum(r.get("time/overlap_s", 0.0) for r in counted) / train_s if train_s else 0.0,
        "staleness_max": max(r.get("rollout/staleness_max", 0.0) for r in counted),
        "median_cores_used": statistics.median(r["bench/cores_used"] for r in counted),
        "compiles": sum(r["bench/compiles"] for r in counted),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv if argv is None else argv)
    placement = _flag(argv, "placement", "process")
    if placement not in PLACEMENTS:
        sys.exit(f"--placement={placement!r}: choose one of {', '.join(PLACEMENTS)}")
    apart, devices = PLACEMENTS[placement]
    if "TRACE_JAX_OVERLAP_BENCH" not in os.environ:  # the flags must be set before JAX starts: a fresh interpreter
        flags = [os.environ.get("XLA_FLAGS", ""), "" if "--shared-cores" in argv else ONE_CORE_EACH]
        flags.append(DEVICES_FLAG if devices == 2 else "")
        env = dict(os.environ, XLA_FLAGS=" ".join(f for f in flags if f), TRACE_JAX_OVERLAP_BENCH="1")
        env.setdefault("JAX_PLATFORMS", "cpu")
        sys.exit(subprocess.run([sys.executable, "-m", "trace_jax.bench.overlap", *argv[1:]], env=env).returncode)
    steps, rounds = int(_flag(argv, "steps", "5")), int(_flag(argv, "rounds", "1"))
    if steps < 3:
        sys.exit("--steps must be >= 3: each block's first and last steps are left out")
    out = _flag(argv, "out", "bench_results/overlap.json")
    overrides = [a for a in argv[1:] if a.startswith("--config")]
    # Imported here: JAX must start after XLA_FLAGS names the two devices.
    import jax

    from trace_jax.configs import validate
    from trace_jax.job import cli, commands, training
    from trace_jax.job.metrics import PhaseTimer

    cli.quiet_third_party(0)
    total = 2 * steps * rounds
    bench = [
        *TINY_WORLD,
        *apart,
        f"--config.rl.steps={total}",
        f"--config.rl.checkpoint_every={steps}",  # block ends are pipeline boundaries; nothing is saved
        "--config.eval.every=0",
    ]
    config, _ = commands.load_config(["overlap", *bench, *overrides])  # the run's RunConfig, checked
    validate.check_mesh(config, jax.device_count())
    validate.check_sampling_process(config, jax.default_backend(), len(os.sched_getaffinity(0)))
    blocks: dict[int, list[list[dict[str, float]]]] = {0: [], 1: []}
    with tempfile.TemporaryDirectory() as workdir:
        run = training.Training(config, pathlib.Path(workdir), cli.Console(verbosity=-1), PhaseTimer())
        try:
            run.warm_up_predictor()
            compiles = CompileCount()
            for round_ in range(rounds):
                for staleness in (0, 1) if round_ % 2 == 0 else (1, 0):
                    blocks[staleness].append(_block(run, staleness, steps, compiles))
        finally:
            run.close()
    sync, ahead = _mode(blocks[0]), _mode(blocks[1])
    result = {
        "config": [*bench, *overrides],
        "placement": placement,
        "devices": {"sampling": 1, "training": jax.device_count() - (devices - 1), "platform": jax.default_backend()},
        "cores": run.sampler.describe() or None,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "load_average": os.getloadavg(),
        "k0": sync,
        "k1": ahead,
        "speedup": sync["median_step_s"] / ahead["median_step_s"],
        "speedup_per_token": (
            sync["step_s_per_1k_tokens"] / ahead["step_s_per_1k_tokens"] if ahead["step_s_per_1k_tokens"] else None
        ),
    }
    return emit(result, out)


if __name__ == "__main__":
    main()
