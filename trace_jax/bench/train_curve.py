"""Training-curve experiment: allocation policies compared at an equal generated-token budget, over seeds.

    python -m trace_jax.bench.train_curve [--config-file configs/ablation.py] [--seeds 0,1,2]
        [--policies trace,uniform] [--steps 16] [--prompts 8] [--tokens-per-prompt 240] [--eval-questions 100]
        [--eval-every 4] [--pool-size 32 --epochs 3] [--workdir runs/train_curve] [--compile-cache DIR] [--quick]
        [--report-only] [--out bench_results/train_curve.json]

Every (seed, policy) run is the main job, ``trace_jax.job.train.train``, on ``<config-file>:<policy>`` (default
``configs/ablation.py``; ``configs/realistic.py`` is the realistic-difficulty world) with a smaller RL budget
and one change to the accounting: each step's budget is ``--tokens-per-prompt`` x prompts *generated tokens*
(``SchedulerConfig.tokens_per_prompt``) instead of a rollout count, so a policy whose forks are cheaper gets
more rollouts, not more tokens. All runs start from ONE SFT warm start (the config's entry of the warm-start
cache, trained there once), and share its held-out evaluation (greedy decoding of the same params gives the
same answers, so it is computed once and copied into each run as ``eval_before.json``).

The budget is planned on expected costs, so a step may spend a little more or less than its budget; the
tokens actually generated are read from each run's ``metrics.jsonl`` (``alloc/budget/generated_tokens``) and
the comparison is made at equal *cumulative* generated tokens: each run's held-out EM curve is linearly
interpolated between its evaluations onto a common token axis, and "EM @ equal tokens" is the EM at the
smallest total any run reached ("EM @ equal time" likewise on cumulative RL-step wall seconds, evaluations
excluded). With several policies over the same seeds, ``paired`` holds per-seed differences against the
first policy named ``uniform`` (else the last one): mean, standard error and wins, and the ratio of mean
effective ratios; ``paired_by_baseline`` the same against each of ``uniform`` and ``dynamic_sampling`` that ran.
``policies.<name>.group_em_change`` is the held-out EM change (final − SFT) per question group (hops, buried,
trivial), where a drop in EM comes from.

Multi-epoch runs: ``--pool-size N --epochs E`` trains on a pool of N train questions (``rl.pool_size``), each
visited once per epoch in a fresh seeded order, for E epochs: ``--steps`` is then derived per policy
(``schema.steps_for_epochs``; a policy that draws more candidates a step has fewer steps an epoch). Each
run's per-step predictor figures on held-out anchors (AUC on roots and on prefixes, and without history where
an arm measures that) are averaged per epoch in ``policies.<name>.per_epoch``.

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

import jax
import numpy as np
from absl import logging as absl_logging

from trace_jax.configs import load_config_file, schema, validate
from trace_jax.job import build
from trace_jax.job.metrics import format_mean_std, format_table, mean_std_curve, plot_mean_std, read_jsonl
from trace_jax.job.train import train

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs"
BEFORE_FILE = "eval_before.json"
WARMUP_KEYS = ("alloc/warmup/generated_tokens", "time/warmup_s")  # the predictor warm-up's cost, at step 0
# Per-step figures kept beside the main ones: the predictor on held-out anchors, by kind, with and without
# history (``SchedulerConfig.compare_without_history``), the stage-2 gate, and prompt selection (``select/*``:
# tokens its probes spent on dropped candidates, buried questions dropped and kept, its scores' AUC for mixed
# groups).
PER_STEP_KEYS = {
    "root_auc": "alloc/predictor/root/auc",
    "root_brier": "alloc/predictor/root/brier",
    "prefix_auc": "alloc/predictor/prefix/auc",
    "prefix_brier": "alloc/predictor/prefix/brier",
    "no_history_root_auc": "alloc/predictor/no_history/root/auc",
    "no_history_prefix_auc": "alloc/predictor/no_history/prefix/auc",
    "gate_open": "alloc/gate/open",
    "select_dropped_tokens": "alloc/select/dropped_tokens",
    "select_dropped_buried": "alloc/select/dropped/buried",
    "select_kept_buried": "alloc/select/kept/buried",
    "select_mixed_auc": "alloc/select/mixed_auc",
}


@dataclasses.dataclass
class RunCurve:
    """What one (policy, seed) run logged, as numpy arrays.

    eval_steps / eval_em: int64 [E] / float64 [E], held-out EM at step 0 (the SFT policy) and later steps.
    steps / generated_tokens / rollouts / effective_ratio / reward / step_seconds: one entry per RL step,
      float64 [S] (step_seconds: the step's wall time, rollouts + update; NaN when not logged).
    predictor_auc / predictor_brier: float64 [S], the success predictor's figures on each step's anchors
      before it learns from them (NaN for policies without a predictor).
    signal_token_share: float64 [S], the share of each step's generated tokens that carry a non-zero advantage
      (what allocation is for; the simulator's "non-zero-advantage tokens"; NaN when not logged).
    seconds: wall time of the run (0 when unknown).
    warmup_tokens / warmup_seconds: the predictor warm-up's generated tokens and wall seconds before step 1
      (``alloc/warmup/generated_tokens``, ``time/warmup_s``; 0 without one): both cost axes start there.
    extra: float64 [S] per logged key of :data:`PER_STEP_KEYS` (predictor figures on roots and prefixes, with
      and without history, the stage-2 gate, prompt selection), NaN where a step did not log it.
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
    step_seconds: np.ndarray | None = None
    predictor_auc: np.ndarray | None = None
    predictor_brier: np.ndarray | None = None
    seconds: float = 0.0
    signal_token_share: np.ndarray | None = None
    warmup_tokens: float = 0.0
    warmup_seconds: float = 0.0
    extra: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    steps_per_epoch: int = 0  # RL steps of one pass over the prompt pool; 0: no pool (fresh prompts)
    # Held-out EM per question group (``eval/em/<group>``): the SFT policy's and the last evaluation's.
    group_em_sft: dict[str, float] = dataclasses.field(default_factory=dict)
    group_em_final: dict[str, float] = dataclasses.field(default_factory=dict)
    group_questions: dict[str, int] = dataclasses.field(default_factory=dict)  # held-out questions per group

    def group_em_change(self) -> dict[str, float]:
        """Per question group both evaluations scored: final EM minus the SFT policy's."""
        return {g: self.group_em_final[g] - em for g, em in self.group_em_sft.items() if g in self.group_em_final}

    def per_epoch(self) -> dict[str, list[float]]:
        """Each :data:`PER_STEP_KEYS` figure and the effective ratio, averaged over each epoch's steps (NaN-aware);
        {} for a run without a pool."""
        if not self.steps_per_epoch:
            return {}
        epoch = (self.steps - 1) // self.steps_per_epoch
        columns = {**self.extra, "effective_ratio": self.effective_ratio}
        return {
            name: [_nanmean(values[epoch == e]) for e in range(int(epoch.max()) + 1)]
            for name, values in columns.items()
        }

    @property
    def total_tokens(self) -> float:
        """Generated tokens of the whole run, the predictor warm-up included."""
        return self.warmup_tokens + float(self.generated_tokens.sum())

    def cumulative_tokens_at(self, steps: np.ndarray) -> np.ndarray:
        """float64: generated tokens spent by the end of each of ``steps`` (the warm-up's at step 0)."""
        cumulative = self.warmup_tokens + np.concatenate([[0.0], np.cumsum(self.generated_tokens)])
        return cumulative[np.searchsorted(np.concatenate([[0], self.steps]), steps, side="right") - 1]

    def em_at_tokens(self, tokens: np.ndarray) -> np.ndarray:
        """Held-out EM linearly interpolated at cumulative generated ``tokens`` (held flat past the last eval)."""
        return np.interp(tokens, self.cumulative_tokens_at(self.eval_steps), self.eval_em)

    def cumulative_seconds_at(self, steps: np.ndarray) -> np.ndarray:
        """float64: RL-step wall seconds spent by the end of each of ``steps`` (the warm-up's at step 0; NaN steps
        count 0)."""
        per_step = np.zeros(len(self.steps)) if self.step_seconds is None else np.nan_to_num(self.step_seconds)
        cumulative = self.warmup_seconds + np.concatenate([[0.0], np.cumsum(per_step)])
        return cumulative[np.searchsorted(np.concatenate([[0], self.steps]), steps, side="right") - 1]

    def em_at_seconds(self, seconds: np.ndarray) -> np.ndarray:
        """Held-out EM linearly interpolated at cumulative RL-step wall ``seconds``."""
        return np.interp(seconds, self.cumulative_seconds_at(self.eval_steps), self.eval_em)

    @property
    def total_step_seconds(self) -> float:
        return float(self.cumulative_seconds_at(self.steps[-1:])[0])


def run_curve(
    policy: str,
    seed: int,
    records: Sequence[Mapping[str, Any]],
    sft_em: float,
    seconds: float = 0.0,
    steps_per_epoch: int = 0,
    sft_group_em: Mapping[str, float] | None = None,
    group_questions: Mapping[str, int] | None = None,
):
    """A :class:`RunCurve` from a run's ``metrics.jsonl`` records and the SFT policy's held-out EM (overall, and
    per question group when ``sft_group_em`` is given)."""
    steps = [r for r in records if r.get("alloc/effective_ratio") is not None]
    if not steps:
        raise ValueError(f"run {policy} seed {seed} logged no RL step (is its metrics.jsonl empty?)")
    evals = {0: sft_em}
    warmup = {k: float(r[k]) for r in records if r.get("step") == 0 for k in WARMUP_KEYS if r.get(k) is not None}
    prefix = "eval/em/"
    final_groups: dict[str, float] = {}  # per question group, the last evaluation's
    for r in records:
        if r.get("eval/em") is not None:
            evals[int(r["step"])] = float(r["eval/em"])  # the last write of a step wins (the final eval)
            final_groups = {k[len(prefix) :]: float(v) for k, v in r.items() if k.startswith(prefix)}

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
        column("time/step_s"),
        column("alloc/predictor/auc"),
        column("alloc/predictor/brier"),
        seconds,
        column("alloc/nonzero_adv_token_share"),
        warmup.get(WARMUP_KEYS[0], 0.0),
        warmup.get(WARMUP_KEYS[1], 0.0),
        {name: column(key) for name, key in PER_STEP_KEYS.items()},
        steps_per_epoch,
        dict(sft_group_em or {}),
        final_groups,
        dict(group_questions or {}),
    )


def _by_policy(runs: Sequence[RunCurve]) -> dict[str, list[RunCurve]]:
    groups: dict[str, list[RunCurve]] = {}
    for run in runs:
        groups.setdefault(run.policy, []).append(run)
    return groups


def _nanmean(values: np.ndarray | None) -> float:
    """Mean over the finite entries (NaN when there are none)."""
    if values is None or not np.isfinite(values).any():
        return float("nan")
    return float(np.nanmean(values))


def baseline_policy(policies: Sequence[str]) -> str:
    """The policy paired differences are taken against: ``uniform`` when it ran, else the last one."""
    return "uniform" if "uniform" in policies else policies[-1]


# The baselines every other policy is paired against, when they ran: the flat sampler, and the strongest
# budget-reallocating baseline (DAPO's dynamic sampling).
BASELINES = ("uniform", "dynamic_sampling")


def paired_differences(
    runs: Sequence[RunCurve], equal_tokens: float, equal_seconds: float, baseline: str | None = None
) -> dict[str, Any]:
    """Per policy, its per-seed differences from ``baseline`` (default :func:`baseline_policy`) on the seeds both
    ran: EM at equal tokens, EM at equal time, EM at the last evaluation (equal updates: every run makes the
    same number of steps, whatever tokens its steps take), mean effective ratio, mean share of generated tokens
    with a non-zero advantage. Each: mean, standard error (std with ddof=1 over sqrt(n); NaN for one seed), n and wins
    (seeds where the policy is strictly ahead). ``effective_ratio_times``: the policy's mean effective ratio over
    those seeds divided by the baseline's (the "× uniform's effective ratio" of the evidence)."""
    groups = _by_policy(runs)
    baseline = baseline_policy(list(groups)) if baseline is None else baseline
    if baseline not in groups:
        raise ValueError(f"baseline {baseline!r} did not run (policies: {sorted(groups)})")
    base = {run.seed: run for run in groups[baseline]}
    figures = {
        "em_at_equal_tokens": lambda r: float(r.em_at_tokens(np.asarray(equal_tokens))),
        "em_at_equal_time": lambda r: float(r.em_at_seconds(np.asarray(equal_seconds))),
        "em_final": lambda r: float(r.eval_em[-1]),
        "mean_effective_ratio": lambda r: float(np.nanmean(r.effective_ratio)),
        "mean_signal_token_share": lambda r: _nanmean(r.signal_token_share),
    }
    out: dict[str, Any] = {"baseline": baseline, "policies": {}}
    for policy, group in groups.items():
        if policy == baseline:
            continue
        pairs = [(run, base[run.seed]) for run in group if run.seed in base]
        if not pairs:
            continue
        rows: dict[str, Any] = {}
        for name, figure in figures.items():
            diff = np.asarray([figure(a) - figure(b) for a, b in pairs])
            se = float(np.std(diff, ddof=1) / np.sqrt(diff.size)) if diff.size > 1 else float("nan")
            rows[name] = {"mean": float(diff.mean()), "se": se, "n": int(diff.size), "wins": int((diff > 0).sum())}
        ratio = figures["mean_effective_ratio"]
        rows["effective_ratio_times"] = float(
            np.mean([ratio(a) for a, _ in pairs]) / np.mean([ratio(b) for _, b in pairs])
        )
        out["policies"][policy] = rows
    return out


def paired_markdown(paired: Mapping[str, Any]) -> str:
    """The paired-difference table: one row per policy, ``mean ± s.e. (wins/n)`` per figure, and the ratio of
    mean effective ratios."""
    lines = [
        f"| policy − {paired['baseline']} (paired by seed) | EM @ equal tokens | EM @ equal time "
        f"| EM final (equal updates) | eff. ratio | eff. ratio ÷ {paired['baseline']}'s | signal tokens |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for policy, rows in paired["policies"].items():
        cell = lambda r: f"{r['mean']:+.4f} ± {r['se']:.4f} ({r['wins']}/{r['n']})"
        cells = [
            cell(rows["em_at_equal_tokens"]),
            cell(rows["em_at_equal_time"]),
            cell(rows["em_final"]),
            cell(rows["mean_effective_ratio"]),
            f"{rows['effective_ratio_times']:.2f}×",
            cell(rows["mean_signal_token_share"]),
        ]
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def group_em_markdown(numbers: Mapping[str, Any]) -> str:
    """Held-out EM change (final − SFT) per question group, mean over seeds, one row per policy; "" when no
    run logged per-group EM."""
    changes = {
        policy: figures["group_em_change"] for policy, figures in numbers.items() if figures.get("group_em_change")
    }
    if not changes:
        return ""
    groups = {g: n["questions"] for by_group in changes.values() for g, n in by_group.items()}
    lines = [
        "| held-out EM change by group (final − SFT) | "
        + " | ".join(f"{g} ({n} q.)" if n else g for g, n in groups.items())
        + " |",
        "| --- |" + " --- |" * len(groups),
    ]
    for policy, by_group in changes.items():
        cells = [f"{by_group[g]['mean']:+.3f}" if g in by_group else "" for g in groups]
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def aggregate(runs: Sequence[RunCurve], grid_points: int = 25) -> dict[str, Any]:
    """Per-policy mean ± std over seeds: the table rows, the curves, EM at the common token and time budgets,
    and paired per-seed differences against the baseline (:func:`paired_differences`).

    ``equal_tokens`` is the smallest cumulative generated-token total over all runs; every run has spent at
    least that much, so EM there compares policies at equal cost. ``equal_seconds`` likewise for RL-step wall
    time (0 when no run logged step times).
    """

    if not runs:
        raise ValueError("no runs to aggregate")
    equal_tokens = float(min(run.total_tokens for run in runs))
    equal_seconds = float(min(run.total_step_seconds for run in runs))
    grid = np.linspace(0.0, equal_tokens, grid_points)
    time_grid = np.linspace(0.0, equal_seconds, grid_points)
    rows, curves, numbers = [], {}, {}
    for policy, group in _by_policy(runs).items():
        final_em = [run.eval_em[-1] for run in group]
        gain = [run.eval_em[-1] - run.eval_em[0] for run in group]
        em_equal = [float(run.em_at_tokens(np.asarray(equal_tokens))) for run in group]
        em_time = [float(run.em_at_seconds(np.asarray(equal_seconds))) for run in group]
        eff = [float(np.nanmean(run.effective_ratio)) for run in group]
        signal = [_nanmean(run.signal_token_share) for run in group]
        tokens = [run.total_tokens for run in group]
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
                "EM @ equal time": format_mean_std(em_time),
                "eff. ratio": format_mean_std(eff),
                "signal tokens": format_mean_std(signal),
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
                "em_at_equal_time": em_time,
                "mean_effective_ratio": eff,
                "mean_signal_token_share": signal,
                "generated_tokens": tokens,
                "rollouts": rollouts,
                "seconds": [run.seconds for run in group],
                "predictor_auc": [_nanmean(run.predictor_auc) for run in group],
                "predictor_brier": [_nanmean(run.predictor_brier) for run in group],
            }.items()
        }
        by_group = [run.group_em_change() for run in group]
        shared_groups = [g for g in by_group[0] if all(g in changes for changes in by_group)]
        if shared_groups:  # per question group both evaluations scored in every seed
            numbers[policy]["group_em_change"] = {
                g: {
                    "mean": float(np.mean([c[g] for c in by_group])),
                    "std": float(np.std([c[g] for c in by_group])),
                    "values": [float(c[g]) for c in by_group],
                    "questions": group[0].group_questions.get(g, 0),
                }
                for g in shared_groups
            }
        epochs = [run.per_epoch() for run in group if run.steps_per_epoch]
        if epochs:  # per figure: mean over seeds of each epoch's mean, and the per-seed values
            numbers[policy]["per_epoch"] = {
                name: {
                    "mean": np.nanmean([e[name] for e in epochs], axis=0).tolist(),
                    "values": [e[name] for e in epochs],
                }
                for name in epochs[0]
                if len({len(e[name]) for e in epochs}) == 1 and np.isfinite([e[name] for e in epochs]).any()
            }
        em_tokens = mean_std_curve([(grid, run.em_at_tokens(grid)) for run in group])
        em_seconds = mean_std_curve([(time_grid, run.em_at_seconds(time_grid)) for run in group])
        em_steps = mean_std_curve([(run.eval_steps, run.eval_em) for run in group])
        eff_steps = mean_std_curve([(run.steps, run.effective_ratio) for run in group])
        curves[policy] = {
            name: {"x": x.tolist(), "mean": m.tolist(), "std": s.tolist()}
            for name, (x, m, s) in {
                "em_vs_tokens": em_tokens,
                "em_vs_seconds": em_seconds,
                "em_vs_step": em_steps,
                "effective_ratio_vs_step": eff_steps,
            }.items()
        }
    ran = list(dict.fromkeys(run.policy for run in runs))
    default = baseline_policy(ran)
    paired_by_baseline = {
        baseline: paired_differences(runs, equal_tokens, equal_seconds, baseline)
        for baseline in dict.fromkeys([default, *BASELINES])
        if baseline in ran
    }
    paired = paired_by_baseline[default]
    markdown = format_table(rows)
    for table in paired_by_baseline.values():
        if table["policies"]:
            markdown += "\n\n" + paired_markdown(table)
    group_table = group_em_markdown(numbers)
    if group_table:
        markdown += "\n\n" + group_table
    return {
        "equal_tokens": equal_tokens,
        "equal_seconds": equal_seconds,
        "table": rows,
        "markdown": markdown,
        "policies": numbers,
        "paired": paired,
        "paired_by_baseline": paired_by_baseline,
        "curves": curves,
    }


def plot(
    runs: Sequence[RunCurve], equal_tokens: float, directory: pathlib.Path, equal_seconds: float = 0.0
) -> list[str]:
    """PNGs (mean ± std over seeds per policy): EM vs generated tokens, EM vs step, effective ratio vs step and
    vs generated tokens, and EM vs RL wall seconds when step times were logged (``equal_seconds`` > 0)."""

    groups = _by_policy(runs)
    grid = np.linspace(0.0, equal_tokens, 25)
    figures = {
        "em_vs_tokens.png": (
            {p: [(grid, r.em_at_tokens(grid)) for r in g] for p, g in groups.items()},
            "cumulative generated tokens",
            "held-out EM",
        ),
        "effective_ratio_vs_tokens.png": (
            {
                p: [
                    (grid, np.interp(grid, r.warmup_tokens + np.cumsum(r.generated_tokens), r.effective_ratio))
                    for r in g
                ]
                for p, g in groups.items()
            },
            "cumulative generated tokens",
            "effective ratio",
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
    if equal_seconds > 0:
        time_grid = np.linspace(0.0, equal_seconds, 25)
        figures["em_vs_seconds.png"] = (
            {p: [(time_grid, r.em_at_seconds(time_grid)) for r in g] for p, g in groups.items()},
            "cumulative RL-step wall seconds",
            "held-out EM",
        )
    paths = []
    for name, (data, xlabel, ylabel) in figures.items():
        paths.append(str(plot_mean_std(data, directory / name, xlabel=xlabel, ylabel=ylabel, title=ylabel)))
    return paths


# ------------------------------------------------------------------------------------------- running
def run_config(policy: str, seed: int, args: argparse.Namespace):
    """``<config-file>:<policy>`` with the experiment's budget, as the run's ``RunConfig``; the world and SFT
    settings stay the file's."""

    config = load_config_file(f"{args.config_file}:{policy}")
    config.seed = seed
    config.allocation.seed = seed
    # Generated tokens are the currency; the rollout cap is only a backstop far above what the tokens buy.
    config.allocation.tokens_per_prompt = float(args.tokens_per_prompt)
    config.allocation.rollouts_per_prompt = float(args.max_rollouts_per_prompt)
    config.allocation.prior_tokens_per_rollout = float(args.prior_tokens_per_rollout)
    config.rl.prompts_per_step = args.prompts
    if args.pool_size:
        config.rl.pool_size = args.pool_size
    config.rl.steps = schema.steps_for_epochs(validate.validate(config), args.epochs) if args.epochs else args.steps
    config.rl.checkpoint_every = config.rl.steps  # checkpoints are for resuming, not for this comparison
    config.rl.keep_checkpoints = 1
    config.eval.num_questions = args.eval_questions
    config.eval.every = args.eval_every
    return validate.validate(config)


def warm_start(args: argparse.Namespace, workdir: pathlib.Path) -> pathlib.Path:
    """The one SFT warm start every run starts from: the config's warm-start cache entry (trained there on a
    miss, so the runs and ``trace_jax.bench.difficulty`` share it). Returns ``WORKDIR/shared``, where the
    warm start's held-out evaluation is kept for every run."""

    warm = build.build_warm_start(run_config(args.policies[0], args.seeds[0], args))
    print(
        f"warm start: {'trained' if warm.trained else 'reused'} in {warm.entry.directory} "
        f"(step {warm.sft.steps}, loss {warm.sft.final_loss:.3f})",
        file=sys.stderr,
    )
    shared = workdir / "shared"
    shared.mkdir(parents=True, exist_ok=True)
    return shared


def run_one(policy: str, seed: int, args: argparse.Namespace, shared: pathlib.Path, workdir: pathlib.Path) -> RunCurve:
    """One training run through ``trace_jax.job.train.train`` (resumed if its workdir holds a checkpoint)."""

    rundir = workdir / f"{policy}_s{seed}"
    rundir.mkdir(parents=True, exist_ok=True)
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

    if not (rundir / "summary.json").is_file():
        raise FileNotFoundError(
            f"{rundir} holds no finished run (no summary.json); run the bench without --report-only"
        )
    summary = json.loads((rundir / "summary.json").read_text())
    before = json.loads((rundir / BEFORE_FILE).read_text())
    sft_em = next(row["em"] for row in before["rows"] if row["group"] == "all")
    groups = [row for row in before["rows"] if row["group"] != "all"]
    if seconds is None:  # the bench's own record (all its calls on this run), else the last train() call's
        seconds_file = rundir / "bench_seconds.json"
        recorded = json.loads(seconds_file.read_text()) if seconds_file.is_file() else {}
        seconds = recorded.get("seconds", summary.get("total_seconds", 0.0))
    saved = rundir / build.CONFIG_FILE
    per_epoch = schema.steps_per_epoch(json.loads(saved.read_text())) if saved.is_file() else 0
    return run_curve(
        policy,
        seed,
        read_jsonl(rundir / "metrics.jsonl"),
        sft_em,
        seconds,
        per_epoch,
        {row["group"]: row["em"] for row in groups},
        {row["group"]: row["n"] for row in groups},
    )


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config-file", default=str(CONFIG_DIR / "ablation.py"), help="config file taking the policy as argument"
    )
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
    parser.add_argument(
        "--pool-size", type=int, default=0, help="train on a pool of this many questions (0: the config's rl.pool_size)"
    )
    parser.add_argument(
        "--epochs", type=float, default=0.0, help="passes over the pool; sets each policy's steps (0: --steps)"
    )
    parser.add_argument("--workdir", default="runs/train_curve")
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
    if args.pool_size < 0 or args.epochs < 0:
        parser.error("--pool-size and --epochs must be >= 0")
    if not pathlib.Path(args.config_file).is_file():
        parser.error(f"--config-file {args.config_file} does not exist (e.g. configs/realistic.py)")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every checkpoint at INFO
    workdir = pathlib.Path(args.workdir)
    start = time.perf_counter()
    if args.compile_cache != "none":  # every run re-jits the same engine and train step: compile them once
        jax.config.update("jax_compilation_cache_dir", str(args.compile_cache or workdir / "jax_cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if args.report_only:
        runs = [load_run(p, s, workdir / f"{p}_s{s}") for s in args.seeds for p in args.policies]
    else:
        shared = warm_start(args, workdir)
        runs = [run_one(policy, seed, args, shared, workdir) for seed in args.seeds for policy in args.policies]
    result = aggregate(runs)
    result["plots"] = plot(runs, result["equal_tokens"], workdir / "plots", result["equal_seconds"])
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
            "step_seconds": None if r.step_seconds is None else r.step_seconds.tolist(),
            "seconds": r.seconds,
            "steps_per_epoch": r.steps_per_epoch,
            "per_step": {name: values.tolist() for name, values in r.extra.items()},
        }
        for r in runs
    ]
    settings = {k: v for k, v in vars(args).items() if k != "out"}

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
