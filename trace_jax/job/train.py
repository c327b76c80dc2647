"""The main job: synthetic world -> tokenizer -> SFT warm start -> TRACE RL, with evaluation around it.

    python -m trace_jax.train                                     # configs/default.py, ./runs/default
    python -m trace_jax.train --show-config                       # every key, its value and what it means
    python -m trace_jax.train --config=configs/ablation.py:uniform --workdir=runs/uniform
    python -m trace_jax.train --config.rl.steps=40 --workdir=runs/long

Each RL step: a batch of training questions becomes trees under the allocation policy's budget
(``TreeScheduler``), the trees become advantages and a ``TrainBatch``, and one jit'd update runs under the
mesh. The warm start (tokenizer + SFT policy, a fixed number of steps) comes from a cache shared by all runs
(``trace_jax.job.warm_start``), so the same config and seed give the same numbers on any machine and load, and
ablations start from the same model. Written to the workdir: ``metrics.jsonl``, TensorBoard events
(``tensorboard/``), PNG plots (``plots/``), orbax checkpoints of the whole state (``checkpoints/``, step 0
included), ``summary.json`` (written last: a run with one is finished), ``config.json`` and ``train.log``.

After a kill, rerunning the same command resumes from the latest checkpoint, and the logs end up exactly as
an uninterrupted run's: each step's record (evaluations included) is written before that step is
checkpointed, and a resumed writer keeps what was logged up to the checkpoint and drops the rest. Rerunning
a finished run changes nothing (one line in ``train.log``); a larger ``--config.rl.steps`` extends it.

A SIGTERM (a spot or queued slice's preemption notice) during RL lets the step under way finish, writes its
checkpoint and exits with code 143 (``ExitCode.PREEMPTED``) within ``rl.preemption_grace_s``; a step that
would not finish in time is abandoned, and the last completed step is checkpointed (before the abandoned step's
update, or at the abandonment when it came before it), so a stop loses at most the step under way. With
``rl.max_staleness >= 1`` the next step's rollouts, sampled ahead, are waited for within the grace and kept with
the checkpoint (the rerun trains on them). A SIGTERM during the SFT warm start saves its progress the same way
(``trace_jax.job.sft``). Every rerun ends bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

import jax
import numpy as np
from etils import epath

from trace_jax import paths
from trace_jax.configs import RunConfig, validate
from trace_jax.job import build, heap, rundir
from trace_jax.job.cli import TERMINATION, Console, Interrupted, Preempted
from trace_jax.job.metrics import (
    JSONL_NAME,
    TENSORBOARD_DIR,
    MetricWriter,
    PhaseTimer,
    format_table,
    plot_metrics,
    read_jsonl,
)
from trace_jax.job.training import Training, eval_metrics, evaluates_after
from trace_jax.parallel import distributed

PLOTS = {
    "reward.png": ["rollout/mean_reward", "eval/em"],
    "effective_ratio.png": ["alloc/effective_ratio", "alloc/nonzero_adv_token_share"],
}


def _summary(run: Training, records: list[dict[str, Any]]) -> dict[str, Any]:
    """What the run achieved (reproducible: equal for equal config and seed) plus ``run``: how it went
    (wall-clock seconds per phase, resumes, where the warm start lives; these vary with the machine)."""
    config = run.config
    steps = [r for r in records if "alloc/effective_ratio" in r]
    warm = run.start.facts
    summary = {
        "policy": config.allocation.policy,
        "seed": config.seed,
        "steps": run.step,
        "eval_before": run.eval_before,
        "eval_after": run.last_eval,
        "mean_effective_ratio": float(np.mean([r["alloc/effective_ratio"] for r in steps])) if steps else None,
        "generated_tokens": float(sum(r.get("alloc/budget/generated_tokens", 0.0) for r in steps)),
        "warm_start": warm,
        "reproducible": warm["reproducible"],
    }
    if not warm["reproducible"]:
        summary["not_reproducible_because"] = (
            f"sft.time_budget_s={config.sft.time_budget_s} stopped the warm start at step {warm['steps']} of "
            f"{config.sft.max_steps}: another machine or load stops it elsewhere"
        )
    summary["run"] = {
        "timings_s": run.timer.state_dict(),
        "resumes": run.resumes,
        "warm_start_dir": str(run.start.directory),
        # Which process sampled which questions in the last step (one list per process).
        "processes": {**run.processes.describe(), "last_step_questions": run.sampled_by_process},
        "placement": {**run.placement.describe(), **run.sampler.describe()},
        "note": "wall-clock figures: they depend on the machine and its load",
    }
    return summary


def _write_json(path: epath.Path, value: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    tmp.replace(path)  # atomic: summary.json marks a finished run, so it is never half written


def train(config: Any, workdir: str | os.PathLike, console: Console | None = None) -> dict[str, Any]:
    """Runs, resumes or extends the run in ``workdir``; returns its summary (also ``workdir/summary.json``).

    ``config`` is the run's ``RunConfig`` (``trace_jax.job.commands.load_config``); a config file's ConfigDict
    (a benchmark's, a test's) is checked and typed here first (``validate.validate``).

    A finished run (its ``summary.json`` has ``config.rl.steps`` steps) is left untouched and its summary
    returned. Raises :class:`trace_jax.job.cli.UserError` subclasses for an unusable workdir or config, and
    :class:`trace_jax.job.cli.Interrupted` on Ctrl-C / SIGTERM (saying which checkpoint a rerun resumes from).
    """

    console = console if console is not None else Console()
    workdir = paths.as_path(workdir)  # gs://bucket/run stays a URL (pathlib.Path would make it gs:/bucket/run)
    config = validate.validate(config)
    # Before anything touches a device: with several processes, each joins the job here.
    distributed.initialize(config.distributed)
    rundir.check_usable(workdir)
    rundir.check_same_run(workdir, config)
    logs = paths.LocalMirror(workdir)  # logs, events and plots are written locally; a bucket gets copies
    if distributed.is_main_process():  # one train.log, written by process 0
        logs.pull((rundir.LOG_FILE, JSONL_NAME, TENSORBOARD_DIR))
        console.attach_log(logs.local / rundir.LOG_FILE)
    steps = config.rl.steps
    finished = rundir.finished_summary(workdir, config)
    if finished is not None:
        console.info(
            f"{workdir} is already complete: {steps} RL steps (summary.json); nothing to do. "
            f"To train it further, rerun with --config.rl.steps=N for some N > {steps}."
        )
        return finished
    try:
        return _train(config, workdir, console, logs)
    except KeyboardInterrupt:
        if TERMINATION.requested:
            raise Preempted(f"stopped by SIGTERM before the step under way ended; {_resume_point(workdir)}") from None
        raise Interrupted(f"interrupted; {_resume_point(workdir)}") from None


def _resume_point(workdir: epath.Path) -> str:
    done = rundir.checkpoint_steps(workdir)
    if done:
        return (
            f"the last checkpoint is step {done[-1]} in {workdir / rundir.CHECKPOINTS}; rerun the same command to "
            "resume from it"
        )
    return (
        "no checkpoint was written yet; rerun the same command to start again (a finished warm start is reused "
        "from its cache)"
    )


def _stop_requested(run: Training) -> bool:
    """Whether a SIGTERM asked to stop (any process's: every process then stops after the same step)."""
    return run.processes.reduce({"stop": float(TERMINATION.requested)})["stop"] > 0


def _train(config: RunConfig, workdir: epath.Path, console: Console, logs: paths.LocalMirror) -> dict[str, Any]:
    validate.check_mesh(config, jax.device_count(), jax.process_count())
    validate.check_sampling_process(config, jax.default_backend(), len(os.sched_getaffinity(0)))
    console.log(f"start: {' '.join(sys.argv[1:]) or '(defaults)'}")
    distributed.run_on_main(build.save_run_config, config, workdir)
    timer = PhaseTimer()
    TERMINATION.stop_if_requested()  # each setup phase starts only if no SIGTERM came (its interrupt may be lost)
    run = Training(config, workdir, console, timer)
    TERMINATION.stop_if_requested()
    resumed = run.resume()
    steps = config.rl.steps
    # Only process 0 writes metrics.jsonl and TensorBoard (the metrics are reduced across processes first).
    writer = distributed.MainProcessWriter(lambda: MetricWriter(logs.local, resume_step=run.step if resumed else None))
    try:
        heap.release()  # the warm start's and setup's temporaries
        if resumed:
            console.info(f"resuming at RL step {run.step} of {steps} (checkpoint in {workdir / rundir.CHECKPOINTS})")
        else:
            run.eval_before = run.last_eval = run.evaluate("evaluation before RL")
            TERMINATION.stop_if_requested()
            writer.write(0, {**eval_metrics(run.eval_before), **run.warm_up_predictor()})
            distributed.run_on_main(logs.push)
            run.save(force=True)  # step 0: the evaluation above is logged once, whatever happens next
        # A SIGTERM lets the step under way finish unless that would leave too little of the grace to write
        # its checkpoint (twice the slowest save so far, and a second): then the step is abandoned.
        grace = config.rl.preemption_grace_s
        abandon_after = lambda: grace - 2 * run.slowest_save_s - 1.0
        # The whole loop is inside a grace (a SIGTERM between steps stops at the next loop check, never mid-write).
        with console.progress(steps, "TRACE RL", initial=run.step) as bar, TERMINATION.grace(float("inf")):
            while run.step < steps:
                if _stop_requested(run):
                    if run.pipeline.in_flight and run.drain_and_save(abandon_after()):
                        console.info(f"SIGTERM: stopped after RL step {run.step} (checkpointed, next step's trees too)")
                        raise Preempted(f"stopped by SIGTERM after RL step {run.step}; {_resume_point(workdir)}")
                    if run.pipeline.in_flight:  # the next step's trees, not done within the grace: dropped
                        if run.drop_and_save():
                            console.info(
                                f"SIGTERM: stopped after RL step {run.step} (checkpointed; the next step's rollouts "
                                "dropped, sampled again on resume)"
                            )
                        else:
                            console.info(
                                f"SIGTERM: stopped after RL step {run.step} (it sampled ahead: not checkpointed)"
                            )
                        raise Preempted(f"stopped by SIGTERM after RL step {run.step}; {_resume_point(workdir)}")
                    run.save(force=True)  # a no-op when this step is already checkpointed
                    console.info(f"SIGTERM: stopped after RL step {run.step} (checkpointed)")
                    raise Preempted(f"stopped by SIGTERM after RL step {run.step}; {_resume_point(workdir)}")
                with TERMINATION.grace(abandon_after()):
                    with timer.phase("rl"):
                        metrics = run.rl_step()
                    last = run.step == steps
                    if evaluates_after(config, run.step):
                        run.last_eval = run.evaluate(f"evaluation at step {run.step}", leave=False)
                        metrics.update(eval_metrics(run.last_eval))
                # Past here the step is complete: logging and checkpointing it are never abandoned.
                writer.write(run.step, metrics)  # before the checkpoint: a resume never loses a step's record
                distributed.run_on_main(logs.push)
                run.save(force=last)
                heap.release()  # the step's freed temporaries, back to the OS (see trace_jax.job.heap)
                bar.set_postfix(
                    reward=f"{metrics['rollout/mean_reward']:.2f}", eff=f"{metrics['alloc/effective_ratio']:.2f}"
                )
                bar.update(1)
    except KeyboardInterrupt:  # a step abandoned before its update: the step before it is checkpointed if not yet
        run.keep_last_step(abandoned=True)
        raise
    finally:
        writer.close()
        run.close(wait=not TERMINATION.requested)  # a SIGTERM's stop leaves rollouts in flight behind
    final = dataclasses.replace(
        run.start, model_config=run.model_config, params=run.state.params, source=f"rl step {run.step}"
    )
    exports = run.source.finish(config, workdir, final)  # search_r1: the HF export (collective)
    summary = distributed.run_on_main(_finish, run, workdir, logs, exports)
    console.log(f"finished: {run.step} RL steps")
    distributed.run_on_main(logs.push)
    return run.processes.from_main(summary)  # every process returns process 0's summary


def _finish(run: Training, workdir: epath.Path, logs: paths.LocalMirror, exports: dict[str, str]) -> dict[str, Any]:
    """Process 0's part of the end of a run: plots, the summary and the warm start's scores."""

    records = read_jsonl(logs.local / JSONL_NAME)
    for name, keys in PLOTS.items():
        plot_metrics(records, keys, logs.local / "plots" / name)
    summary = _summary(run, records)
    summary["exports"] = exports
    _write_json(workdir / "eval_before.json", {"step": 0, "rows": run.eval_before})  # the warm start's scores
    _write_json(workdir / rundir.SUMMARY_FILE, summary)  # last: its presence marks the run finished
    return summary


def summary_table(summary: dict[str, Any]) -> str:
    """Held-out EM / F1 per group of the starting policy (an SFT warm start or a loaded checkpoint: "before RL")
    and of the trained one ("after RL"), as a Markdown table."""

    after = {row["group"]: row for row in summary["eval_after"]}
    rows = [
        {
            "group": row["group"],
            "n": row["n"],
            "EM before RL": row["em"],
            "EM after RL": after[row["group"]]["em"],
            "F1 before RL": row["f1"],
            "F1 after RL": after[row["group"]]["f1"],
        }
        for row in summary["eval_before"]
    ]
    return format_table(rows)


def summary_line(summary: dict[str, Any]) -> str:
    """One line: steps, RL time and the other phases' times, mean effective ratio, generated tokens (the terms
    are defined in ``python -m trace_jax.train --help``)."""
    timings = summary.get("run", {}).get("timings_s", {})
    ratio = summary["mean_effective_ratio"]
    phases = ", ".join(
        f"{name.replace('_', ' ')} {timings[name]:.0f} s"
        for name in ("warm_start", "setup", "evaluation")
        if name in timings
    )
    return (
        f"TRACE RL ({summary['policy']}): {summary['steps']} steps, RL {timings.get('rl', 0.0):.0f} s "
        f"({phases}; total {timings.get('total', 0.0):.0f} s); mean effective ratio "
        f"{'n/a' if ratio is None else f'{ratio:.3f}'}, {summary['generated_tokens']:,.0f} generated tokens"
    )
