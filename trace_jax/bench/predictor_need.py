"""How good must the predictor be: the effective ratio TRACE's prompt selection reaches with a success estimate of
known quality, and the mixed-prompt AUC a target ratio needs.

``python -m trace_jax.bench.predictor_need --calibrated docs/evidence/difficulty_realistic.json [--noise 0,1,2]
[--candidates 1,2,3,4] [--seeds 8] [--out bench_results/predictor_need.json]``

On the simulator fitted to a real pool (``bench.allocation``'s :func:`calibrated_simulator`), the oracle policy
(TRACE on the simulator's true success probabilities) sees them through logit-space noise of std ``sigma``, fixed
per node (:class:`~trace_jax.allocation.simulate.BlurredOracle`): a predictor of chosen quality, at the roots
(selection, stage 1) and at the prefixes (stage 2) alike. For each ``sigma``:

* ``mixed_auc``: how well that estimate ranks prompts whose group comes out mixed, by the protocol of
  ``bench.difficulty``'s ``mixed_root_auc`` (``V_root`` of the estimate at ``--group-size`` on held-out prompts,
  against whether ``--samples`` rollouts of each came out mixed), so it reads on the same scale as the AUCs
  measured in training and offline;
* for each ``C`` of ``--candidates``: the effective ratio and signal-token share of the blurred oracle keeping
  ``--batch`` of ``C`` x ``--batch`` candidates a step, and of uniform (random candidates), at the same generated
  tokens (``--group-size`` full rollouts' worth a prompt), mean over ``--seeds`` seeds.

``needed`` reads, for each ``C`` and ``--target`` ratio over uniform, the ``mixed_auc`` at which the curve crosses
the target (:func:`needed_auc`); the markdown table prints it, "≤" when even the noisiest estimate reaches the
target, "not reached" when even the noiseless oracle falls short of it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from trace_jax.allocation.calibration import weighted_auc
from trace_jax.allocation.simulate import BlurredOracle, Simulator, SimulatorConfig
from trace_jax.allocation.solvers import expected_root_value
from trace_jax.bench.allocation import calibrated_simulator, run_policy, tokens_per_rollout
from trace_jax.rollout.backend import ContinuationRequest
from trace_jax.rollout.tree import ROOT


def mixed_auc(world: SimulatorConfig, noise: float, prompts: int, samples: int, group_size: int, seed: int) -> float:
    """AUC of ``V_root(estimate, group_size)`` at ``prompts`` roots for "their ``samples`` rollouts came out mixed",
    the estimate being the true root probability blurred by ``noise``."""
    oracle = BlurredOracle(Simulator(world, seed), noise, seed)
    trees = oracle.sample_batch(min(prompts, world.num_prompts))
    oracle.continue_anchors([ContinuationRequest(tree, ROOT, samples) for tree in trees])
    rewards = [np.asarray([tree[leaf].reward for leaf in tree.leaves()]) for tree in trees]
    mixed = np.asarray([0 < r.sum() < r.size for r in rewards], np.float64)
    estimate = np.asarray([oracle.true_success_probability(tree, ROOT) for tree in trees])
    return weighted_auc(expected_root_value(estimate, 0.0, group_size), mixed, np.ones_like(mixed))


def needed_auc(rows: Sequence[dict[str, float]], target: float) -> dict[str, Any]:
    """The ``mixed_auc`` at which ``ratio`` first reaches ``target`` going from the noisiest row to the sharpest
    (rows in any order): ``{"mixed_auc": a, "bracketed": True}`` linear between the two rows that bracket it;
    the noisiest row's AUC with ``bracketed`` False when every row reaches it (the need is at most that); AUC
    ``None`` when no row does."""
    ordered = sorted(rows, key=lambda row: row["mixed_auc"])
    for below, above in zip([None, *ordered], ordered, strict=False):
        if above["ratio"] < target:
            continue
        if below is None:
            return {"mixed_auc": float(above["mixed_auc"]), "bracketed": False}
        share = (target - below["ratio"]) / (above["ratio"] - below["ratio"])
        auc = below["mixed_auc"] + share * (above["mixed_auc"] - below["mixed_auc"])
        return {"mixed_auc": float(auc), "bracketed": True}
    return {"mixed_auc": None, "bracketed": False}


def _need_cell(need: dict[str, Any]) -> str:
    if need["mixed_auc"] is None:
        return "not reached"
    return f"{need['mixed_auc']:.2f}" if need["bracketed"] else f"≤ {need['mixed_auc']:.2f}"


def _mean(runs: Sequence[dict[str, float]], key: str) -> float:
    return float(np.mean([run[key] for run in runs]))


def measure(world: SimulatorConfig, aucs: dict[float, float], args: argparse.Namespace) -> dict[str, Any]:
    """Per candidate count: uniform's figures, the blurred oracle's at each noise (``aucs``: each noise's
    ``mixed_auc``) and the AUC each target ratio needs."""
    budget = args.group_size * tokens_per_rollout(world)
    by_candidates: dict[str, Any] = {}
    for candidates in args.candidates:
        run_args = argparse.Namespace(
            warmup=0, steps=args.steps, batch=args.batch, group_size=args.group_size, candidates=candidates
        )
        uniform = [run_policy("uniform", s, run_args, budget, world=world) for s in range(args.seeds)]
        base = _mean(uniform, "effective_ratio")
        rows = []
        for noise in args.noise:
            runs = [
                run_policy("oracle", seed, run_args, budget, world=world, oracle_noise=noise)
                for seed in range(args.seeds)
            ]
            effective = _mean(runs, "effective_ratio")
            rows.append(
                {
                    "noise": noise,
                    "mixed_auc": aucs[noise],
                    "effective_ratio": effective,
                    "nonzero_advantage_tokens": _mean(runs, "nonzero_advantage_tokens"),
                    "ratio": effective / base,
                }
            )
        by_candidates[str(candidates)] = {
            "uniform": {
                "effective_ratio": base,
                "nonzero_advantage_tokens": _mean(uniform, "nonzero_advantage_tokens"),
            },
            "rows": rows,
            "needed": {str(target): needed_auc(rows, target) for target in args.target},
        }
    return by_candidates


def markdown(results: dict[str, Any]) -> str:
    noises = results["noise"]
    lines = [
        f"`{results['command']}`",
        "",
        "| C | uniform eff. ratio | "
        + " | ".join(f"sigma {n:g} (AUC {results['mixed_auc'][str(n)]:.2f})" for n in noises)
        + " | "
        + " | ".join(f"AUC for {t:g}x" for t in results["target"])
        + " |",
        "|" + " --- |" * (2 + len(noises) + len(results["target"])),
    ]
    for candidates, entry in results["candidates"].items():
        cells = [f"{row['effective_ratio']:.3f} ({row['ratio']:.2f}x)" for row in entry["rows"]]
        needed = [_need_cell(need) for need in entry["needed"].values()]
        uniform = f"{entry['uniform']['effective_ratio']:.3f}"
        lines.append(f"| {candidates} | {uniform} | " + " | ".join(cells + needed) + " |")
    return "\n".join(lines)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibrated", default=None, help="a trace_jax.bench.difficulty JSON (default simulator)")
    parser.add_argument("--noise", type=_floats, default=[0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0])
    parser.add_argument("--candidates", type=_floats, default=[1.0, 2.0, 3.0, 4.0])
    parser.add_argument("--target", type=_floats, default=[1.4, 1.8])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="prompts trained a step (the training runs' 8)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8, help="token budget = this many full rollouts a prompt")
    parser.add_argument("--samples", type=int, default=16, help="rollouts a prompt when scoring mixed_auc")
    parser.add_argument("--auc-prompts", type=int, default=2048)
    parser.add_argument("--out", default="bench_results/predictor_need.json")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.steps < 1 or args.batch < 1 or not args.noise or not args.candidates:
        raise SystemExit("--seeds, --steps, --batch must be positive; --noise and --candidates non-empty")
    if min(args.noise) < 0 or min(args.candidates) < 1:
        raise SystemExit("--noise must be >= 0 and --candidates >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    start = time.perf_counter()
    world, calibration = SimulatorConfig(), None
    if args.calibrated:
        world, calibration = calibrated_simulator(json.loads(pathlib.Path(args.calibrated).read_text()), False)
    aucs = {n: mixed_auc(world, n, args.auc_prompts, args.samples, args.group_size, seed=1000) for n in args.noise}
    results: dict[str, Any] = {
        "command": " ".join(["python -m trace_jax.bench.predictor_need", *(sys.argv[1:] if argv is None else argv)]),
        "simulator": world.__dict__,
        "calibration": calibration,
        "noise": args.noise,
        "target": args.target,
        "mixed_auc": {str(n): auc for n, auc in aucs.items()},
        "setup": {k: getattr(args, k) for k in ("seeds", "batch", "steps", "group_size", "samples", "auc_prompts")},
        "candidates": measure(world, aucs, args),
    }
    results["seconds"] = time.perf_counter() - start
    results["markdown"] = markdown(results)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(results, indent=2))
    print(results["markdown"])
    return results


if __name__ == "__main__":
    main()
