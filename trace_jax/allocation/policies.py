"""Allocation policies, one registry keyed by config string (``make_policy("trace")``).

Every policy spends one batch's budget through an :class:`~trace_jax.allocation.context.AllocationContext`,
so all are charged the same rollouts and generated tokens:

* ``uniform`` -- GRPO: the same number of rollouts for every prompt (a remainder goes to random prompts).
* ``dynamic_sampling`` -- DAPO: groups of G; an all-equal group is thrown away (its generation stays charged)
  and its prompt re-sampled while the budget lasts.
* ``root_only`` -- stage 1 alone (PCL / Knapsack-RL family): the whole budget split over roots by ``V_root``.
* ``tree_random`` -- Tree-GRPO: uniform chains, then L rounds that fork random non-root anchors.
* ``tree_entropy`` -- AT²PO / ARPO: uniform chains, then fork the anchors whose next turn had the highest
  policy entropy.
* ``trace`` -- TRACE: stage 1 by ``V_root`` on predicted root values, then L rounds of stage 2 by ``V_pref``
  per expected token.
* ``oracle`` -- ``trace`` with the simulator's true success probabilities (a bound; simulator only).
* ``greso`` -- GRESO's rule, history only: prompts whose last visit came out all-equal are skipped when the
  step has candidates to spare and down-weighted otherwise; uniform over the rest (no predictor).

``StagedPolicy(gate_auc=...)`` *(ours)* gates an active stage 2 on the predictor's held-out AUC on prefixes.

The stage ablation is ``make_policy("trace", stage1="uniform" | "active", stage2="uniform" | "active")``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from trace_jax.allocation import solvers
from trace_jax.allocation.context import AllocationContext, Item, tree_backups
from trace_jax.registry import Registry
from trace_jax.rollout.tree import ROOT, RolloutTree


class AllocationPolicy(Protocol):
    def select_prompts(self, ctx: AllocationContext, num: int) -> np.ndarray:
        """int64 [num]: which of ``ctx.trees`` (the candidates: unsampled roots, each with its probe under
        ``select_on="first_search"``) form the batch, in order."""
        ...

    def run(self, ctx: AllocationContext) -> None:
        """Spends (part of) ``ctx``'s budget, growing ``ctx.trees``; never exceeds the rollout budget."""
        ...


# --------------------------------------------------------------------------------------------- helpers
def _uniform_counts(num: int, total: int, rng: np.random.Generator) -> np.ndarray:
    """``total`` spread as evenly as possible over ``num`` slots; the remainder goes to random slots."""
    counts = np.full(num, total // num, np.int64)
    counts[rng.permutation(num)[: total % num]] += 1
    return counts


def _random_prompts(ctx: AllocationContext, num: int) -> np.ndarray:
    """``num`` of the candidates at random (the batch a policy without a predictor trains on), in input order."""
    return np.sort(ctx.rng.choice(len(ctx.trees), size=num, replace=False))


def _branch_anchors(ctx: AllocationContext, include_roots: bool) -> tuple[list[Item], np.ndarray, np.ndarray]:
    """Non-leaf nodes with at least one finished rollout below (roots only if asked and already sampled).

    Returns the items, float64 [N] the success share already seen under each (``V̂``), and bool [N] whether the
    item's tree is already mixed. One pass per tree, so a round over 10,000 anchors stays cheap.
    """
    items, seen, tree_mixed = [], [], []
    for t, tree in enumerate(ctx.trees):
        counts, values = tree_backups(tree)
        mixed = bool(0.0 < values[ROOT] < 1.0)
        chosen = [
            node.node_id
            for node in tree
            if not node.is_leaf and counts[node.node_id] > 0 and (include_roots or node.node_id != ROOT)
        ]
        items += [(t, n) for n in chosen]
        seen.append(values[chosen])
        tree_mixed.append(np.full(len(chosen), mixed))
    if not items:
        return [], np.zeros(0), np.zeros(0, bool)
    return items, np.concatenate(seen), np.concatenate(tree_mixed)


def _next_turn_entropy(tree: RolloutTree, node_id: int) -> float:
    """Mean per-token policy entropy of the turns sampled from ``node_id`` (how unsure the policy was there)."""
    children = tree[node_id].children
    values = np.concatenate([tree[c].entropies for c in children]) if children else np.zeros(0)
    return float(values.mean()) if values.size else 0.0


# ------------------------------------------------------------------------------------------ the policies
@dataclasses.dataclass
class StagedPolicy:
    """Stage 1 over roots, then ``rounds`` rounds of stage 2 over prefixes (TRACE and its baselines).

    Args:
      stage1: "uniform" (equal rollouts per prompt) or "active" (greedy ``V_root``).
      stage2: "none", "uniform" (random anchors), "entropy" (highest next-turn entropy) or "active"
        (greedy ``V_pref`` per expected token).
      scorer: "predictor" (the shared predictor) or "oracle" (true probabilities; simulator only).
      root_fraction: share of the budget stage 1 may spend (1.0 when ``stage2 == "none"``). 0.65 was best of
        0.35-0.85 on the simulator (tuned on seeds the benchmark does not report).
      rounds: L, the number of stage-2 rounds; each spends an equal share of what is left.
      min_per_prompt / max_per_prompt: stage-1 bounds for "active". 0 lets a prompt be filtered (the paper);
        the default 1 *(ours)* keeps one chain per prompt, so stage 2 can still rescue a prompt that a noisy
        predictor would have filtered (it scored better in ``trace_jax.bench.allocation`` unless the predictor
        is near perfect).
      max_per_anchor: most continuations one anchor gets per round ("active"; 1 for uniform/entropy).
      branch_roots: let stage 2 add rollouts at already-sampled roots (the root prefix, t = 0).
      mixed_tree_weight: *(ours)* factor on ``V_pref`` of anchors whose tree is already mixed. 1.0 values every
        anchor alike (the paper's currency: turn-level signal); lower values first make more whole prompts
        mixed. In ``trace_jax.bench.allocation`` 0.1 raised the effective ratio by a few points over 1.0 and
        lowered the non-zero-advantage token share by about as much.
      gate_auc: *(ours)* an active stage 2 runs only while the predictor's held-out AUC on prefixes over recent
        batches (``AllocationContext.prefix_auc``) is at least this; below it (or before any is measured) stage
        2 forks random anchors, as ``tree_random`` does. Logged per step as ``gate/open`` and ``gate/auc``.
        0: no gate.
    """

    stage1: str = "active"
    stage2: str = "active"
    scorer: str = "predictor"
    root_fraction: float = 0.65
    rounds: int = 3
    min_per_prompt: int = 1
    max_per_prompt: int = 16
    max_per_anchor: int = 4
    branch_roots: bool = True
    mixed_tree_weight: float = 0.1
    gate_auc: float = 0.0

    def __post_init__(self):
        choices = {"stage1": ("uniform", "active"), "stage2": ("none", "uniform", "entropy", "active")}
        choices["scorer"] = ("predictor", "oracle")
        for field, allowed in choices.items():
            if getattr(self, field) not in allowed:
                raise ValueError(f"{field}={getattr(self, field)!r}; choose one of {', '.join(allowed)}")
        if not 0 < self.root_fraction <= 1 or self.rounds < 0:
            raise ValueError("need 0 < root_fraction <= 1 and rounds >= 0")

    def _score(self, ctx: AllocationContext, items: list[Item]) -> np.ndarray:
        return ctx.true_success(items) if self.scorer == "oracle" else ctx.predict(items)

    def _dispersion(self, ctx: AllocationContext, items: list[Item]) -> np.ndarray | float:
        """The predictor's dispersion of each root's success probability; 0 (plug-in) for the oracle or a
        predictor without one."""
        rho = None if self.scorer == "oracle" else ctx.predict_dispersion(items)
        return 0.0 if rho is None else rho

    @property
    def scores_prompts(self) -> bool:
        """Whether selection and stage 1 rank prompts by their scores (``SchedulerConfig.select_on``)."""
        return self.stage1 == "active"

    def _prompt_scores(self, ctx: AllocationContext) -> tuple[np.ndarray, np.ndarray | float]:
        """Each tree's success estimate and dispersion at the node standing for its prompt
        (``ctx.prompt_anchors``: the root, or a selection probe's first turn); a probe that already ended is
        scored by its reward, with no dispersion."""
        items = ctx.prompt_items()
        values, rho = self._score(ctx, items), self._dispersion(ctx, items)
        ended = np.asarray([ctx.trees[t][n].is_leaf for t, n in items], bool)
        if not ended.any():
            return values, rho
        rewards = np.asarray([ctx.trees[t][n].reward if ctx.trees[t][n].is_leaf else 0.0 for t, n in items])
        return np.where(ended, rewards, values), np.where(ended, 0.0, rho)

    @property
    def _root_share(self) -> float:
        """Share of the budget stage 1 may spend: all of it without a stage 2."""
        return 1.0 if self.stage2 == "none" else self.root_fraction

    def select_prompts(self, ctx: AllocationContext, num: int) -> np.ndarray:
        """Prompt selection *(ours)*: from more candidates than the batch holds, "active" keeps the ``num``
        whose group of ``m`` rollouts is most likely mixed, ``E[V_root(p, m)]`` on predicted root values (and the
        predictor's dispersion, if it has one) with ``m`` what stage 1 affords per kept prompt (ties in random
        order); "uniform" keeps ``num`` at random. The values are scored where ``ctx.prompt_anchors`` says (the
        root, or the first search) and kept in ``ctx.prompt_scores``.
        """
        if self.stage1 == "uniform":
            return _random_prompts(ctx, num)
        root_cost = float(ctx.costs([(0, ROOT)])[0])
        per_prompt = max(2, ctx.affordable_rollouts(root_cost, self._root_share) // num)
        value = solvers.expected_root_value(*self._prompt_scores(ctx), per_prompt)
        ctx.prompt_scores = value
        order = np.lexsort((ctx.rng.random(len(value)), -value))  # by value, then a random tie-break
        return np.sort(order[:num])

    def run(self, ctx: AllocationContext) -> None:
        self.root_stage(ctx)
        if self.stage2 == "none":
            return
        mode = self.stage2_mode(ctx)
        for round_index in range(self.rounds):
            self.prefix_round(ctx, share=1.0 / (self.rounds - round_index), mode=mode)

    def stage2_mode(self, ctx: AllocationContext) -> str:
        """The step's stage 2: ``self.stage2``, or "uniform" while a gated active stage 2 is closed (the held-out
        prefix AUC below ``gate_auc`` or not measured yet); notes the gate's state."""
        if self.stage2 != "active" or self.gate_auc <= 0:
            return self.stage2
        is_open = bool(np.isfinite(ctx.prefix_auc) and ctx.prefix_auc >= self.gate_auc)
        ctx.notes.update({"gate/open": float(is_open), "gate/auc": float(ctx.prefix_auc)})
        return "active" if is_open else "uniform"

    def root_stage(self, ctx: AllocationContext) -> None:
        """Stage 1: rollouts from the roots, within ``root_fraction`` of the budget."""
        roots = [(t, ROOT) for t in range(len(ctx.trees))]
        if not roots:
            return
        total = ctx.affordable_rollouts(float(ctx.costs(roots[:1])[0]), self._root_share)
        if self.stage1 == "uniform":
            counts = _uniform_counts(len(roots), total, ctx.rng)
        else:
            lo = min(self.min_per_prompt, total // len(roots))
            values, rho = self._prompt_scores(ctx)
            counts = solvers.allocate_roots(values, total, lo, self.max_per_prompt, dispersion_b=rho)
        ctx.dispatch_roots(counts)

    def prefix_round(self, ctx: AllocationContext, share: float, mode: str | None = None) -> None:
        """One stage-2 round of ``mode`` (default ``stage2``): continuations from sampled anchors, within ``share``
        of what is left."""
        mode = mode or self.stage2
        items, seen, tree_mixed = _branch_anchors(ctx, include_roots=self.branch_roots and mode == "active")
        if not items:
            return
        cost = ctx.costs(items)
        tokens = ctx.tokens_left * share if np.isfinite(ctx.tokens_left) else None
        rollouts = int(np.floor(ctx.rollouts_left * share)) if np.isfinite(ctx.rollouts_left) else None
        if mode == "active":
            repeat = solvers.repeat_probability(self._score(ctx, items), np.round(seen))
            repeat = np.where((seen > 0) & (seen < 1), 1.0, repeat)  # a mixed anchor gains nothing more
            weight = np.where(tree_mixed, self.mixed_tree_weight, 1.0)
            counts = solvers.allocate_prefixes(repeat, cost, tokens, rollouts, self.max_per_anchor, weight)
        else:
            if mode == "uniform":
                priority = ctx.rng.random(len(items)) + 1e-9
            else:
                priority = np.asarray([_next_turn_entropy(ctx.trees[t], n) for t, n in items]) + 1e-9
            counts = solvers.fill_by_priority(priority[:, None], cost, tokens, rollouts)
        ctx.dispatch(items, counts)


@dataclasses.dataclass
class DynamicSamplingPolicy:
    """DAPO dynamic sampling: sample groups of ``group_size``; discard all-equal groups and re-sample.

    A discarded group's tree is replaced by a fresh root (the tokens stay charged: ``ctx.spent``); a prompt is
    tried at most ``max_attempts`` times; the last attempt's group is kept even if it is not mixed.
    """

    group_size: int = 4
    max_attempts: int = 3

    def select_prompts(self, ctx: AllocationContext, num: int) -> np.ndarray:
        return _random_prompts(ctx, num)

    def run(self, ctx: AllocationContext) -> None:
        if self.group_size < 2 or self.max_attempts < 1:
            raise ValueError("dynamic_sampling needs group_size >= 2 and max_attempts >= 1")
        pending = list(ctx.rng.permutation(len(ctx.trees)))
        attempts = np.zeros(len(ctx.trees), np.int64)
        while pending:
            root_cost = float(ctx.costs([(0, ROOT)])[0])
            affordable = ctx.affordable_rollouts(root_cost) // self.group_size
            batch, pending = pending[:affordable], pending[affordable:]
            if not batch:
                return
            for t in batch:
                if ctx.trees[t].leaves():
                    ctx.trees[t] = _fresh_copy(ctx.trees[t])
            ctx.dispatch([(t, ROOT) for t in batch], np.full(len(batch), self.group_size))
            attempts[batch] += 1
            pending += [t for t in batch if not ctx.trees[t].is_mixed() and attempts[t] < self.max_attempts]


@dataclasses.dataclass
class GresoPolicy:
    """GRESO's pre-rollout filter on history alone (no predictor): a prompt whose last group (of at least 2
    rollouts) came out all-right or all-wrong is likely to again.

    Args:
      explore_probability: chance such a prompt is still treated as any other this step (GRESO's exploration:
        a prompt the policy has since learned can come back).
      down_weight: with no candidates to spare, a flagged prompt in the batch gets this share of an unflagged
        prompt's rollouts (at least 1); 0 skips it.

    ``select_prompts`` keeps unflagged candidates first (at random), then flagged ones if the batch is short;
    ``run`` spends the budget on roots, uniform over the batch with flagged prompts down-weighted.
    """

    explore_probability: float = 0.1
    down_weight: float = 0.25

    def __post_init__(self):
        if not 0 <= self.explore_probability <= 1 or not 0 <= self.down_weight <= 1:
            raise ValueError("greso needs 0 <= explore_probability <= 1 and 0 <= down_weight <= 1")

    def _flagged(self, ctx: AllocationContext) -> np.ndarray:
        flagged = ctx.last_all_equal(range(len(ctx.trees)))
        return flagged & (ctx.rng.random(len(ctx.trees)) >= self.explore_probability)

    def select_prompts(self, ctx: AllocationContext, num: int) -> np.ndarray:
        flagged = self._flagged(ctx)
        order = np.lexsort((ctx.rng.random(len(ctx.trees)), flagged))  # unflagged first, random within each
        ctx.notes["greso/skipped"] = float(min(flagged.sum(), len(ctx.trees) - num))
        return np.sort(order[:num])

    def run(self, ctx: AllocationContext) -> None:
        roots = [(t, ROOT) for t in range(len(ctx.trees))]
        if not roots:
            return
        total = ctx.affordable_rollouts(float(ctx.costs(roots[:1])[0]))
        flagged = self._flagged(ctx)
        weight = np.where(flagged, self.down_weight, 1.0)
        counts = np.floor(total * weight / max(weight.sum(), 1e-9)).astype(np.int64)
        if self.down_weight > 0:
            counts[flagged] = np.maximum(counts[flagged], 1)
        while counts.sum() > total:  # the floor of 1 may overshoot a tiny budget: take back from the largest
            counts[np.argmax(counts)] -= 1
        spare = total - int(counts.sum())
        receivers = np.flatnonzero(weight == weight.max())
        counts[ctx.rng.permutation(receivers)[: spare % receivers.size]] += 1
        counts[receivers] += spare // receivers.size
        ctx.notes["greso/down_weighted"] = float(flagged.sum())
        ctx.dispatch_roots(counts)


def _fresh_copy(tree: RolloutTree) -> RolloutTree:
    """The same prompt with no rollouts (root feature and info kept)."""
    fresh = RolloutTree(tree.root.token_ids, tree.task, tree.prompt_index)
    fresh.root.feature, fresh.root.info = tree.root.feature, dict(tree.root.info)
    return fresh


POLICIES: Registry[Callable[..., AllocationPolicy]] = Registry(
    "allocation policy",
    {
        "uniform": lambda **kw: StagedPolicy(**{"stage1": "uniform", "stage2": "none", **kw}),
        "dynamic_sampling": DynamicSamplingPolicy,
        "root_only": lambda **kw: StagedPolicy(**{"stage1": "active", "stage2": "none", **kw}),
        "tree_random": lambda **kw: StagedPolicy(**{"stage1": "uniform", "stage2": "uniform", **kw}),
        "tree_entropy": lambda **kw: StagedPolicy(**{"stage1": "uniform", "stage2": "entropy", **kw}),
        "trace": lambda **kw: StagedPolicy(**{"stage1": "active", "stage2": "active", **kw}),
        "oracle": lambda **kw: StagedPolicy(**{"stage1": "active", "stage2": "active", "scorer": "oracle", **kw}),
        "greso": GresoPolicy,
    },
)


def make_policy(name: str, **overrides: Any) -> AllocationPolicy:
    """The policy registered as ``name``, with keyword ``overrides`` of its fields."""
    return POLICIES[name](**overrides)
