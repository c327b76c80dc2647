"""Evaluation: EM / F1 per group (kind and hops for the synthetic world, data source for Search-R1 files), pass@k.

``evaluate(backend, env, tasks, samples)`` samples every task's root ``samples`` times through any
``RolloutBackend`` (a greedy runner for EM, a sampling one for pass@k) and scores the final answers.

Command line (``trace_jax.job.commands.evaluate_main``, on a finished or running ``trace_jax.train`` workdir)::

    python -m trace_jax.evaluate --workdir runs/default --split test [--samples 4] [--limit 200]
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from trace_jax import paths
from trace_jax.envs import rewards
from trace_jax.envs.base import AgentEnv
from trace_jax.job import build, recipes
from trace_jax.job.cli import ConfigError, Console, MissingFileError
from trace_jax.job.metrics import format_table
from trace_jax.rollout.backend import ContinuationRequest, RolloutBackend
from trace_jax.rollout.tree import ROOT, RolloutTree


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k from ``num_correct`` successes in ``num_samples`` draws: 1 - C(n-c, k) / C(n, k)."""
    if k > num_samples:
        raise ValueError(f"pass@{k} needs at least {k} samples per task, got {num_samples}")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def group_of(task: Any) -> str:
    """A question's evaluation group: ``"2-hop"`` for a synthetic chain question, ``"<kind>/2-hop"`` for the
    realistic world's other kinds (``buried``, ``trivial``), the ``data_source`` for Search-R1 rows."""
    if "hops" in task:
        kind = task.get("kind", "chain")
        return f"{task['hops']}-hop" if kind == "chain" else f"{kind}/{task['hops']}-hop"
    return str(task.get("data_source", "all"))


@dataclasses.dataclass
class EvalResult:
    """rows: one dict per group plus an ``all`` row (n, em, f1, pass@k...); trees: the sampled trees."""

    rows: list[dict[str, Any]]
    trees: list[RolloutTree]

    @property
    def overall(self) -> dict[str, Any]:
        return self.rows[-1]


def score_tree(tree: RolloutTree) -> tuple[np.ndarray, np.ndarray]:
    """EM and F1 of every leaf's final answer against the task's golds (0 when it never answered)."""
    golds = tree.task["golden_answers"]
    answers = [tree[i].info.get("answer") for i in tree.leaves()]
    em = np.asarray([0.0 if a is None else rewards.exact_match(a, golds) for a in answers])
    f1 = np.asarray([0.0 if a is None else rewards.f1_score(a, golds) for a in answers])
    return em, f1


def evaluate(
    backend: RolloutBackend,
    env: AgentEnv,
    tasks: Sequence[Any],
    samples: int = 1,
    progress: Any = None,
    chunk_size: int | None = None,
) -> EvalResult:
    """Samples each task ``samples`` times from its prompt and scores the answers, grouped and overall.

    EM and F1 are means over all samples (expected scores at the backend's sampling settings); pass@k is
    reported for k = 1 and k = ``samples``. ``chunk_size`` tasks go to the backend at a time (default: all at
    once), and a tqdm-like ``progress`` bar advances by each chunk's task count.
    """
    if not tasks:
        raise ValueError("no tasks to evaluate")
    trees = [RolloutTree(env.prompt_ids(task), task, i) for i, task in enumerate(tasks)]
    chunk_size = chunk_size or len(trees)
    for start in range(0, len(trees), chunk_size):
        chunk = trees[start : start + chunk_size]
        backend.continue_anchors([ContinuationRequest(tree, ROOT, samples) for tree in chunk])
        if progress is not None:
            progress.update(len(chunk))
    by_group: dict[str, list[tuple[np.ndarray, np.ndarray]]] = collections.defaultdict(list)
    for tree in trees:
        scores = score_tree(tree)
        by_group[group_of(tree.task)].append(scores)
        by_group["all"].append(scores)
    rows = []
    for group in [*sorted(g for g in by_group if g != "all"), "all"]:
        scored = by_group[group]
        row = {
            "group": group,
            "n": len(scored),
            "em": float(np.mean([em.mean() for em, _ in scored])),
            "f1": float(np.mean([f1.mean() for _, f1 in scored])),
        }
        for k in sorted({1, samples}):
            row[f"pass@{k}"] = float(np.mean([pass_at_k(len(em), int((em > 0.5).sum()), k) for em, _ in scored]))
        rows.append(row)
    return EvalResult(rows, trees)


def evaluate_run(workdir: str, split: str, samples: int, limit: int, console: Console) -> list[dict[str, Any]]:
    """Scores the newest policy of the run in ``workdir`` on ``split`` (the first ``limit`` questions; 0: all),
    prints the table and writes ``<workdir>/eval_<split>.json``; returns its rows."""
    run = paths.as_path(workdir)  # gs://bucket/run stays a URL
    if not (run / build.CONFIG_FILE).is_file():
        raise MissingFileError(f"{run} has no {build.CONFIG_FILE}: pass the --workdir of a trace_jax.train run")
    config = build.load_run_config(run)
    splits = recipes.source_of(config).splits
    if split not in splits:
        raise ConfigError(f"--split={split!r} is not allowed: one of {', '.join(splits)}")
    start, params, policy = recipes.latest_policy(config, run)
    runner = build.build_runner(config, start.model_config, params, start.world, greedy=samples == 1)
    tasks = start.world.world.questions(split)
    tasks = tasks[:limit] if limit else tasks
    with console.progress(len(tasks), f"evaluating {split}", unit="question") as bar:
        chunk = max(config.engine.max_slots, -(-len(tasks) // 4))
        result = evaluate(runner, start.world.env, tasks, samples, progress=bar, chunk_size=chunk)
    print(f"policy: {policy}; split {split}; {len(tasks)} questions x {samples} samples")
    print(format_table(result.rows))
    out = run / f"eval_{split}.json"
    out.write_text(json.dumps({"policy": policy, "split": split, "rows": result.rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return result.rows
