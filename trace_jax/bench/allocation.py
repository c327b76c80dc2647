"""Allocation benchmark on the ground-truth simulator: every policy at an equal generated-token budget.

``python -m trace_jax.bench.allocation [--policy P ...] [--seeds N] [--out bench_results/allocation.json]``
prints JSON (also written to ``--out``) and markdown tables: mean ± std over seeds of the effective ratio and
the non-zero-advantage shares per policy; the stage ablation (stage 1 uniform/active x stage 2
uniform/active); a sensitivity table (uniform / trace / oracle when one knob of the simulated world
changes); held-out calibration of the predictors; and the allocation overhead over 10,000 anchors.

Protocol: the token budget per prompt is ``--group-size`` full rollouts' worth of tokens (measured once on the
simulator), the same for every policy; no rollout cap, so tree policies may buy more, shorter continuations.
Each (policy, seed) runs ``--warmup`` batches (the predictor and cost model learn online) and then reports the
mean over ``--steps`` batches. The simulator's seed is the run's seed, so every policy sees the same world.
Budgets are planned on expected costs, so a single batch may spend a few percent more or less than the budget;
the table reports the mean and the largest share used.
``--candidates C`` draws C x ``--batch`` prompts a batch and lets each policy keep ``--batch`` of them (prompt
selection, ``SchedulerConfig.candidates_per_prompt``): TRACE by predicted ``V_root``, the others at random.

``--calibrated DIFFICULTY_JSON`` (from ``trace_jax.bench.difficulty``) replaces the default simulator by one fitted
to real rollouts (:func:`calibrated_simulator`) and adds a simulator-vs-real table of effective ratios (real
uniform from that file; real per-policy figures from ``--real-curve TRAIN_CURVE_JSON`` when given).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from trace_jax.allocation.anchors import training_anchors
from trace_jax.allocation.calibration import calibration_metrics
from trace_jax.allocation.context import AllocationContext, Budget
from trace_jax.allocation.policies import POLICIES, StagedPolicy
from trace_jax.allocation.predictor import make_predictor
from trace_jax.allocation.scheduler import SchedulerConfig, TreeScheduler
from trace_jax.allocation.simulate import BlurredOracle, Simulator, SimulatorConfig
from trace_jax.allocation.solvers import allocate_prefixes
from trace_jax.bench.difficulty import predictor_informativeness
from trace_jax.rollout.backend import ContinuationRequest, RolloutStats

REPORTED = ("effective_ratio", "nonzero_advantage_tokens", "nonzero_advantage_leaves", "tokens_per_leaf")
# (stage 1, stage 2) -> the registered policy that is exactly that cell, reused when it was run.
ABLATION = {
    ("uniform", "uniform"): "tree_random",
    ("uniform", "active"): None,
    ("active", "uniform"): None,
    ("active", "active"): "trace",
}
# How much of TRACE's gain depends on the world: each varies one knob of the default simulator.
WORLDS = {
    "weaker features (feature_signal=0.3)": {"feature_signal": 0.3},
    "stronger features (feature_signal=1.0)": {"feature_signal": 1.0},
    "steadier turns (kappa_median=16)": {"kappa_median": 16.0},
    "flatter difficulty (Beta(0.5, 0.5))": {"difficulty_a": 0.5, "difficulty_b": 0.5},
}
WORLD_POLICIES = ("uniform", "trace", "oracle")


FEATURE_SIGNALS = (0.25, 0.5, 1.0, 2.0)  # candidates when matching the real predictor's held-out AUC
# kappa when the first turns showed no spread beyond the samples' binomial noise (measured kappa = inf): turns
# barely move p. Not inf (the simulator's Beta needs it finite) and not the default 4 (turns that swing p a
# lot): about what ~60 prefixes x 4 continuations can resolve (their ratio's s.e. ~0.05, kappa ~ 10-20).
KAPPA_NO_SPREAD = 16.0


def calibrated_simulator(
    stats: Mapping[str, Any], match_auc: bool = True, seed: int = 0, prompts: int = 128
) -> tuple[SimulatorConfig, dict[str, Any]]:
    """The simulator fitted to real-rollout statistics (the JSON of ``trace_jax.bench.difficulty``).

    Prompt difficulty: the fitted beta-binomial Beta(a, b). Turns: the measured turn cap, per-turn stop
    probability and generated tokens per (non-final / final) turn. Prefix dynamics: the measured first-turn
    concentration ``kappa`` (:data:`KAPPA_NO_SPREAD` when it measured no spread). Features: with ``match_auc``,
    the ``feature_signal`` of :data:`FEATURE_SIGNALS` whose simulated trees give the MLP predictor the held-out
    AUC closest to the real one, by the same protocol (``difficulty.predictor_informativeness`` on k rollouts
    per prompt). Returns the config and a record of what was fitted.
    """

    beta, turns = stats["beta_binomial"], stats["turns"]
    fitted = {
        "difficulty_a": float(beta["a"]),
        "difficulty_b": float(beta["b"]),
        "max_turns": int(turns["max_turns"]),
        "stop_probability": float(turns["stop_probability"]),
        "answer_tokens_mean": float(turns["answer_tokens_mean"]),
    }
    if turns.get("turn_tokens_mean"):
        fitted["turn_tokens_mean"] = float(turns["turn_tokens_mean"])
    kappa = stats.get("prefix", {}).get("kappa")
    if kappa is not None and kappa > 0:
        fitted["kappa_median"] = float(kappa) if np.isfinite(kappa) else KAPPA_NO_SPREAD
    config = dataclasses.replace(SimulatorConfig(), **fitted)
    record: dict[str, Any] = {"fitted": fitted}
    real_auc = stats.get("predictor", {}).get("auc")
    if match_auc and real_auc is not None and np.isfinite(real_auc):
        samples = int(stats.get("setup", {}).get("samples", 8))
        group_size = int(stats.get("setup", {}).get("group_size", 8))
        aucs, root_aucs, mixed_aucs = {}, {}, {}
        for signal in FEATURE_SIGNALS:
            candidate = dataclasses.replace(config, feature_signal=signal)
            sim = Simulator(candidate, seed)
            trees = sim.sample_batch(min(prompts, candidate.num_prompts))
            sim.continue_anchors([ContinuationRequest(t, 0, samples) for t in trees])
            informativeness = predictor_informativeness(trees, seed, group_size=group_size)
            aucs[signal] = informativeness["auc"]
            root_aucs[signal] = informativeness["roots"]["auc"]
            mixed_aucs[signal] = informativeness["mixed_root_auc"]
        best = min(aucs, key=lambda signal: abs(aucs[signal] - real_auc))
        config = dataclasses.replace(config, feature_signal=best)
        record.update(feature_signal=best, simulated_auc=aucs, real_auc=float(real_auc))
        # Roots alone (what stage 1 and prompt selection rank): matched on all anchors, not on these.
        real = stats.get("predictor", {})
        record.update(simulated_root_auc=root_aucs, real_root_auc=float(real.get("roots", {}).get("auc", np.nan)))
        record.update(
            simulated_mixed_root_auc=mixed_aucs, real_mixed_root_auc=float(real.get("mixed_root_auc", np.nan))
        )
    return config, record


def simulator_vs_real(
    results: Mapping[str, Any], stats: Mapping[str, Any], real_curve: Mapping[str, Any] | None
) -> list[dict[str, Any]]:
    """Rows ``policy, simulator eff. ratio, real eff. ratio``: real uniform from the difficulty pool (exact, at
    the bench's group size), real per-policy means from a ``trace_jax.bench.train_curve`` result when given."""
    real: dict[str, float] = {}
    by_group = stats["pool"].get("uniform_effective_ratio_by_group_size", {})
    group_size = str(results["group_size"])
    if group_size in by_group:
        real["uniform"] = float(by_group[group_size])
    real_source = {"uniform": f"difficulty pool, G={group_size}"} if real else {}
    for policy, numbers in (real_curve or {}).get("policies", {}).items():
        real[policy] = float(numbers["mean_effective_ratio"]["mean"])
        real_source[policy] = "train_curve (mean over steps and seeds)"
    return [
        {
            "policy": policy,
            "simulator": row["effective_ratio"]["mean"],
            "real": real.get(policy),
            "real_source": real_source.get(policy, "not measured"),
        }
        for policy, row in results["policies"].items()
    ]


def tokens_per_rollout(config: SimulatorConfig, seed: int = 12345, num: int = 4000) -> float:
    """Mean generated tokens of one full rollout from a root, measured on the simulator."""
    sim = Simulator(config, seed)
    trees = sim.sample_batch(min(num, config.num_prompts))
    stats = sim.continue_anchors([ContinuationRequest(t, 0, 1) for t in trees])
    return stats.generated_tokens / stats.rollouts


def run_policy(
    policy: str,
    seed: int,
    args: argparse.Namespace,
    token_budget: float,
    overrides: dict | None = None,
    world: SimulatorConfig | None = None,
    oracle_noise: float = 0.0,
) -> dict[str, float]:
    """Mean figures over ``args.steps`` measured batches after ``args.warmup`` batches of online learning;
    ``oracle_noise`` blurs what the oracle sees (:class:`~trace_jax.allocation.simulate.BlurredOracle`)."""
    sim = BlurredOracle(Simulator(world or SimulatorConfig(), seed), oracle_noise, seed)
    config = SchedulerConfig(
        policy=policy,
        policy_kwargs=dict(overrides or {}),
        rollouts_per_prompt=None,
        tokens_per_prompt=token_budget,
        prior_tokens_per_rollout=token_budget / args.group_size,
        seed=seed,
        candidates_per_prompt=args.candidates,
    )
    scheduler = TreeScheduler(sim, config)
    rows = []
    for step in range(args.warmup + args.steps):
        result = scheduler.run(sim.sample_batch(config.candidates(args.batch)), batch_size=args.batch)
        if step >= args.warmup:
            rows.append(result.metrics)
    out = {key: float(np.mean([row[key] for row in rows])) for key in rows[0]}
    out["budget/token_use_max"] = float(np.max([row["budget/token_use"] for row in rows]))
    return out


def summarise(per_seed: list[dict[str, float]]) -> dict[str, Any]:
    keys = [*REPORTED, "budget/generated_tokens", "budget/rollouts", "budget/token_use", "predictor/brier"]
    out = {}
    for key in [*keys, "predictor/auc", "predictor/ece"]:
        values = np.asarray([row.get(key, np.nan) for row in per_seed])
        out[key] = {"mean": float(np.mean(values)), "std": float(np.std(values))}
    out["budget/token_use_max"] = float(np.max([row["budget/token_use_max"] for row in per_seed]))
    return out


def predictor_report(seed: int = 0, batch: int = 64, checkpoints: tuple[int, ...] = (1, 4, 16)) -> dict[str, Any]:
    """Held-out Brier / AUC / ECE of each host-feature predictor after n batches of uniform-policy trees.

    (The ``transformer`` predictor reads token ids, which the simulator leaves uninformative, so it is left out.)
    """
    sim = Simulator(SimulatorConfig(), seed)

    def sampled() -> list:
        trees = sim.sample_batch(batch)
        sim.continue_anchors([ContinuationRequest(t, 0, 4) for t in trees])
        return trees

    held_out = training_anchors(sampled() + sampled())
    models = {name: make_predictor(name) for name in ("mlp", "depth", "beta")}
    report: dict[str, Any] = {name: {} for name in models}
    for seen in range(1, max(checkpoints) + 1):
        anchors = training_anchors(sampled())
        for name, model in models.items():
            model.update(anchors)
            if seen in checkpoints:
                pred = model.predict(held_out)
                report[name][seen] = calibration_metrics(pred, held_out.targets_n, held_out.weights_n)
    return report


class _DryRunContext(AllocationContext):
    """Plans without sampling: ``dispatch`` only records what the policy asked for."""

    def dispatch(self, items, counts) -> RolloutStats:
        self.planned = int(np.sum(counts))
        return RolloutStats()


def allocation_overhead(num_anchors: int = 10_000, repeats: int = 20, seed: int = 0) -> dict[str, float]:
    """Median ms to plan one TRACE stage-2 round over ``num_anchors`` anchors (no sampling).

    ``solver_ms``: the vectorised greedy (``allocate_prefixes``) alone; ``round_ms``: the whole round as the
    policy runs it -- finding anchors and their backups, gathering features, the MLP predictor's forward pass,
    costs, ``V_pref`` and the solver.
    """
    sim = Simulator(SimulatorConfig(), seed)
    trees, found = [], 0
    while found < num_anchors:
        tree = sim.new_tree(len(trees) % sim.config.num_prompts)
        sim.continue_anchors([ContinuationRequest(tree, 0, 8)])
        trees.append(tree)
        found += sum(1 for n in tree if not n.is_leaf)
    scheduler = TreeScheduler(sim, SchedulerConfig(policy="trace", rollouts_per_prompt=None, tokens_per_prompt=1e3))
    budget = Budget(tokens=len(trees) * 500)
    rng = np.random.default_rng(seed)
    ctx = _DryRunContext(trees, sim, budget, scheduler.predictor, scheduler.cost_model, rng)
    policy = StagedPolicy()
    repeat, cost = rng.random(found), rng.uniform(50, 800, found)

    def timed(fn) -> float:
        fn()  # compile / warm up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1e3 * float(np.median(times))

    return {
        "anchors": found,
        "solver_ms": timed(lambda: allocate_prefixes(repeat, cost, float(cost.sum()) / 4, None, 4)),
        "round_ms": timed(lambda: policy.prefix_round(ctx, 0.5)),
    }


def markdown(results: dict[str, Any]) -> str:
    def cell(stats: dict[str, float], scale: float = 100.0) -> str:
        return f"{scale * stats['mean']:.1f} ± {scale * stats['std']:.1f}"

    lines = [
        f"`{results['command']}` — {results['seeds']} seeds, batch {results['batch']}, "
        f"token budget {results['tokens_per_prompt']:.0f}/prompt (= {results['group_size']} rollouts)",
        "",
        "| policy | effective ratio % | non-zero-adv. tokens % | non-zero-adv. leaves % | tokens/leaf | "
        "tokens used % of budget (max) | rollouts/batch | predictor Brier / AUC (held out) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in results["policies"].items():
        lines.append(
            f"| {name} | {cell(row['effective_ratio'])} | {cell(row['nonzero_advantage_tokens'])} | "
            f"{cell(row['nonzero_advantage_leaves'])} | {cell(row['tokens_per_leaf'], 1.0)} | "
            f"{100 * row['budget/token_use']['mean']:.1f} ({100 * row['budget/token_use_max']:.1f}) | "
            f"{row['budget/rollouts']['mean']:.0f} | "
            f"{row['predictor/brier']['mean']:.3f} / {row['predictor/auc']['mean']:.3f} |"
        )
    if results.get("simulator_vs_real"):
        lines += [
            "",
            "| policy | simulator eff. ratio % | real eff. ratio % | real measured by |",
            "| --- | --- | --- | --- |",
        ]
        for row in results["simulator_vs_real"]:
            real = "—" if row["real"] is None else f"{100 * row['real']:.1f}"
            lines.append(f"| {row['policy']} | {100 * row['simulator']:.1f} | {real} | {row['real_source']} |")
    if results.get("ablation"):
        lines += ["", "| stage 1 | stage 2 | effective ratio % | non-zero-adv. tokens % |", "| --- | --- | --- | --- |"]
        for name, row in results["ablation"].items():
            s1, s2 = name.split("+")
            lines.append(f"| {s1} | {s2} | {cell(row['effective_ratio'])} | {cell(row['nonzero_advantage_tokens'])} |")
    if results.get("worlds"):
        lines += [
            "",
            f"Sensitivity ({results['world_seeds']} seeds; one knob of the default simulator changed per row; "
            "budget = the same group size in that world's tokens):",
            "",
            "| simulator | "
            + " | ".join(f"{p} eff. ratio %" for p in WORLD_POLICIES)
            + " | trace / uniform | trace / oracle |",
            "|" + " --- |" * (len(WORLD_POLICIES) + 3),
        ]
        for label, rows in results["worlds"].items():
            eff = {p: rows[p]["effective_ratio"]["mean"] for p in WORLD_POLICIES}
            lines.append(
                f"| {label} | "
                + " | ".join(cell(rows[p]["effective_ratio"]) for p in WORLD_POLICIES)
                + f" | {eff['trace'] / eff['uniform']:.2f}x | {eff['trace'] / eff['oracle']:.0%} |"
            )
    if results.get("predictors"):
        checkpoints = list(next(iter(results["predictors"].values())))
        lines += [
            "",
            "Predictors on held-out anchors (uniform-policy trees, default simulator), after n training batches:",
            "",
            "| predictor | " + " | ".join(f"n={n}: Brier / AUC / ECE" for n in checkpoints) + " |",
            "|" + " --- |" * (len(checkpoints) + 1),
        ]
        for name, by_n in results["predictors"].items():
            cells = [f"{m['brier']:.3f} / {m['auc']:.3f} / {m['ece']:.3f}" for m in by_n.values()]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if results.get("overhead"):
        o = results["overhead"]
        lines += [
            "",
            f"Allocation over {o['anchors']} anchors: solver {o['solver_ms']:.1f} ms, "
            f"whole stage-2 round (anchors, features, predictor, solver) {o['round_ms']:.1f} ms (median).",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", action="append", choices=sorted(POLICIES), help="repeatable; default: all")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=4, help="token budget = this many full rollouts/prompt")
    parser.add_argument(
        "--candidates", type=float, default=1.0, help="prompts drawn per prompt trained (prompt selection; 1: none)"
    )
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-ablation", action="store_true")
    parser.add_argument("--no-worlds", action="store_true", help="skip the simulator sensitivity table")
    parser.add_argument("--world-seeds", type=int, default=3, help="seeds per cell of the sensitivity table")
    parser.add_argument("--no-overhead", action="store_true")
    parser.add_argument("--no-predictors", action="store_true", help="skip the predictor calibration table")
    parser.add_argument(
        "--calibrated",
        default=None,
        help="a trace_jax.bench.difficulty JSON: fit the simulator to it (docs/evidence.md, 'The fitted simulator')",
    )
    parser.add_argument(
        "--real-curve", default=None, help="a trace_jax.bench.train_curve JSON: real effective ratios per policy"
    )
    parser.add_argument("--out", default="bench_results/allocation.json")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.steps < 1 or args.batch < 1:
        raise SystemExit("--seeds, --steps and --batch must be positive")

    start = time.perf_counter()
    base = SimulatorConfig()
    stats = calibration = real_curve = None
    if args.calibrated:
        stats = json.loads(pathlib.Path(args.calibrated).read_text())
        base, calibration = calibrated_simulator(stats)
    if args.real_curve:
        real_curve = json.loads(pathlib.Path(args.real_curve).read_text())
    budget = args.group_size * tokens_per_rollout(base)
    results: dict[str, Any] = {
        "command": " ".join(["python -m trace_jax.bench.allocation", *(sys.argv[1:] if argv is None else argv)]),
        "seeds": args.seeds,
        "world_seeds": args.world_seeds,
        "batch": args.batch,
        "group_size": args.group_size,
        "candidates_per_prompt": args.candidates,
        "tokens_per_prompt": budget,
        "simulator": base.__dict__,
        "calibration": calibration,
        "policies": {},
        "ablation": {},
        "worlds": {},
    }
    for name in args.policy or list(POLICIES):
        runs = [run_policy(name, s, args, budget, world=base) for s in range(args.seeds)]
        results["policies"][name] = summarise(runs)
    if stats is not None:
        results["simulator_vs_real"] = simulator_vs_real(results, stats, real_curve)
    if not args.no_ablation:
        for (stage1, stage2), same_as in ABLATION.items():
            if same_as in results["policies"]:
                results["ablation"][f"{stage1}+{stage2}"] = results["policies"][same_as]
                continue
            overrides = {"stage1": stage1, "stage2": stage2}
            runs = [run_policy("trace", s, args, budget, overrides, world=base) for s in range(args.seeds)]
            results["ablation"][f"{stage1}+{stage2}"] = summarise(runs)
    if not args.no_worlds:
        for label, knobs in WORLDS.items():
            world = dataclasses.replace(base, **knobs)
            world_budget = args.group_size * tokens_per_rollout(world)
            results["worlds"][label] = {
                name: summarise([run_policy(name, s, args, world_budget, world=world) for s in range(args.world_seeds)])
                for name in WORLD_POLICIES
            }
    if not args.no_predictors:
        results["predictors"] = predictor_report()
    if not args.no_overhead:
        results["overhead"] = allocation_overhead()
    results["seconds"] = time.perf_counter() - start
    results["markdown"] = markdown(results)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps({k: v for k, v in results.items() if k != "markdown"}, indent=2))
    print(results["markdown"])
    return results


if __name__ == "__main__":
    main()
