"""Training-curve experiment: allocation policies compared at an equal generated-token budget, over seeds.

    python -m trace_jax.bench.train_curve [--seeds 0,1,2] [--policies trace,uniform] [--steps 16]
        [--prompts 8] [--tokens-per-prompt 240] [--eval-questions 100] [--eval-every 4]
        [--workdir runs/train_curve] [--warm-start DIR] [--compile-cache DIR] [--quick] [--report-only]
        [--out bench_results/train_curve.json]

Every (seed, policy) run is the main job, ``trace_jax.train.train``, on ``configs/ablation.py:<policy>`` with
a smaller RL budget and one change to the accounting: each step's budget is ``--tokens-per-prompt`` x
prompts *generated tokens* (``SchedulerConfig.tokens_per_prompt``) instead of a rollout count, so a policy
whose forks are cheaper gets more rollouts, not more tokens. All runs start from ONE SFT warm start (trained
once in ``WORKDIR/warm_start``, or copied from ``--warm-start``, which must hold ``sft/`` and ``tokenizer/``
of the default recipe), and share its held-out evaluation (greedy decoding of the same params gives the same
answers, so it is computed once and copied into each run as ``eval_before.json``).

The budget is planned on expected costs, so a step may spend a little more or less than its budget; the
tokens actually generated are read from each run's ``metrics.jsonl`` (``alloc/budget/generated_tokens``) and
the comparison is made at equal *cumulative* generated tokens: each run's held-out EM curve is linearly
interpolated between its evaluations onto a common token axis, and "EM @ equal tokens" is the EM at the
smallest total any run reached.

A run whose directory already holds a finished run is resumed, which only re-evaluates it, so adding seeds
to a finished experiment trains only the new ones; ``--report-only`` re-aggregates finished runs without any
training. Writes ``WORKDIR/<policy>_s<seed>/`` per run, PNGs in ``WORKDIR/plots/`` (EM vs generated tokens,
EM vs step, effective ratio vs step; mean ± std over seeds), and prints JSON with a Markdown table (also
written to ``--out``). With the defaults (3 seeds x 2 policies x 16 steps of 8 prompts, ~30 generated tokens
per rollout, so ~8 rollouts per prompt for ``uniform``) the whole bench took 9 minutes on 2 shared CPU cores
with a reused warm start (the SFT warm start itself takes ~3 more minutes when trained here).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import platform
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs"
SHARED_DIRS = ("sft", "tokenizer")  # what a run reuses from the one warm start
BEFORE_FILE = "eval_before.json"


@dataclasses.dataclass
class RunCurve:
    """What one (policy, seed) run logged, as numpy arrays.

    eval_steps / eval_em: int64 [E] / float64 [E], held-out EM at step 0 (the SFT policy) and later steps.
    steps / generated_tokens / rollouts / effective_ratio / reward: one entry per RL step, float64 [S].
    seconds: wall time of the run (0 when unknown).
    """

    policy: str
    seed: int
    eval_steps: np.ndarray
    eval_em: np.ndarray
    steps: np.ndarray
    generated_tokens: np.ndarray
    rollouts: np.ndarray
    effective_ratio: np.ndarray
    reward: np.ndarray
    seconds: float = 0.0

    def cumulative_tokens_at(self, steps: np.ndarray) -> np.ndarray:
        """float64: generated tokens spent by the end of each of ``steps`` (0 at step 0)."""
        cumulative = np.concatenate([[0.0], np.cumsum(self.generated_tokens)])
        return cumulative[np.searchsorted(np.concatenate([[0], self.steps]), steps, side="right") - 1]

    def em_at_tokens(self, tokens: np.ndarray) -> np.ndarray:
        """Held-out EM linearly interpolated at cumulative generated ``tokens`` (held flat past the last eval)."""
        return np.interp(tokens, self.cumulative_tokens_at(self.eval_steps), self.eval_em)


def run_curve(policy: str, seed: int, records: Sequence[Mapping[str, Any]], sft_em: float, seconds: float = 0.0):
    """A :class:`RunCurve` from a run's ``metrics.jsonl`` records and the SFT policy's held-out EM."""
    steps = [r for r in records if r.get("alloc/effective_ratio") is not None]
    if not steps:
        raise ValueError(f"run {policy} seed {seed} logged no RL step (is its metrics.jsonl empty?)")
    evals = {0: sft_em}
    for r in records:
        if r.get("eval/em") is not None:
            evals[int(r["step"])] = float(r["eval/em"])  # the last write of a step wins (the final eval)

    def column(key: str) -> np.ndarray:
        return np.asarray([r.get(key) if r.get(key) is not None else np.nan for r in steps], np.float64)

    eval_steps = np.asarray(sorted(evals), np.int64)
    return RunCurve(
        policy,
        seed,
        eval_steps,
        np.asarray([evals[s] for s in eval_steps], np.float64),
        np.asarray([r["step"] for r in steps], np.int64),
        column("alloc/budget/generated_tokens"),
        column("alloc/budget/rollouts"),
        column("alloc/effective_ratio"),
        column("rollout/mean_reward"),
        seconds,
    )


def _by_policy(runs: Sequence[RunCurve]) -> dict[str, list[RunCurve]]:
    groups: dict[str, list[RunCurve]] = {}
    for run in runs:
        groups.setdefault(run.policy, []).append(run)
    return groups


def aggregate(runs: Sequence[RunCurve], grid_points: int = 25) -> dict[str, Any]:
    """Per-policy mean ± std over seeds: the table rows, the curves, and EM at the common token budget.

    ``equal_tokens`` is the smallest cumulative generated-token total over all runs; every run has spent at
    least that much, so EM there compares policies at equal cost.
    """
    from trace_jax.metrics import format_mean_std, format_table, mean_std_curve

    if not runs:
        raise ValueError("no runs to aggregate")
    equal_tokens = float(min(run.generated_tokens.sum() for run in runs))
    grid = np.linspace(0.0, equal_tokens, grid_points)
    rows, curves, numbers = [], {}, {}
    for policy, group in _by_policy(runs).items():
        final_em = [run.eval_em[-1] for run in group]
        gain = [run.eval_em[-1] - run.eval_em[0] for run in group]
        em_equal = [float(run.em_at_tokens(np.asarray(equal_tokens))) for run in group]
        eff = [float(np.nanmean(run.effective_ratio)) for run in group]
        tokens = [float(run.generated_tokens.sum()) for run in group]
        rollouts = [float(run.rollouts.sum()) for run in group]
        per_step_tokens = [float(run.generated_tokens.mean()) for run in group]
        rows.append(
            {
                "policy": policy,
                "seeds": len(group),
                "EM sft": format_mean_std([run.eval_em[0] for run in group]),
                "EM final": format_mean_std(final_em),
                "EM gain": format_mean_std(gain),
                "EM @ equal tokens": format_mean_std(em_equal),
                "eff. ratio": format_mean_std(eff),
                "gen. tokens": format_mean_std(tokens, digits=0),
                "tokens/step": format_mean_std(per_step_tokens, digits=0),
                "rollouts": format_mean_std(rollouts, digits=0),
            }
        )
        numbers[policy] = {
            name: {"mean": float(np.mean(v)), "std": float(np.std(v)), "values": [float(x) for x in v]}
            for name, v in {
                "em_sft": [run.eval_em[0] for run in group],
                "em_final": final_em,
                "em_gain": gain,
                "em_at_equal_tokens": em_equal,
                "mean_effective_ratio": eff,
                "generated_tokens": tokens,
                "rollouts": rollouts,
                "seconds": [run.seconds for run in group],
            }.items()
        }
        em_tokens = mean_std_curve([(grid, run.em_at_tokens(grid)) for run in group])
        em_steps = mean_std_curve([(run.eval_steps, run.eval_em) for run in group])
        eff_steps = mean_std_curve([(run.steps, run.effective_ratio) for run in group])
        curves[policy] = {
            name: {"x": x.tolist(), "mean": m.tolist(), "std": s.tolist()}
            for name, (x, m, s) in {
                "em_vs_tokens": em_tokens,
                "em_vs_step": em_steps,
                "effective_ratio_vs_step": eff_steps,
            }.items()
        }
    return {
        "equal_tokens": equal_tokens,
        "table": rows,
        "markdown": format_table(rows),
        "policies": numbers,
        "curves": curves,
    }


def plot(runs: Sequence[RunCurve], equal_tokens: float, directory: pathlib.Path) -> list[str]:
    """Three PNGs (mean ± std over seeds per policy): EM vs generated tokens, EM vs step, effective ratio."""
    from trace_jax.metrics import plot_mean_std

    groups = _by_policy(runs)
    grid = np.linspace(0.0, equal_tokens, 25)
    figures = {
        "em_vs_tokens.png": (
            {p: [(grid, r.em_at_tokens(grid)) for r in g] for p, g in groups.items()},
            "cumulative generated tokens",
            "held-out EM",
        ),
        "em_vs_step.png": (
            {p: [(r.eval_steps, r.eval_em) for r in g] for p, g in groups.items()},
            "RL step",
            "held-out EM",
        ),
        "effective_ratio.png": (
            {p: [(r.steps, r.effective_ratio) for r in g] for p, g in groups.items()},
            "RL step",
            "effective ratio",
        ),
    }
    paths = []
    for name, (data, xlabel, ylabel) in figures.items():
        paths.append(str(plot_mean_std(data, directory / name, xlabel=xlabel, ylabel=ylabel, title=ylabel)))
    return paths


# ------------------------------------------------------------------------------------------- running
def run_config(policy: str, seed: int, args: argparse.Namespace):
    """``configs/ablation.py:<policy>`` with the experiment's budget; the SFT settings stay the default's."""
    from trace_jax.config_utils import load_config_file

    config = load_config_file(f"{CONFIG_DIR / 'ablation.py'}:{policy}")
    config.seed = seed
    config.allocation.seed = seed
    # Generated tokens are the currency; the rollout cap is only a backstop far above what the tokens buy.
    config.allocation.tokens_per_prompt = float(args.tokens_per_prompt)
    config.allocation.rollouts_per_prompt = float(args.max_rollouts_per_prompt)
    config.allocation.prior_tokens_per_rollout = float(args.prior_tokens_per_rollout)
    config.rl.steps = args.steps
    config.rl.prompts_per_step = args.prompts
    config.rl.checkpoint_every = args.steps  # checkpoints are for resuming, not for this comparison
    config.rl.keep_checkpoints = 1
    config.optim.total_steps = args.steps
    config.eval.num_questions = args.eval_questions
    config.eval.every = args.eval_every
    return config


def warm_start(args: argparse.Namespace, workdir: pathlib.Path) -> pathlib.Path:
    """The one SFT warm start every run copies: ``--warm-start`` copied in, else trained here (reused later)."""
    from trace_jax import recipe
    from trace_jax.config_utils import from_config
    from trace_jax.sft import SFTConfig, run_sft

    target = workdir / "warm_start"
    if args.warm_start and not (target / "sft").exists():
        source = pathlib.Path(args.warm_start)
        missing = [d for d in SHARED_DIRS if not (source / d).is_dir()]
        if missing:
            raise FileNotFoundError(f"--warm-start {source} lacks {missing}; pass a run dir of the default recipe")
        for name in SHARED_DIRS:
            shutil.copytree(source / name, target / name, dirs_exist_ok=True)
    config = run_config(args.policies[0], args.seeds[0], args)
    world = recipe.build_world(config, target)
    result = run_sft(from_config(SFTConfig, config.sft), world.world, world.tokenizer, target, env=world.env)
    print(
        f"warm start: {'reused' if result.restored else 'trained'} in {target} "
        f"(step {result.steps}, loss {result.final_loss:.3f})",
        file=sys.stderr,
    )
    return target


def run_one(policy: str, seed: int, args: argparse.Namespace, shared: pathlib.Path, workdir: pathlib.Path) -> RunCurve:
    """One training run through ``trace_jax.train.train`` (resumed if its workdir holds a checkpoint)."""
    from trace_jax.train import train

    rundir = workdir / f"{policy}_s{seed}"
    for name in SHARED_DIRS:
        if not (rundir / name).exists():
            shutil.copytree(shared / name, rundir / name)
    shared_before = shared / f"eval_before_{args.eval_questions}q.json"  # the SFT policy's eval on these questions
    if shared_before.is_file() and not (rundir / BEFORE_FILE).is_file():
        shutil.copy(shared_before, rundir / BEFORE_FILE)
    start = time.perf_counter()
    train(run_config(policy, seed, args), rundir)
    # Wall time over every bench call on this run: a rerun that only re-evaluates a finished run adds to it.
    seconds_file = rundir / "bench_seconds.json"
    previous = json.loads(seconds_file.read_text())["seconds"] if seconds_file.is_file() else 0.0
    seconds = previous + time.perf_counter() - start
    seconds_file.write_text(json.dumps({"seconds": seconds}) + "\n")
    if not shared_before.is_file():  # the first run evaluated the warm start: the others reuse it
        shutil.copy(rundir / BEFORE_FILE, shared_before)
    curve = load_run(policy, seed, rundir, seconds)
    print(
        f"{policy} seed {seed}: EM {curve.eval_em[0]:.3f} -> {curve.eval_em[-1]:.3f}, "
        f"{curve.generated_tokens.sum():.0f} generated tokens, {seconds:.0f} s",
        file=sys.stderr,
    )
    return curve


def load_run(policy: str, seed: int, rundir: pathlib.Path, seconds: float | None = None) -> RunCurve:
    """A finished run's curve from its directory (``metrics.jsonl``, ``eval_before.json``, ``summary.json``)."""
    from trace_jax.metrics import read_jsonl

    if not (rundir / "summary.json").is_file():
        raise FileNotFoundError(
            f"{rundir} holds no finished run (no summary.json); run the bench without --report-only"
        )
    summary = json.loads((rundir / "summary.json").read_text())
    before = json.loads((rundir / BEFORE_FILE).read_text())
    sft_em = next(row["em"] for row in before["rows"] if row["group"] == "all")
    if seconds is None:  # the bench's own record (all its calls on this run), else the last train() call's
        seconds_file = rundir / "bench_seconds.json"
        recorded = json.loads(seconds_file.read_text()) if seconds_file.is_file() else {}
        seconds = recorded.get("seconds", summary.get("total_seconds", 0.0))
    return run_curve(policy, seed, read_jsonl(rundir / "metrics.jsonl"), sft_em, seconds)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=_ints, default=[0, 1, 2], help="comma-separated run seeds")
    parser.add_argument("--policies", type=_names, default=["trace", "uniform"], help="allocation policies")
    parser.add_argument("--steps", type=int, default=16, help="RL steps per run")
    parser.add_argument("--prompts", type=int, default=8, help="training prompts per RL step")
    parser.add_argument("--tokens-per-prompt", type=float, default=240.0, help="generated-token budget per prompt")
    parser.add_argument("--max-rollouts-per-prompt", type=float, default=32.0, help="backstop rollout cap")
    parser.add_argument(
        "--prior-tokens-per-rollout", type=float, default=30.0, help="cost model's guess before its first tree"
    )
    parser.add_argument("--eval-questions", type=int, default=100, help="held-out (test split) questions")
    parser.add_argument("--eval-every", type=int, default=4, help="RL steps between held-out evaluations")
    parser.add_argument("--workdir", default="runs/train_curve")
    parser.add_argument("--warm-start", default=None, help="a run dir whose sft/ and tokenizer/ to start from")
    parser.add_argument(
        "--compile-cache", default=None, help="JAX compilation cache dir (default WORKDIR/jax_cache; 'none': off)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 seed, 2 steps, 4 prompts, 10 questions")
    parser.add_argument(
        "--report-only", action="store_true", help="aggregate the finished runs in WORKDIR, no training"
    )
    parser.add_argument("--out", default="bench_results/train_curve.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.steps, args.prompts, args.eval_questions, args.eval_every = args.seeds[:1], 2, 4, 10, 1
    if args.steps < 1 or args.prompts < 1 or args.eval_every < 1 or args.tokens_per_prompt <= 0:
        parser.error("--steps, --prompts, --eval-every and --tokens-per-prompt must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from absl import logging as absl_logging

    args = parse_args(argv)
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every checkpoint at INFO
    workdir = pathlib.Path(args.workdir)
    start = time.perf_counter()
    if args.compile_cache != "none":  # every run re-jits the same engine and train step: compile them once
        import jax

        jax.config.update("jax_compilation_cache_dir", str(args.compile_cache or workdir / "jax_cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if args.report_only:
        runs = [load_run(p, s, workdir / f"{p}_s{s}") for s in args.seeds for p in args.policies]
    else:
        shared = warm_start(args, workdir)
        runs = [run_one(policy, seed, args, shared, workdir) for seed in args.seeds for policy in args.policies]
    result = aggregate(runs)
    result["plots"] = plot(runs, result["equal_tokens"], workdir / "plots")
    result["runs"] = [
        {
            "policy": r.policy,
            "seed": r.seed,
            "eval_steps": r.eval_steps.tolist(),
            "eval_em": r.eval_em.tolist(),
            "generated_tokens": r.generated_tokens.tolist(),
            "rollouts": r.rollouts.tolist(),
            "effective_ratio": r.effective_ratio.tolist(),
            "reward": r.reward.tolist(),
            "seconds": r.seconds,
        }
        for r in runs
    ]
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    import jax

    result["setup"] = {**settings, "command": "python -m trace_jax.bench.train_curve " + " ".join(sys.argv[1:])}
    result["machine"] = {"platform": platform.platform(), "jax_devices": [str(d) for d in jax.devices()]}
    result["wall_seconds"] = time.perf_counter() - start
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("markdown", "curves", "runs")}, indent=2))
    print("\n" + result["markdown"])
    return result


if __name__ == "__main__":
    main()
