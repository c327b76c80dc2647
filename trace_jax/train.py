"""The main job: synthetic world -> tokenizer -> SFT warm start -> TRACE RL, with evaluation around it.

    python -m trace_jax.train                                     # configs/default.py, ./runs/default
    python -m trace_jax.train --config=configs/ablation.py:uniform --workdir=runs/uniform
    python -m trace_jax.train --config.rl.steps=40 --config.optim.learning_rate=1e-5

Each RL step: a batch of training questions becomes trees under the allocation policy's budget
(``TreeScheduler``), the trees become advantages and a ``TrainBatch``, and one jit'd update runs under the
mesh. Written to the workdir: ``metrics.jsonl``, TensorBoard events (``tensorboard/``), PNG plots (``plots/``),
orbax checkpoints of the whole state (``checkpoints/``; a rerun resumes from the latest good one), the
warm start (``sft/``), ``summary.json`` and the run's ``config.json``.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags
from tqdm import tqdm

from trace_jax import figures, recipe, recipes
from trace_jax.checkpoint.state import StateCheckpointer
from trace_jax.config_utils import from_config, load_config_file, unknown_overrides
from trace_jax.evaluate import evaluate
from trace_jax.metrics import MetricWriter, format_table, plot_metrics, read_jsonl
from trace_jax.models.qwen import abstract_model
from trace_jax.optim import make_optimizer
from trace_jax.parallel import distributed
from trace_jax.parallel.mesh import make_mesh, shard_state
from trace_jax.rl.advantages import compute_advantages
from trace_jax.rl.batch import BatchConfig, build_batch
from trace_jax.rl.losses import LossConfig
from trace_jax.rl.trainer import RLTrainer
from trace_jax.rollout.tree import RolloutTree

DEFAULT_CONFIG = pathlib.Path(__file__).resolve().parents[1] / "configs" / "default.py"
PLOTS = {
    "reward.png": ["rollout/mean_reward", "eval/em"],
    "effective_ratio.png": ["alloc/effective_ratio", "alloc/nonzero_adv_token_share"],
}


@dataclasses.dataclass
class EvalLog:
    step: int
    rows: list[dict[str, Any]]


def _eval(runner, world: recipe.World, config: ml_collections.ConfigDict, step: int) -> EvalLog:
    tasks = world.world.questions(config.eval.split)
    if config.eval.num_questions < len(tasks):  # evenly spaced: the split is ordered by hops, keep every group
        picked = np.linspace(0, len(tasks) - 1, config.eval.num_questions).round().astype(int)
        tasks = [tasks[i] for i in picked]
    return EvalLog(step, evaluate(runner, world.env, tasks, samples=1).rows)


def _eval_metrics(result: EvalLog) -> dict[str, float]:
    return {f"eval/em/{row['group']}" if row["group"] != "all" else "eval/em": row["em"] for row in result.rows}


class Training:
    """Everything one run holds between steps, and the step itself."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: pathlib.Path):
        self.config, self.workdir = config, workdir
        self.source = recipes.source_of(config)  # synthetic world + SFT, or a HF checkpoint + Search-R1 data
        self.world = self.source.build_world(config, workdir)
        self.mesh = make_mesh(**config.mesh)
        policy = self.source.initial_policy(config, workdir, self.world, self.mesh)
        self.sft_seconds = policy.seconds
        self.model_config = policy.model_config
        params = shard_state(policy.params, self.mesh)
        loss_config = from_config(LossConfig, config.loss)
        self.trainer = RLTrainer(
            abstract_model(self.model_config)[0],
            make_optimizer(config.optim),
            loss_config,
            mesh=self.mesh,
            micro_batches=config.rl.micro_batches,
            reference_params=params if loss_config.kl_coef else None,  # the trainer keeps its own copy
            recompute_old_logprobs=config.rl.recompute_old_logprobs,
        )
        self.state = self.trainer.init_state(params, jax.random.key(config.seed))
        self.batch_config = from_config(
            BatchConfig, config.batch, row_multiple=self.trainer.row_multiple, pad_id=self.world.tokenizer.pad_token_id
        )
        self.runner = recipe.build_runner(config, self.model_config, self.state.params, self.world, seed=config.seed)
        self.eval_runner = recipe.build_runner(config, self.model_config, self.state.params, self.world, greedy=True)
        self.scheduler = recipe.build_scheduler(config, self.runner)
        self.prompts = self.source.prompt_stream(config, self.world)
        self.checkpointer = StateCheckpointer(
            workdir / recipe.CHECKPOINTS, save_every=config.rl.checkpoint_every, keep=config.rl.keep_checkpoints
        )
        self.step = 0

    # ------------------------------------------------------------------------------------ checkpoints
    def save(self, force: bool = False) -> None:
        # The policy is its own entry (evaluation restores just it); "train" holds the rest of the state once.
        state = {
            "params": self.state.params,
            "train": self.state._replace(params=None),
            "scheduler": self.scheduler.state_dict(),
        }
        metadata = {"prompts": self.prompts.state_dict(), "runner": self.runner.state_dict()}
        self.checkpointer.save(self.step, state, metadata, force=force)

    def resume(self) -> bool:
        # The scheduler state has data-dependent shapes (a replay buffer that grows): restore it as saved.
        target = {"params": self.state.params, "train": self.state._replace(params=None), "scheduler": None}
        restored = self.checkpointer.restore_latest(target=target)
        if restored is None:
            return False
        self.state = restored.state["train"]._replace(params=restored.state["params"])
        self.scheduler.load_state_dict(restored.state["scheduler"])
        self.prompts.load_state_dict(restored.metadata["prompts"])
        self.runner.load_state_dict(restored.metadata["runner"])
        self._set_params()
        self.step = restored.step
        return True

    def _set_params(self) -> None:
        self.runner.set_params(self.state.params)
        self.eval_runner.set_params(self.state.params)

    # ------------------------------------------------------------------------------------------- step
    def rl_step(self) -> dict[str, float]:
        """One RL update; returns its metrics (rollout, allocation, loss, timings)."""
        start = time.perf_counter()
        tasks = self.prompts.next_batch()
        trees = [RolloutTree(self.world.env.prompt_ids(task), task, i) for i, task in enumerate(tasks)]
        scheduled = self.scheduler.run(trees)
        rollout_seconds = time.perf_counter() - start
        advantages = compute_advantages(self.config.rl.advantage, scheduled.trees)
        batch, info = build_batch(scheduled.trees, advantages, self.batch_config)
        batch = self.trainer.prepare(self.state, batch)
        self.state, train_metrics = self.trainer.train_step(self.state, batch)
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

    def evaluate(self) -> EvalLog:
        return _eval(self.eval_runner, self.world, self.config, self.step)


def train(config: ml_collections.ConfigDict, workdir: str | pathlib.Path) -> dict[str, Any]:
    """Runs (or resumes) the whole recipe; returns the summary also written to ``workdir/summary.json``."""
    workdir = pathlib.Path(workdir)
    distributed.initialize(from_config(distributed.DistributedConfig, config.distributed))
    recipe.save_run_config(config, workdir)
    run_start = time.perf_counter()
    run = Training(config, workdir)
    resumed = run.resume()
    writer = MetricWriter(workdir, resume_step=run.step if resumed else None)
    before_path = workdir / "eval_before.json"
    if before_path.is_file():
        before = EvalLog(**json.loads(before_path.read_text()))
    else:
        before = run.evaluate()
        before_path.write_text(json.dumps(dataclasses.asdict(before)) + "\n")
        writer.write(run.step, _eval_metrics(before))
    rl_start = time.perf_counter()
    with tqdm(total=config.rl.steps, initial=run.step, desc="TRACE RL", unit="step") as progress:
        while run.step < config.rl.steps:
            metrics = run.rl_step()
            if config.eval.every and run.step % config.eval.every == 0 and run.step < config.rl.steps:
                metrics.update(_eval_metrics(run.evaluate()))
            writer.write(run.step, metrics)
            run.save()
            progress.set_postfix(
                reward=f"{metrics['rollout/mean_reward']:.2f}", eff=f"{metrics['alloc/effective_ratio']:.2f}"
            )
            progress.update(1)
    after = run.evaluate()
    writer.write(run.step, _eval_metrics(after))
    run.save(force=True)
    run.checkpointer.close()
    final = recipes.Policy(run.model_config, run.state.params, f"rl step {run.step}")
    exports = run.source.finish(config, workdir, final)
    writer.close()
    records = read_jsonl(workdir / "metrics.jsonl")
    for name, keys in PLOTS.items():
        plot_metrics(records, keys, workdir / "plots" / name)
    steps = [r for r in records if "alloc/effective_ratio" in r]
    summary = {
        "policy": config.allocation.policy,
        "steps": run.step,
        "resumed": resumed,
        "eval_before": before.rows,
        "eval_after": after.rows,
        "mean_effective_ratio": float(np.mean([r["alloc/effective_ratio"] for r in steps])) if steps else None,
        "generated_tokens": float(sum(r.get("alloc/budget/generated_tokens", 0.0) for r in steps)),
        "sft_seconds": run.sft_seconds,
        "rl_seconds": time.perf_counter() - rl_start,
        "total_seconds": time.perf_counter() - run_start,
        "exports": exports,
    }
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def summary_table(summary: dict[str, Any]) -> str:
    """Held-out EM per group before (SFT) and after RL, as a Markdown table."""
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


def check_overrides(argv: list[str]) -> None:
    """Exits with a clear message naming each unknown ``--config.x`` key and the nearest real keys."""
    spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), str(DEFAULT_CONFIG))
    overrides = [a for a in argv if a.startswith("--config.")]
    problems = unknown_overrides(overrides, load_config_file(spec)) if overrides else []
    if problems:
        sys.exit("error: " + "; ".join(problems))


def define_flags() -> None:
    config_flags.DEFINE_config_file("config", str(DEFAULT_CONFIG), "Run config (a configs/*.py file).")
    flags.DEFINE_string("workdir", "./runs/default", "Run directory: checkpoints, logs, plots.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    # orbax logs every checkpoint operation at INFO through absl; keep the console to the progress bar.
    absl_logging.set_verbosity(absl_logging.WARNING)
    summary = train(flags.FLAGS.config, flags.FLAGS.workdir)
    ratio = summary["mean_effective_ratio"]
    print(
        f"\nTRACE RL ({summary['policy']}): {summary['steps']} steps in {summary['total_seconds']:.0f} s "
        f"(SFT {summary['sft_seconds']:.0f} s); mean effective ratio {'n/a' if ratio is None else f'{ratio:.3f}'}"
    )
    print(summary_table(summary))
    print(f"\nwrote {flags.FLAGS.workdir}/summary.json, metrics.jsonl, tensorboard/, plots/, checkpoints/")


if __name__ == "__main__":
    check_overrides(sys.argv)  # before config_flags, which fails on a bad key with a bare traceback
    define_flags()
    app.run(main)
