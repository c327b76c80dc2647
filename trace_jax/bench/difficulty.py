"""How hard a config's training pool is for its warm-started policy: the statistics a real RLVR pool is judged by.

    python -m trace_jax.bench.difficulty [--config configs/realistic.py] [--samples 16] [--prompts 256]
        [--group-size 8] [--split train] [--seed 0] [--prefix-prompts 32] [--prefix-samples 4]
        [--out bench_results/difficulty.json]

After the config's SFT warm start (reused from the warm-start cache, trained there on a miss), samples
``--samples`` rollouts from the root of ``--prompts`` questions of ``--split`` (a seeded draw) through the
real engine and runner, and reports (JSON, also written to ``--out``):

* ``pool``: the per-prompt success histogram, the share of *extreme* prompts (p̂ < 0.05 or p̂ > 0.95), and
  uniform GRPO's expected effective ratio at ``--group-size`` — the chance that G rollouts of a prompt are
  mixed, computed exactly from each prompt's k samples (the hypergeometric share of mixed G-subsets: an
  unbiased estimate of ``1 - p^G - (1-p)^G``);
* ``by_group``: the same per question kind and hop count (``trace_jax.evaluate.group_of``);
* ``beta_binomial``: the Beta(a, b) prompt-difficulty distribution fitted to the success counts (maximum
  likelihood of the beta-binomial), which is what the allocation simulator's ``difficulty_a/b`` mean;
* ``turns``: leaf depths and generated tokens per turn (the simulator's stop probability and turn lengths);
* ``prefix``: with ``--prefix-prompts`` > 0, how much the first turn moves the success probability
  (``--prefix-samples`` continuations of up to 4 depth-1 prefixes of mixed prompts): the concentration
  ``kappa`` of ``p_1 ~ Beta(kappa p_0, kappa (1 - p_0))`` by the method of moments;
* ``predictor``: held-out Brier / AUC of the MLP success predictor trained on half the prompts' anchors
  (features are the policy's hidden states), i.e. how informative the real features are.

``trace_jax.bench.allocation --calibrated FILE`` builds its simulator from this file.
"""

from __future__ import annotations

import argparse
import collections
import math
import pathlib
import platform
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from scipy import optimize, special

from trace_jax import configs
from trace_jax.allocation.anchors import gather_anchors, training_anchors
from trace_jax.allocation.calibration import calibration_metrics, weighted_auc
from trace_jax.allocation.predictor import make_predictor
from trace_jax.allocation.solvers import expected_root_value
from trace_jax.bench.report import emit
from trace_jax.job import build
from trace_jax.job.evaluate import group_of
from trace_jax.models import num_params
from trace_jax.rollout.backend import ContinuationRequest
from trace_jax.rollout.tree import ROOT, RolloutTree

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs"
EXTREME = 0.05  # p̂ below this or above 1 - this is an "extreme" prompt (all-wrong or all-right groups)
MAX_PREFIXES_PER_TREE = 4


def mixed_group_probability(successes_n: np.ndarray, samples: int, group_size: int) -> np.ndarray:
    """float64 [N]: P(a group of ``group_size`` of a prompt's rollouts is mixed), from ``successes_n`` of ``samples``.

    The exact share of mixed ``group_size``-subsets of the k samples, ``1 - [C(c, G) + C(k - c, G)] / C(k, G)``:
    the unbiased estimate of ``1 - p^G - (1 - p)^G`` (plugging p̂ = c / k in is biased upwards).
    """
    if not 1 <= group_size <= samples:
        raise ValueError(f"group size {group_size} must be in 1..samples ({samples})")
    total = math.comb(samples, group_size)
    counts = np.asarray(successes_n, np.int64)
    same = [math.comb(int(c), group_size) + math.comb(samples - int(c), group_size) for c in counts]
    return 1.0 - np.asarray(same, np.float64) / total


def pool_summary(successes_n: np.ndarray, samples: int, group_size: int, bins: int = 10) -> dict[str, Any]:
    """The pool's difficulty figures from per-prompt success counts (int [N] of ``samples`` each)."""
    counts = np.asarray(successes_n, np.int64)
    p = counts / samples
    edges = np.linspace(0.0, 1.0, bins + 1)
    histogram = np.histogram(p, edges)[0]
    return {
        "prompts": int(counts.size),
        "mean_success": float(p.mean()),
        "histogram": {"edges": edges.round(3).tolist(), "share": (histogram / counts.size).round(4).tolist()},
        "share_p_below_0.05": float(np.mean(p < EXTREME)),
        "share_p_above_0.95": float(np.mean(p > 1 - EXTREME)),
        "share_extreme": float(np.mean((p < EXTREME) | (p > 1 - EXTREME))),
        "uniform_effective_ratio": float(mixed_group_probability(counts, samples, group_size).mean()),
        "group_size": group_size,
        "uniform_effective_ratio_by_group_size": {
            g: float(mixed_group_probability(counts, samples, g).mean()) for g in (2, 4, 8, 16) if g <= samples
        },
    }


def fit_beta_binomial(successes_n: np.ndarray, samples: int) -> dict[str, float]:
    """Maximum-likelihood Beta(a, b) of per-prompt success probabilities seen through ``samples`` draws each."""

    counts = np.asarray(successes_n, np.float64)

    def nll(log_ab: np.ndarray) -> float:
        a, b = np.exp(log_ab)
        return -float(np.sum(special.betaln(counts + a, samples - counts + b) - special.betaln(a, b)))

    fit = optimize.minimize(nll, np.log([0.5, 0.5]), method="Nelder-Mead", options={"xatol": 1e-4, "fatol": 1e-6})
    a, b = np.exp(fit.x)
    return {"a": float(a), "b": float(b), "mean": float(a / (a + b)), "neg_log_likelihood": float(fit.fun)}


def capped_stop_probability(mean_turns: float, max_turns: int) -> float:
    """The per-turn stop probability q whose turn count, capped at ``max_turns``, has mean ``mean_turns``.

    Turns ~ min(Geometric(q), T) has mean ``(1 - (1 - q)^T) / q``, decreasing in q from T to 1: bisection.
    """
    if mean_turns <= 1.0:
        return 1.0
    low, high = 1e-6, 1.0
    for _ in range(60):
        q = 0.5 * (low + high)
        if (1.0 - (1.0 - q) ** max_turns) / q > mean_turns:
            low = q
        else:
            high = q
    return 0.5 * (low + high)


def turn_statistics(trees: Sequence[RolloutTree]) -> dict[str, float]:
    """Leaf depth (turns per trajectory) and generated tokens per turn, non-final and final turns apart."""
    depths, middle, final = [], [], []
    for tree in trees:
        for node in tree:
            if node.node_id == 0:
                continue
            (final if node.is_leaf else middle).append(node.token_ids.shape[0])
            if node.is_leaf:
                depths.append(node.depth)
    depths_n = np.asarray(depths, np.float64)
    return {
        "mean_turns": float(depths_n.mean()),
        "max_turns": int(depths_n.max()),
        "stop_probability": capped_stop_probability(float(depths_n.mean()), int(depths_n.max())),
        "turn_tokens_mean": float(np.mean(middle)) if middle else 0.0,
        "answer_tokens_mean": float(np.mean(final)),
    }


def first_turn_concentration(root_successes: Sequence[float], children: Sequence[Sequence[tuple[float, int]]]):
    """``kappa`` of ``p_1 ~ Beta(kappa p_0, kappa (1 - p_0))`` from depth-1 prefixes' continuation outcomes.

    root_successes: p̂_0 per prompt. children: per prompt, ``(successes, n)`` of each continued depth-1 prefix.
    Under that model ``Var(p_1) = p_0 (1 - p_0) / (kappa + 1)``; each prefix's share c / n adds binomial noise
    ``p_1 (1 - p_1) / n``, which is subtracted (unbiasedly) before pooling. Returns ``{"kappa", "ratio",
    "prefixes"}`` where ``ratio`` = Var(p_1) / (p_0 (1 - p_0)); kappa is inf when no spread is left.
    """
    excess = scale = 0.0
    prefixes = 0
    for p0, kids in zip(root_successes, children, strict=True):
        for c, n in kids:
            if n < 2:
                continue
            share = c / n
            excess += (share - p0) ** 2 - share * (1.0 - share) / (n - 1)
            scale += p0 * (1.0 - p0)
            prefixes += 1
    ratio = max(excess / scale, 0.0) if scale > 0 else float("nan")
    kappa = float("inf") if ratio == 0 else (1.0 / ratio - 1.0 if np.isfinite(ratio) else float("nan"))
    return {"kappa": float(max(kappa, 0.0)), "ratio": float(ratio), "prefixes": prefixes}


def predictor_informativeness(
    trees: Sequence[RolloutTree], seed: int = 0, updates: int = 8, group_size: int = 8
) -> dict[str, Any]:
    """Held-out Brier / AUC / ECE of the MLP predictor after ``updates`` updates on the anchors of half the trees.

    The same protocol on simulator trees (``trace_jax.bench.allocation``) calibrates the simulated features. Also
    the same figures on the held-out roots alone (``roots``: what stage 1 and prompt selection rank, from the
    prompt only) and on the deeper prefixes (``prefixes``: what stage 2 ranks, after some observations), and
    ``mixed_root_auc``: how well ``V_root(v, group_size)`` on the predicted root values ranks the held-out prompts
    whose sampled group came out mixed above those whose did not (what prompt selection needs),
    ``mixed_root_auc_dispersion``: the same for the MLP with a dispersion head, ranking by ``E[V_root]``, and
    ``mixed_first_turn_auc``: the same ranking on each held-out prompt's first rollout's first turn (its predicted
    value, or its reward when that turn answered), what selection on the first search
    (``allocation.select_on = "first_search"``) ranks.
    """

    order = np.random.default_rng(seed).permutation(len(trees))
    train, held_out = [trees[i] for i in order[::2]], [trees[i] for i in order[1::2]]
    anchors = training_anchors(train)
    if anchors.features_nd.shape[1] == 0:
        raise ValueError("the rollout trees carry no anchor features; the predictor has nothing to read")
    test = training_anchors(held_out)
    roots = test.depths_n == 0
    mixed = ((test.targets_n[roots] > 0) & (test.targets_n[roots] < 1)).astype(np.float64)

    def fitted(**kwargs: Any):
        model = make_predictor("mlp", **kwargs)
        for _ in range(updates):
            model.update(anchors)
        return model

    model = fitted()
    pred = model.predict(test)
    overall = calibration_metrics(pred, test.targets_n, test.weights_n)
    for name, keep in {"roots": roots, "prefixes": ~roots}.items():
        if keep.any():
            overall[name] = calibration_metrics(pred[keep], test.targets_n[keep], test.weights_n[keep])
    ones = np.ones(int(roots.sum()))
    overall["mixed_root_auc"] = weighted_auc(expected_root_value(pred[roots], 0.0, group_size), mixed, ones)
    # The same ranking with a dispersion head: E[V_root] under the predicted spread of each root's p.
    spread = fitted(dispersion=True)
    rho = spread.predict_dispersion(test)[roots]
    value = expected_root_value(spread.predict(test)[roots], rho, group_size)
    overall["mixed_root_auc_dispersion"] = weighted_auc(value, mixed, ones)
    overall["mixed_first_turn_auc"] = weighted_auc(_first_turn_values(model, held_out, group_size), mixed, ones)
    return overall


def _first_turn_values(model: Any, trees: Sequence[RolloutTree], group_size: int) -> np.ndarray:
    """``V_root`` on each tree's first depth-1 node: the predictor's value there, its reward when it is a leaf."""
    firsts = [tree.root.children[0] for tree in trees]
    values = model.predict(gather_anchors(trees, list(enumerate(firsts))))
    rewards = [tree[node].reward for tree, node in zip(trees, firsts, strict=True)]
    values = np.asarray([v if r is None else r for v, r in zip(values, rewards, strict=True)], np.float64)
    return expected_root_value(values, 0.0, group_size)


def by_group(trees: Sequence[RolloutTree], samples: int, group_size: int) -> dict[str, dict[str, Any]]:
    groups: dict[str, list[int]] = collections.defaultdict(list)
    for tree in trees:
        groups[group_of(tree.task)].append(int(tree.leaf_rewards().sum()))
    return {name: pool_summary(np.asarray(c), samples, group_size) for name, c in sorted(groups.items())}


def reweighted_pool(by_group_stats: Mapping[str, Mapping[str, Any]], weights: Mapping[str, float]) -> dict[str, float]:
    """Pool figures predicted for a different mixture of the measured groups (the tuning aid for a world's
    ``hop_weights`` / ``buried_questions`` / ``trivial_questions``): each group's measured extreme share,
    uniform effective ratio and mean success, averaged with ``weights`` (group -> relative share; groups
    left out get 0). Assumes a group's difficulty does not depend on the mixture (the warm start saw another)."""
    unknown = set(weights) - set(by_group_stats)
    if unknown:
        raise ValueError(f"no measurement for groups {sorted(unknown)}; measured: {sorted(by_group_stats)}")
    total = float(sum(weights.values()))
    if total <= 0:
        raise ValueError("weights must have a positive sum")
    keys = ("share_extreme", "uniform_effective_ratio", "mean_success")
    return {key: sum(w * float(by_group_stats[g][key]) for g, w in weights.items()) / total for key in keys}


# ------------------------------------------------------------------------------------------- running
def _continue_first_turns(runner, trees: Sequence[RolloutTree], prompts: int, samples: int, rng) -> dict[str, Any]:
    mixed = [t for t in trees if t.is_mixed()][:prompts]
    requests, picked = [], []
    for tree in mixed:
        firsts = [n.node_id for n in tree if n.depth == 1 and not n.is_leaf]
        chosen = [int(x) for x in rng.permutation(firsts)[:MAX_PREFIXES_PER_TREE]]
        requests += [ContinuationRequest(tree, node, samples) for node in chosen]
        picked.append(chosen)
    roots = [float(t.leaf_rewards().mean()) for t in mixed]  # before the continuations add leaves
    runner.continue_anchors(requests)
    children = []
    for tree, chosen in zip(mixed, picked, strict=True):
        counts, values = tree.backups()
        children.append([(float(values[n] * counts[n]), int(counts[n])) for n in chosen])
    return {**first_turn_concentration(roots, children), "prompts": len(mixed), "samples": samples}


def measure_trees(
    backend, trees: Sequence[RolloutTree], args: argparse.Namespace, rng: np.random.Generator
) -> dict[str, Any]:
    """Samples ``args.samples`` rollouts from each fresh tree's root on ``backend`` (any ``RolloutBackend``:
    the engine's runner, or the simulator) and computes every statistic of the module docstring."""

    start = time.perf_counter()
    backend.continue_anchors([ContinuationRequest(tree, ROOT, args.samples) for tree in trees])
    seconds = time.perf_counter() - start
    counts = np.asarray([int(t.leaf_rewards().sum()) for t in trees])
    result: dict[str, Any] = {
        "pool": pool_summary(counts, args.samples, args.group_size),
        "by_group": by_group(trees, args.samples, args.group_size),
        "beta_binomial": fit_beta_binomial(counts, args.samples),
        "turns": turn_statistics(trees),
        "predictor": predictor_informativeness(trees, args.seed, group_size=args.group_size),
        "sampling_seconds": seconds,
    }
    if args.prefix_prompts:
        result["prefix"] = _continue_first_turns(backend, trees, args.prefix_prompts, args.prefix_samples, rng)
    return result


def measure(config, args: argparse.Namespace) -> dict[str, Any]:
    """The config's warm start (cached), then :func:`measure_trees` on ``--prompts`` questions of ``--split``."""

    start = time.perf_counter()
    warm = build.build_warm_start(config)
    warm_seconds = time.perf_counter() - start
    rows = warm.world.world.questions(args.split)
    rng = np.random.default_rng(args.seed)
    tasks = [rows[i] for i in rng.permutation(len(rows))[: args.prompts]]
    env = warm.world.env
    trees = [RolloutTree(env.prompt_ids(task), dict(task), i) for i, task in enumerate(tasks)]
    runner = build.build_runner(config, warm.sft.model_config, warm.sft.params, warm.world, seed=args.seed)
    result = measure_trees(runner, trees, args, rng)
    result["policy"] = {
        "params": num_params(warm.sft.model_config),
        "warm_start": warm.describe(),
        "warm_start_seconds": warm_seconds,
    }
    return result


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(CONFIG_DIR / "realistic.py"), help="config file[:arg]")
    parser.add_argument("--samples", type=int, default=16, help="rollouts per prompt (k)")
    parser.add_argument("--prompts", type=int, default=256, help="prompts drawn from --split (N)")
    parser.add_argument("--group-size", type=int, default=8, help="uniform's group size G for the effective ratio")
    parser.add_argument("--split", default="train")
    parser.add_argument("--seed", type=int, default=0, help="prompt draw and sampling seed")
    parser.add_argument("--prefix-prompts", type=int, default=32, help="mixed prompts whose first turns are continued")
    parser.add_argument("--prefix-samples", type=int, default=4, help="continuations per depth-1 prefix")
    parser.add_argument("--out", default="bench_results/difficulty.json")
    args = parser.parse_args(argv)
    if args.samples < 2 or args.prompts < 1 or not 1 <= args.group_size <= args.samples:
        parser.error("need --samples >= 2, --prompts >= 1 and 1 <= --group-size <= --samples")
    if args.prefix_prompts < 0 or args.prefix_samples < 2:
        parser.error("need --prefix-prompts >= 0 and --prefix-samples >= 2")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    config = configs.load(args.config)  # the run's RunConfig
    result = measure(config, args)
    result["setup"] = {
        **{k: v for k, v in vars(args).items() if k != "out"},
        "command": "python -m trace_jax.bench.difficulty " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    result["machine"] = {"platform": platform.platform(), "jax_devices": [str(d) for d in jax.devices()]}
    return emit(result, args.out)


if __name__ == "__main__":
    main()
