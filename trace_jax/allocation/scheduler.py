"""TreeScheduler: spends one RL step's sampling budget over a batch of prompts and returns their trees.

Per batch: build the budget, (with more candidate prompts than the batch holds) let the policy select the
batch's prompts, let the configured policy run its rounds (predict -> allocate -> ask the backend
-> trees grow), then score the batch's anchors with the predictor *before* it learns from them (held-out
calibration metrics), train the predictor on the ``V̂`` backups and update the cost model.

The backend is anything with ``continue_anchors(requests) -> RolloutStats``: the real rollout runner or the
simulator. A backend may also offer ``featurize_roots(trees)`` (set ``root.feature`` where it is missing); the
scheduler calls it before stage 1 so root predictions see the prompt. Without it, roots that were never
prefilled are scored from depth alone (the MLP predictor's has-feature bit is 0 for them).

Usage per RL step::

    scheduler = TreeScheduler(backend, SchedulerConfig(policy="trace", rollouts_per_prompt=8))
    result = scheduler.run([RolloutTree(env.prompt_ids(task), task, i) for i, task in enumerate(tasks)])
    result.trees, result.stats, result.metrics
    checkpoint["scheduler"] = scheduler.state_dict()
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from trace_jax.allocation.anchors import training_anchors
from trace_jax.allocation.calibration import calibration_metrics
from trace_jax.allocation.context import AllocationContext, Budget, CostModel
from trace_jax.allocation.policies import AllocationPolicy, make_policy
from trace_jax.allocation.predictor import SuccessPredictor, make_predictor
from trace_jax.rollout import figures
from trace_jax.rollout.backend import ContinuationRequest, RolloutBackend, RolloutStats
from trace_jax.rollout.tree import ROOT, RolloutTree


@dataclasses.dataclass
class SchedulerConfig:
    """Everything a run chooses about allocation (all names are config strings / numbers).

    policy / policy_kwargs: a name of ``policies.POLICIES`` and overrides of its fields.
    predictor / predictor_kwargs: a name of ``predictor.PREDICTORS`` and its constructor arguments.
    rollouts_per_prompt: rollout budget = round(batch size x this); None: no rollout limit.
    tokens_per_prompt: generated-token budget = round(batch size x this); None: no token limit.
    max_tokens_per_rollout: the most one continuation can generate (max turns x per-turn token limit); set it
      and the token budget is never exceeded (see ``context.Budget``); None: planned on expected costs only.
    prior_tokens_per_rollout: the cost model's guess before it has seen a finished tree.
    max_depth: deepest turn the cost model tells apart (deeper turns share its estimate).
    seed: the policies' random choices.
    candidates_per_prompt: *(ours)* prompts drawn per prompt trained (>= 1): the training loop draws
      ``candidates(batch size)`` prompts a step and the policy keeps the batch's worth of them
      (``select_prompts``: TRACE by predicted ``V_root``, policies without a predictor at random). The budget
      and every per-prompt figure are those of the kept batch. 1: no selection.
    predictor_warmup_prompts / predictor_warmup_rollouts / predictor_warmup_updates: *(ours)* before the first RL
      step, ``warm_up`` samples groups of ``predictor_warmup_rollouts`` on that many prompts and trains the
      predictor ``predictor_warmup_updates`` times on their anchors, so stage 1 does not start from an untrained
      predictor. Its cost is logged apart (``alloc/warmup/*`` at step 0). 0 prompts: no warm-up.
    """

    policy: str = "trace"
    policy_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    predictor: str = "mlp"
    predictor_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    rollouts_per_prompt: float | None = 8.0
    tokens_per_prompt: float | None = None
    max_tokens_per_rollout: int | None = None
    prior_tokens_per_rollout: float = 512.0
    max_depth: int = 16
    seed: int = 0
    candidates_per_prompt: float = 1.0
    predictor_warmup_prompts: int = 0
    predictor_warmup_rollouts: int = 8
    predictor_warmup_updates: int = 8

    def __post_init__(self):
        if not self.candidates_per_prompt >= 1:
            raise ValueError(
                f"candidates_per_prompt must be >= 1 (prompts drawn per prompt trained): {self.candidates_per_prompt}"
            )
        if self.predictor_warmup_rollouts < 2 or self.predictor_warmup_updates < 1:
            raise ValueError(
                "the predictor warm-up needs predictor_warmup_rollouts >= 2 and predictor_warmup_updates >= 1"
            )

    def candidates(self, batch_size: int) -> int:
        """How many prompts to draw for a batch of ``batch_size``."""
        return max(batch_size, round(batch_size * self.candidates_per_prompt))


@dataclasses.dataclass
class ScheduleResult:
    """The batch's trees (one per prompt, in input order), the backend cost, and figures for the logs."""

    trees: list[RolloutTree]
    stats: RolloutStats
    metrics: dict[str, float]


class TreeScheduler:
    """Runs an allocation policy over batches and keeps the state that outlives a batch (see ``state_dict``).

    Args:
      backend: produces continuations (``RolloutBackend``).
      config: see :class:`SchedulerConfig`.
      policy / predictor: ready-made objects that override the config's names.
    """

    def __init__(
        self,
        backend: RolloutBackend,
        config: SchedulerConfig | None = None,
        policy: AllocationPolicy | None = None,
        predictor: SuccessPredictor | None = None,
    ):
        self.backend = backend
        self.config = cfg = config or SchedulerConfig()
        self.policy = policy or make_policy(cfg.policy, **cfg.policy_kwargs)
        self.predictor = predictor or make_predictor(cfg.predictor, **cfg.predictor_kwargs)
        self.cost_model = CostModel(cfg.max_depth, cfg.prior_tokens_per_rollout)
        self.step = 0

    def budget(self, batch_size: int) -> Budget:
        cfg = self.config
        return Budget(
            rollouts=None if cfg.rollouts_per_prompt is None else round(batch_size * cfg.rollouts_per_prompt),
            tokens=None if cfg.tokens_per_prompt is None else round(batch_size * cfg.tokens_per_prompt),
            max_tokens_per_rollout=cfg.max_tokens_per_rollout,
        )

    def run(self, trees: Sequence[RolloutTree], batch_size: int | None = None) -> ScheduleResult:
        """Samples the batch within the budget and trains the predictor on it.

        ``trees`` are roots (usually unsampled). ``batch_size`` (default: all of them) is how many form the batch:
        with fewer than ``len(trees)`` the policy selects that many first; the result holds only those.
        """
        num_candidates, batch_size = len(trees), len(trees) if batch_size is None else batch_size
        if not 1 <= batch_size <= len(trees):
            raise ValueError(f"batch_size must be in [1, {len(trees)}] (the candidates given), got {batch_size}")
        self._featurize(trees)
        start = time.perf_counter()
        rng = np.random.default_rng([self.config.seed, self.step])
        budget = self.budget(batch_size)
        if batch_size < len(trees):
            candidates = AllocationContext(trees, self.backend, budget, self.predictor, self.cost_model, rng)
            trees = [trees[i] for i in self.policy.select_prompts(candidates, batch_size)]
        ctx = AllocationContext(trees, self.backend, budget, self.predictor, self.cost_model, rng)
        self.policy.run(ctx)
        allocate_seconds = time.perf_counter() - start - ctx.backend_seconds

        anchors = training_anchors(ctx.trees, with_prefix_ids=getattr(self.predictor, "needs_prefix_ids", False))
        metrics: dict[str, float] = {}
        if len(anchors):
            pred = self.predictor.predict(anchors)  # before it learns from these trees: held out
            held_out = calibration_metrics(pred, anchors.targets_n, anchors.weights_n)
            metrics.update({f"predictor/{k}": v for k, v in held_out.items()})
            metrics.update(self.predictor.update(anchors))
        self.cost_model.update(ctx.trees)
        self.step += 1

        metrics.update(figures.batch_figures(ctx.trees, generated_tokens=ctx.spent.generated_tokens))
        metrics.update(
            {
                "prompts": float(len(ctx.trees)),
                "candidates": float(num_candidates),
                "budget/rollouts": float(ctx.spent.rollouts),
                "budget/generated_tokens": float(ctx.spent.generated_tokens),
                "budget/rounds": float(len(ctx.rounds)),
                "budget/token_use": ctx.spent.generated_tokens / ctx.budget.tokens if ctx.budget.tokens else np.nan,
                "time/allocate_ms": 1e3 * allocate_seconds,
                "time/backend_ms": 1e3 * ctx.backend_seconds,
            }
        )
        return ScheduleResult(ctx.trees, ctx.spent, metrics)

    def _featurize(self, trees: Sequence[RolloutTree]) -> None:
        featurize = getattr(self.backend, "featurize_roots", None)
        if featurize is not None and any(tree.root.feature is None for tree in trees):
            featurize(trees)  # optional backend hook: stage 1 predicts from root features (one prefill)

    def warm_up(self, trees: Sequence[RolloutTree]) -> dict[str, float]:
        """Trains the predictor on uniform groups sampled on ``trees`` (roots) before the first batch.

        ``predictor_warmup_rollouts`` rollouts a prompt, then ``predictor_warmup_updates`` predictor updates on
        the trees' anchors (each update replays them); the cost model learns from them too. Returns the figures
        and the cost (``prompts``, ``rollouts``, ``generated_tokens``, ``effective_ratio``, predictor loss).
        """
        cfg = self.config
        self._featurize(trees)
        stats = self.backend.continue_anchors(
            [ContinuationRequest(tree, ROOT, cfg.predictor_warmup_rollouts) for tree in trees]
        )
        anchors = training_anchors(trees, with_prefix_ids=getattr(self.predictor, "needs_prefix_ids", False))
        fitted: dict[str, float] = {}
        for _ in range(cfg.predictor_warmup_updates):
            fitted = self.predictor.update(anchors)
        self.cost_model.update(trees)
        return {
            "prompts": float(len(trees)),
            "rollouts": float(stats.rollouts),
            "generated_tokens": float(stats.generated_tokens),
            "effective_ratio": figures.effective_ratio(trees),
            **fitted,
        }

    # ------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Predictor (params, optimizer, statistics), cost model and step: plain dicts / numpy arrays."""
        return {
            "predictor": self.predictor.state_dict(),
            "cost_model": self.cost_model.state_dict(),
            "step": self.step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.predictor.load_state_dict(state["predictor"])
        self.cost_model.load_state_dict(state["cost_model"])
        self.step = int(state["step"])
