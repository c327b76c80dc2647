"""The main job: synthetic world -> tokenizer -> SFT warm start -> TRACE RL, with evaluation around it.

    python -m trace_jax.train                                     # configs/default.py, ./runs/default
    python -m trace_jax.train --show-config                       # every key, its value and what it means
    python -m trace_jax.train --config=configs/ablation.py:uniform --workdir=runs/uniform
    python -m trace_jax.train --config.rl.steps=40 --workdir=runs/long

Each RL step: a batch of training questions becomes trees under the allocation policy's budget
(``TreeScheduler``), the trees become advantages and a ``TrainBatch``, and one jit'd update runs under the
mesh. The warm start (tokenizer + SFT policy, a fixed number of steps) comes from a cache shared by all runs
(``trace_jax.warm_start``), so the same config and seed give the same numbers on any machine and load, and
ablations start from the same model. Written to the workdir: ``metrics.jsonl``, TensorBoard events
(``tensorboard/``), PNG plots (``plots/``), orbax checkpoints of the whole state (``checkpoints/``, step 0
included), ``summary.json`` (written last: a run with one is finished), ``config.json`` and ``train.log``.

After a kill, rerunning the same command resumes from the latest checkpoint, and the logs end up exactly as
an uninterrupted run's: each step's record (evaluations included) is written before that step is
checkpointed, and a resumed writer keeps what was logged up to the checkpoint and drops the rest. Rerunning
a finished run changes nothing (one line in ``train.log``); a larger ``--config.rl.steps`` extends it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import sys
from typing import Any

import ml_collections
import numpy as np

from trace_jax import cli, rundir
from trace_jax.cli import Console, Interrupted

DEFAULT_CONFIG = pathlib.Path(__file__).resolve().parents[1] / "configs" / "default.py"
DEFAULT_WORKDIR = "./runs/default"
PLOTS = {
    "reward.png": ["rollout/mean_reward", "eval/em"],
    "effective_ratio.png": ["alloc/effective_ratio", "alloc/nonzero_adv_token_share"],
}
USAGE = f"""usage: python -m trace_jax.train [--config=FILE[:ARG]] [--workdir=DIR] [--config.KEY=VALUE ...]
                                [--show-config] [--verbosity=N]

Trains the TRACE agent end to end: warm start (cached), evaluation, RL, evaluation.

options:
  --config=FILE[:ARG]   a config file (default: configs/default.py); ablations: configs/ablation.py:uniform
  --config.KEY=VALUE    override any config key, e.g. --config.rl.steps=40 --config.optim.learning_rate=1e-4
  --workdir=DIR         run directory (default: {DEFAULT_WORKDIR}); rerunning resumes, a larger rl.steps extends
  --show-config         print every config key with its value and doc (overrides applied), then exit
  --verbosity=N         1 or more: library logs and full tracebacks on errors
  -h, --help            show this help and exit

exit codes: 0 done (or already complete), 2 bad flag or config value, 3 missing file, 4 unusable workdir,
130 interrupted (rerun the same command to resume), 1 unexpected error."""


@dataclasses.dataclass
class EvalLog:
    step: int
    rows: list[dict[str, Any]]


def _eval_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    return {f"eval/em/{row['group']}" if row["group"] != "all" else "eval/em": row["em"] for row in rows}


class Training:
    """Everything one run holds between steps, and the step itself."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: pathlib.Path, console: Console, timer: Any):
        import jax

        from trace_jax import recipe, recipes
        from trace_jax.checkpoint.state import StateCheckpointer
        from trace_jax.config_utils import from_config
        from trace_jax.models.qwen import abstract_model
        from trace_jax.optim import make_optimizer
        from trace_jax.parallel.mesh import make_mesh, shard_state
        from trace_jax.rl.batch import BatchConfig
        from trace_jax.rl.losses import LossConfig
        from trace_jax.rl.trainer import RLTrainer, UpdateConfig
        from trace_jax.rollout.engine import EngineConfig

        self.config, self.workdir, self.console, self.timer = config, workdir, console, timer
        self.mesh = make_mesh(**config.mesh)
        # config.recipe.kind: the synthetic world + SFT warm start, or a HF checkpoint + Search-R1 data.
        self.source = recipes.source_of(config)
        with timer.phase("warm_start"):
            self.start = self.source.start(config, workdir, self.mesh, progress=console.progress, notify=console.info)
        console.info(self.start.message)
        self.world = self.start.world
        with timer.phase("setup"):
            self.model_config = self.start.model_config
            params = shard_state(self.start.params, self.mesh)
            self.start.params = None  # the train state holds the policy from here on
            loss_config = from_config(LossConfig, config.loss)
            self.trainer = RLTrainer(
                abstract_model(self.model_config)[0],
                make_optimizer(config.optim),
                loss_config,
                mesh=self.mesh,
                micro_batches=config.rl.micro_batches,
                reference_params=params if loss_config.kl_coef else None,  # the trainer keeps its own copy
                recompute_old_logprobs=config.rl.recompute_old_logprobs,
                update=from_config(UpdateConfig, config.ppo),
                sampling=from_config(EngineConfig, config.engine).sampling,  # the policy trained is the one sampled
                # None: the trainer's own default chunk.
                **({} if config.rl.get("logprob_chunk") is None else {"logprob_chunk": config.rl.logprob_chunk}),
            )
            self.state = self.trainer.init_state(params, jax.random.key(config.seed))
            del params
            self.batch_config = from_config(
                BatchConfig,
                config.batch,
                row_multiple=self.trainer.row_multiple,
                pad_id=self.world.tokenizer.pad_token_id,
            )
            # One engine (its own sampling copy of the weights) serves both the rollouts and the evaluation.
            engine = recipe.build_engine(config, self.model_config, self.state.params, mesh=self.mesh)
            self.runner = recipe.build_runner(
                config, self.model_config, None, self.world, seed=config.seed, engine=engine
            )
            self.eval_runner = recipe.build_runner(
                config, self.model_config, None, self.world, greedy=True, engine=engine
            )
            self.scheduler = recipe.build_scheduler(config, self.runner)
            self.prompts = self.source.prompt_stream(config, self.world)
            self.checkpointer = StateCheckpointer(
                workdir / rundir.CHECKPOINTS, save_every=config.rl.checkpoint_every, keep=config.rl.keep_checkpoints
            )
        self.step = 0
        self.resumes = 0
        self.eval_before: list[dict[str, Any]] = []
        self.last_eval: list[dict[str, Any]] = []

    # ------------------------------------------------------------------------------------ checkpoints
    def save(self, force: bool = False) -> None:
        # The policy is its own entry (evaluation restores just it); "train" holds the rest of the state once.
        state = {
            "params": self.state.params,
            "train": self.state._replace(params=None),
            "scheduler": self.scheduler.state_dict(),
        }
        metadata = {
            "prompts": self.prompts.state_dict(),
            "runner": self.runner.state_dict(),
            "eval_before": self.eval_before,
            "last_eval": self.last_eval,
            "timings": self.timer.state_dict(),
            "resumes": self.resumes,
        }
        self.checkpointer.save(self.step, state, metadata, force=force)

    def resume(self) -> bool:
        # The scheduler state has data-dependent shapes (a replay buffer that grows): restore it as saved.
        target = {"params": self.state.params, "train": self.state._replace(params=None), "scheduler": None}
        restored = self.checkpointer.restore_latest(target=target)
        if restored is None:
            return False
        meta = restored.metadata
        self.state = restored.state["train"]._replace(params=restored.state["params"])
        self.scheduler.load_state_dict(restored.state["scheduler"])
        self.prompts.load_state_dict(meta["prompts"])
        self.runner.load_state_dict(meta["runner"])
        self.eval_before, self.last_eval = meta.get("eval_before", []), meta.get("last_eval", [])
        self.timer.load_state_dict(meta.get("timings", {}))
        self.resumes = meta.get("resumes", 0) + 1
        self._set_params()
        self.step = restored.step
        return True

    def _set_params(self) -> None:
        self.runner.set_params(self.state.params)
        self.eval_runner.set_params(self.state.params)

    # ------------------------------------------------------------------------------------------- step
    def rl_step(self) -> dict[str, float]:
        """One RL update; returns its metrics (rollout, allocation, loss, timings)."""
        import time

        from trace_jax import figures
        from trace_jax.rl.advantages import compute_advantages
        from trace_jax.rl.batch import build_batch
        from trace_jax.rollout.tree import RolloutTree

        start = time.perf_counter()
        tasks = self.prompts.next_batch()
        trees = [RolloutTree(self.world.env.prompt_ids(task), task, i) for i, task in enumerate(tasks)]
        scheduled = self.scheduler.run(trees)
        rollout_seconds = time.perf_counter() - start
        advantages = compute_advantages(self.config.rl.advantage, scheduled.trees)
        batch, info = build_batch(scheduled.trees, advantages, self.batch_config, self.trainer.loss_config)
        self.state, train_metrics = self.trainer.update(self.state, batch)
        self._set_params()
        self.step += 1
        rewards = np.concatenate([tree.leaf_rewards() for tree in scheduled.trees])
        metrics = {f"alloc/{k}": v for k, v in scheduled.metrics.items()}
        metrics.update({f"train/{k}": v for k, v in train_metrics.items()})
        metrics.update(
            {
                "rollout/mean_reward": float(rewards.mean()),
                "rollout/leaves": float(rewards.size),
                "alloc/effective_ratio": figures.effective_ratio(scheduled.trees),
                "alloc/nonzero_adv_token_share": figures.nonzero_advantage_share(scheduled.trees)["tokens"],
                "batch/rows": float(info.num_rows),
                "batch/trained_tokens": float(info.num_trained_tokens),
                "time/rollout_s": rollout_seconds,
                "time/step_s": time.perf_counter() - start,
            }
        )
        return metrics

    def evaluate(self, description: str, leave: bool = True) -> list[dict[str, Any]]:
        """Greedy EM/F1 rows (per hop group, then ``all``) on ``config.eval``'s questions, with a progress bar."""
        from trace_jax.evaluate import evaluate

        config = self.config
        tasks = self.world.world.questions(config.eval.split)
        if config.eval.num_questions < len(tasks):  # evenly spaced: the split is ordered by hops, keep every group
            picked = np.linspace(0, len(tasks) - 1, config.eval.num_questions).round().astype(int)
            tasks = [tasks[i] for i in picked]
        # A handful of chunks, each at least the engine's slot count: progress and ETA at little cost.
        chunk = max(config.engine.max_slots, math.ceil(len(tasks) / 4))
        with self.timer.phase("evaluation"):
            bar = self.console.progress(len(tasks), description, unit="question", leave=leave)
            try:
                return evaluate(self.eval_runner, self.world.env, tasks, samples=1, progress=bar, chunk_size=chunk).rows
            finally:
                bar.close()


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
        "note": "wall-clock figures: they depend on the machine and its load",
    }
    return summary


def _write_json(path: pathlib.Path, value: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    tmp.replace(path)  # atomic: summary.json marks a finished run, so it is never half written


def train(
    config: ml_collections.ConfigDict, workdir: str | pathlib.Path, console: Console | None = None
) -> dict[str, Any]:
    """Runs, resumes or extends the run in ``workdir``; returns its summary (also ``workdir/summary.json``).

    A finished run (its ``summary.json`` has ``config.rl.steps`` steps) is left untouched and its summary
    returned. Raises :class:`trace_jax.cli.UserError` subclasses for an unusable workdir or config, and
    :class:`trace_jax.cli.Interrupted` on Ctrl-C / SIGTERM (saying which checkpoint a rerun resumes from).
    """
    from trace_jax import validate

    console = console if console is not None else Console()
    workdir = pathlib.Path(workdir)
    validate.validate(config)
    rundir.check_usable(workdir)
    rundir.check_same_run(workdir, config)
    console.attach_log(workdir / rundir.LOG_FILE)
    steps = config.rl.steps
    finished = rundir.finished_summary(workdir, config)
    if finished is not None:
        console.info(
            f"{workdir} is already complete: {steps} RL steps (summary.json); nothing to do. "
            f"To train it further, rerun with --config.rl.steps=N for some N > {steps}."
        )
        return finished
    try:
        return _train(config, workdir, console)
    except KeyboardInterrupt:
        done = rundir.checkpoint_steps(workdir)
        where = (
            f"the last checkpoint is step {done[-1]} in {workdir / rundir.CHECKPOINTS}; rerun the same command to "
            "resume from it"
            if done
            else "no checkpoint was written yet; rerun the same command to start again (a finished warm start is "
            "reused from its cache)"
        )
        raise Interrupted(f"interrupted; {where}") from None


def _train(config: ml_collections.ConfigDict, workdir: pathlib.Path, console: Console) -> dict[str, Any]:
    import jax

    from trace_jax import heap, recipe, validate
    from trace_jax.config_utils import from_config
    from trace_jax.metrics import MetricWriter, PhaseTimer, plot_metrics, read_jsonl
    from trace_jax.parallel import distributed

    distributed.initialize(from_config(distributed.DistributedConfig, config.distributed))
    validate.check_mesh(config, jax.device_count())
    console.log(f"start: {' '.join(sys.argv[1:]) or '(defaults)'}")
    recipe.save_run_config(config, workdir)
    timer = PhaseTimer()
    run = Training(config, workdir, console, timer)
    resumed = run.resume()
    steps = config.rl.steps
    writer = MetricWriter(workdir, resume_step=run.step if resumed else None)
    try:
        heap.release()  # the warm start's and setup's temporaries
        if resumed:
            console.info(f"resuming at RL step {run.step} of {steps} (checkpoint in {workdir / rundir.CHECKPOINTS})")
        else:
            run.eval_before = run.last_eval = run.evaluate("evaluation before RL")
            writer.write(0, _eval_metrics(run.eval_before))
            run.save(force=True)  # step 0: the evaluation above is logged once, whatever happens next
        with console.progress(steps, "TRACE RL", initial=run.step) as bar:
            while run.step < steps:
                with timer.phase("rl"):
                    metrics = run.rl_step()
                last = run.step == steps
                if last or (config.eval.every and run.step % config.eval.every == 0):
                    run.last_eval = run.evaluate(f"evaluation at step {run.step}", leave=False)
                    metrics.update(_eval_metrics(run.last_eval))
                writer.write(run.step, metrics)  # before the checkpoint: a resume never loses a step's record
                run.save(force=last)
                heap.release()  # the step's freed temporaries, back to the OS (see trace_jax.heap)
                bar.set_postfix(
                    reward=f"{metrics['rollout/mean_reward']:.2f}", eff=f"{metrics['alloc/effective_ratio']:.2f}"
                )
                bar.update(1)
    finally:
        writer.close()
        run.checkpointer.close()
    records = read_jsonl(workdir / "metrics.jsonl")
    for name, keys in PLOTS.items():
        plot_metrics(records, keys, workdir / "plots" / name)
    summary = _summary(run, records)
    final = dataclasses.replace(run.start, params=run.state.params, source=f"rl step {run.step}")
    summary["exports"] = run.source.finish(config, workdir, final)  # search_r1: the HF export
    _write_json(workdir / "eval_before.json", {"step": 0, "rows": run.eval_before})  # the warm start's scores
    _write_json(workdir / rundir.SUMMARY_FILE, summary)  # last: its presence marks the run finished
    console.log(f"finished: {run.step} RL steps")
    return summary


def summary_table(summary: dict[str, Any]) -> str:
    """Held-out EM per group before (SFT) and after RL, as a Markdown table."""
    from trace_jax.metrics import format_table

    after = {row["group"]: row for row in summary["eval_after"]}
    rows = [
        {
            "group": row["group"],
            "n": row["n"],
            "EM sft": row["em"],
            "EM rl": after[row["group"]]["em"],
            "F1 sft": row["f1"],
            "F1 rl": after[row["group"]]["f1"],
        }
        for row in summary["eval_before"]
    ]
    return format_table(rows)


def summary_line(summary: dict[str, Any]) -> str:
    """One line: steps, RL time and the other phases' times, mean effective ratio."""
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
        f"{'n/a' if ratio is None else f'{ratio:.3f}'}"
    )


# -------------------------------------------------------------------------------------------- command line
def _flag_value(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _verbosity(argv: list[str]) -> int:
    value = _flag_value(argv, "verbosity") or _flag_value(argv, "v")
    try:
        return int(value) if value is not None else 0
    except ValueError:
        return 0  # reported properly when the flags are parsed


def _flag_values(argv: list[str]) -> Any:
    """A fresh absl flag set for one command line (the global one keeps state between parses)."""
    from absl import flags
    from ml_collections import config_flags

    values = flags.FlagValues()
    # config_flags reads the --config.x overrides from the argv given here (sys.argv when None).
    config_flags.DEFINE_config_file(
        "config", str(DEFAULT_CONFIG), "Run config (a configs/*.py file).", flag_values=values, sys_argv=argv
    )
    flags.DEFINE_string("workdir", DEFAULT_WORKDIR, "Run directory: checkpoints, logs, plots.", flag_values=values)
    flags.DEFINE_bool("show_config", False, "Print every config key, its value and doc.", flag_values=values)
    flags.DEFINE_integer("verbosity", 0, "1 or more: library logs and tracebacks.", short_name="v", flag_values=values)
    return values


def load_config(argv: list[str]) -> tuple[ml_collections.ConfigDict, Any]:
    """The config of a command line (file, then ``--config.x=v`` overrides) and the parsed flags.

    Raises ``MissingFileError`` for a config file that does not exist and ``ConfigError`` for a config file
    that fails, an unknown key, a value of the wrong type or a stray argument; nothing else is touched.
    """
    from trace_jax.config_utils import load_config_file, unknown_overrides

    spec = _flag_value(argv, "config") or str(DEFAULT_CONFIG)
    path = pathlib.Path(spec.partition(":")[0])
    if not path.is_file():
        raise cli.MissingFileError(f"config file {path} does not exist; pass --config=configs/<name>.py")
    try:
        base = load_config_file(spec)
    except (ValueError, TypeError, KeyError) as e:
        raise cli.ConfigError(f"--config={spec}: {' '.join(str(e).split())}") from None
    problems = unknown_overrides([a for a in argv if a.startswith("--config.")], base)
    if problems:
        raise cli.ConfigError("; ".join(problems) + " (--show-config lists every key)")
    argv = [("--show_config" if arg == "--show-config" else arg) for arg in argv]
    if _flag_value(argv, "config") is None:  # named explicitly, so the overrides are parsed against it
        argv = [argv[0], f"--config={spec}", *argv[1:]]
    values = _flag_values(argv)
    try:
        rest = values(argv)
    except Exception as e:  # absl's flag errors and ml_collections' type errors for a --config.x value
        raise cli.ConfigError(f"{' '.join(str(e).split())} (see --help)") from None
    if len(rest) > 1:
        raise cli.ConfigError(f"unexpected arguments {rest[1:]}; options look like --config.rl.steps=40 (see --help)")
    return values.config, values


def _main(argv: list[str], console: Console) -> None:
    if any(arg in ("-h", "--help", "-help", "--helpshort", "--helpfull", "-?") for arg in argv[1:]):
        print(USAGE)
        return
    config, parsed = load_config(argv)
    if parsed.show_config:
        from trace_jax.schema import describe

        print(describe(config))
        return
    summary = train(config, parsed.workdir, console)
    print(f"\n{summary_line(summary)}")
    print(summary_table(summary))
    print(f"\nwrote {parsed.workdir}/summary.json, metrics.jsonl, tensorboard/, plots/, checkpoints/")


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code (see ``USAGE``)."""
    argv = list(sys.argv if argv is None else argv)
    verbosity = _verbosity(argv)
    cli.quiet_third_party(verbosity)
    console = Console(verbosity)
    return cli.run_main(lambda: _main(argv, console), console)


if __name__ == "__main__":
    sys.exit(main())
