"""Where a step scores its prompts before it chooses them: at the root, or after the first search *(ours)*.

``SchedulerConfig.select_on`` names an entry of :data:`PROMPT_ANCHORS`; the scheduler calls it on the step's
candidates before the policy selects the batch (``select_prompts``) and splits stage 1 over it:

* ``root`` -- each prompt is scored at its root (the prompt alone). Nothing is sampled.
* ``first_search`` -- each candidate gets one rollout's first turn (a search call and its observation, or an
  answer that ends it), and the prompt is scored at that depth-1 node: where a question whose first lookup the
  retriever cannot answer already shows it, while its root looks like any other question's. The probes' tokens
  are charged to the step's budget (``AllocationContext.spent``); a kept prompt's probe is continued by the first
  of its stage-1 rollouts (``AllocationContext.dispatch_roots``), so only the dropped candidates' probes are
  spent on selection alone. A probe that ended in its first turn is scored by its reward.

Per step, :func:`selection_metrics` logs what the probes cost and how well the scores found the mixed groups.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from trace_jax.allocation.calibration import weighted_auc
from trace_jax.allocation.context import AllocationContext
from trace_jax.registry import Registry
from trace_jax.rollout.tree import ROOT, RolloutTree


def at_roots(ctx: AllocationContext) -> None:
    """Scores every prompt at its root (the default): nothing to sample."""


def after_first_search(ctx: AllocationContext) -> None:
    """One first turn per candidate (``max_turns=1``); each tree's prompt anchor becomes that depth-1 node."""
    roots = [(t, ROOT) for t in range(len(ctx.trees))]
    before = [len(tree) for tree in ctx.trees]
    stats = ctx.dispatch(roots, np.ones(len(roots), np.int64), max_turns=1)
    for t, tree in enumerate(ctx.trees):
        if len(tree) > before[t]:  # a strict token budget may have dropped this probe: the root stands in
            ctx.prompt_anchors[t] = before[t]
    ctx.notes.update({"select/probes": float(len(roots)), "select/probe_tokens": float(stats.generated_tokens)})


PROMPT_ANCHORS: Registry[Callable[[AllocationContext], None]] = Registry(
    "allocation.select_on", {"root": at_roots, "first_search": after_first_search}
)


def _probe_tokens(tree: RolloutTree, anchor: int) -> int:
    return 0 if anchor == ROOT else int(tree[anchor].token_ids.shape[0])


def _kind(tree: RolloutTree) -> str | None:
    return tree.task.get("kind") if isinstance(tree.task, Mapping) else None


def selection_metrics(ctx: AllocationContext, dropped: Sequence[tuple[RolloutTree, int]]) -> dict[str, float]:
    """Figures of the step's selection, once its trees are grown:

    * ``select/dropped_tokens``: the dropped candidates' probe tokens (charged, never trained);
    * ``select/kept/<kind>`` / ``select/dropped/<kind>``: candidates kept and dropped, by task kind (tasks whose
      ``kind`` names one; every kind seen gets both keys);
    * ``select/mixed_auc``: AUC of the kept prompts' selection scores for "the group came out mixed" (NaN
      without scores or with one class).

    ``dropped``: the dropped candidates with their prompt anchors (``AllocationContext.keep``).
    """
    metrics = {"select/dropped_tokens": float(sum(_probe_tokens(tree, anchor) for tree, anchor in dropped))}
    for tree, outcome in [(tree, "kept") for tree in ctx.trees] + [(tree, "dropped") for tree, _ in dropped]:
        kind = _kind(tree)
        for name in ("kept", "dropped") if kind is not None else ():
            key = f"select/{name}/{kind}"
            metrics[key] = metrics.get(key, 0.0) + float(name == outcome)
    scored = np.isfinite(ctx.prompt_scores)
    if dropped and scored.any():
        mixed = np.asarray([tree.is_mixed() for tree in ctx.trees], np.float64)[scored]
        metrics["select/mixed_auc"] = weighted_auc(ctx.prompt_scores[scored], mixed, np.ones(int(scored.sum())))
    return metrics
