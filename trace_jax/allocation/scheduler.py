"""TreeScheduler: spends one RL step's sampling budget over a batch of prompts and returns their trees.

Per batch: build the budget, score the candidates where ``select_on`` says (at the root, or after one probe
turn: ``selection``), (with more candidate prompts than the batch holds) let the policy select the
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

from trace_jax.allocation.anchors import AnchorBatch, training_anchors
from trace_jax.allocation.calibration import calibration_metrics, weighted_auc
from trace_jax.allocation.context import AllocationContext, Budget, CostModel
from trace_jax.allocation.history import PromptHistory
from trace_jax.allocation.policies import AllocationPolicy, make_policy
from trace_jax.allocation.predictor import SuccessPredictor, make_predictor
from trace_jax.allocation.selection import PROMPT_ANCHORS, selection_metrics
from trace_jax.config_utils import documented
from trace_jax.rollout import figures
from trace_jax.rollout.backend import ContinuationRequest, RolloutBackend, RolloutStats
from trace_jax.rollout.tree import ROOT, RolloutTree


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Everything a run chooses about allocation (all names are config strings / numbers)."""

    policy: str = documented("trace", "a name of ``policies.POLICIES`` and overrides of its fields.")
    policy_kwargs: dict[str, Any] = documented(
        default_factory=dict,
        doc=("a name of ``policies.POLICIES`` and overrides of its fields."),
    )
    predictor: str = documented("mlp", "a name of ``predictor.PREDICTORS`` and its constructor arguments.")
    predictor_kwargs: dict[str, Any] = documented(
        default_factory=dict,
        doc=("a name of ``predictor.PREDICTORS`` and its constructor arguments."),
    )
    rollouts_per_prompt: float | None = documented(
        8.0,
        "rollout budget = round(batch size x this); None: no rollout limit.",
    )
    tokens_per_prompt: float | None = documented(
        None,
        "generated-token budget = round(batch size x this); None: no token limit.",
    )
    max_tokens_per_rollout: int | None = documented(
        None,
        "the most one continuation can generate (max turns x per-turn token limit); set it and the token budget is "
        "never exceeded (see ``context.Budget``); None: planned on expected costs only.",
    )
    prior_tokens_per_rollout: float = documented(512.0, "the cost model's guess before it has seen a finished tree.")
    max_depth: int = documented(16, "deepest turn the cost model tells apart (deeper turns share its estimate).")
    seed: int = documented(0, "the policies' random choices.")
    candidates_per_prompt: float = documented(
        1.0,
        "*(ours)* prompts drawn per prompt trained (>= 1): the training loop draws ``candidates(batch size)`` prompts "
        "a step and the policy keeps the batch's worth of them (``select_prompts``: TRACE by predicted ``V_root``, "
        "policies without a predictor at random). The budget and every per-prompt figure are those of the kept batch. "
        "1: no selection.",
    )
    select_on: str = documented(
        "root",
        '*(ours)* where selection and stage 1 score a prompt (``selection.PROMPT_ANCHORS``): "root" (the prompt alone) '
        'or "first_search" (each candidate first gets one rollout\'s first turn, the search call and its observation, '
        "and is scored at that depth-1 prefix; the probes' tokens are charged to the budget, a kept prompt's probe is "
        "continued by its first stage-1 rollout). Needs a policy that ranks prompts by the predictor (stage 1 "
        '"active": trace, root_only). Logged as ``select/*``.',
    )
    predictor_warmup_prompts: int = documented(
        0,
        "*(ours)* before the first RL step, ``warm_up`` samples groups of ``predictor_warmup_rollouts`` on that many "
        "prompts and trains the predictor ``predictor_warmup_updates`` times on their anchors, so stage 1 does not "
        "start from an untrained predictor. Its cost is logged apart (``alloc/warmup/*`` at step 0). 0 prompts: no "
        "warm-up.",
    )
    predictor_warmup_rollouts: int = documented(
        8,
        "*(ours)* before the first RL step, ``warm_up`` samples groups of ``predictor_warmup_rollouts`` on that many "
        "prompts and trains the predictor ``predictor_warmup_updates`` times on their anchors, so stage 1 does not "
        "start from an untrained predictor. Its cost is logged apart (``alloc/warmup/*`` at step 0). 0 prompts: no "
        "warm-up.",
    )
    predictor_warmup_updates: int = documented(
        8,
        "*(ours)* before the first RL step, ``warm_up`` samples groups of ``predictor_warmup_rollouts`` on that many "
        "prompts and trains the predictor ``predictor_warmup_updates`` times on their anchors, so stage 1 does not "
        "start from an untrained predictor. Its cost is logged apart (``alloc/warmup/*`` at step 0). 0 prompts: no "
        "warm-up.",
    )
    prefix_auc_window: int = documented(
        4,
        "*(ours)* the held-out AUC on prefixes a gated stage 2 reads (``policy_kwargs.gate_auc``; logged as "
        "``alloc/gate/auc``) pools the predictions of this many recent batches, made before the predictor learned from "
        "them.",
    )
    compare_without_history: bool = documented(
        False,
        "*(ours)* with a predictor that reads prompt history (``predictor_kwargs.history``), also train the same "
        "predictor without it on the same anchors (it allocates nothing) and log its held-out figures as "
        "``alloc/predictor/no_history/*``: history's worth, measured on identical anchors.",
    )

    def __post_init__(self):
        if not self.candidates_per_prompt >= 1:
            raise ValueError(
                f"candidates_per_prompt must be >= 1 (prompts drawn per prompt trained): {self.candidates_per_prompt}"
            )
        if self.predictor_warmup_rollouts < 2 or self.predictor_warmup_updates < 1:
            raise ValueError(
                "the predictor warm-up needs predictor_warmup_rollouts >= 2 and predictor_warmup_updates >= 1"
            )
        if self.prefix_auc_window < 1:
            raise ValueError(f"prefix_auc_window must be >= 1 (batches), got {self.prefix_auc_window}")
        PROMPT_ANCHORS[self.select_on]  # an unknown name is an error naming the choices
        policy = make_policy(self.policy, **self.policy_kwargs) if self.select_on != "root" else None
        if policy is not None and not getattr(policy, "scores_prompts", False):
            raise ValueError(
                f"select_on={self.select_on!r} scores prompts for a policy that ranks them by the predictor (stage 1 "
                f"'active': trace, root_only); policy {self.policy!r} would not read the scores: use select_on='root'"
            )
        if policy is not None and (self.rollouts_per_prompt or np.inf) < self.candidates_per_prompt:
            raise ValueError(
                f"select_on={self.select_on!r} probes every candidate, and a probe that answers in its first turn is "
                f"a rollout: rollouts_per_prompt ({self.rollouts_per_prompt}) must be at least candidates_per_prompt "
                f"({self.candidates_per_prompt})"
            )
        if self.compare_without_history and not self.predictor_kwargs.get("history"):
            raise ValueError("compare_without_history needs a predictor that reads history: predictor_kwargs.history")

    def candidates(self, batch_size: int) -> int:
        """How many prompts to draw for a batch of ``batch_size``."""
        return max(batch_size, round(batch_size * self.candidates_per_prompt))


def held_out_metrics(prefix: str, pred_n: np.ndarray, anchors: AnchorBatch) -> dict[str, float]:
    """Calibration of predictions made before learning from ``anchors``: on all of them
    (``<prefix>/{brier,auc,ece}``), on the roots alone (``<prefix>/root/*``) and on deeper prefixes alone
    (``<prefix>/prefix/*``)."""
    metrics = {}
    for name, keep in (("", slice(None)), ("root/", anchors.depths_n == 0), ("prefix/", anchors.depths_n > 0)):
        figures = calibration_metrics(pred_n[keep], anchors.targets_n[keep], anchors.weights_n[keep])
        metrics.update({f"{prefix}/{name}{k}": v for k, v in figures.items() if not (name and k == "ece")})
    return metrics


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
        self.history = PromptHistory()
        self.without_history = (
            make_predictor(cfg.predictor, **{**cfg.predictor_kwargs, "history": False})
            if cfg.compare_without_history
            else None
        )
        self.recent_prefixes: list[np.ndarray] = []  # per recent batch: [3, N] held-out prediction, target, weight
        self.step = 0

    @property
    def prefix_auc(self) -> float:
        """The predictor's held-out AUC on the prefixes of the last ``prefix_auc_window`` batches (NaN before any)."""
        if not self.recent_prefixes:
            return float("nan")
        pred, target, weight = np.concatenate(self.recent_prefixes, axis=1)
        return weighted_auc(pred, target, weight)

    def _context(self, trees: Sequence[RolloutTree], budget: Budget, rng: np.random.Generator) -> AllocationContext:
        args = (trees, self.backend, budget, self.predictor, self.cost_model, rng)
        return AllocationContext(*args, history=self.history, prefix_auc=self.prefix_auc)

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
        ctx = self._context(trees, self.budget(batch_size), rng)
        PROMPT_ANCHORS[self.config.select_on](ctx)
        dropped = ctx.keep(self.policy.select_prompts(ctx, batch_size)) if batch_size < len(trees) else []
        self.policy.run(ctx)
        allocate_seconds = time.perf_counter() - start - ctx.backend_seconds

        anchors = training_anchors(ctx.trees, with_prefix_ids=self._prefix_ids, history=self.history)
        metrics: dict[str, float] = dict(ctx.notes)
        if dropped or self.config.select_on != "root":
            metrics.update(selection_metrics(ctx, dropped))
        if len(anchors):
            pred = self.predictor.predict(anchors)  # before it learns from these trees: held out
            metrics.update(held_out_metrics("predictor", pred, anchors))
            prefixes = anchors.depths_n > 0
            held = np.stack([pred, anchors.targets_n, anchors.weights_n])[:, prefixes]
            self.recent_prefixes = [*self.recent_prefixes, held][-self.config.prefix_auc_window :]
            metrics.update(self.predictor.update(anchors))
            if self.without_history is not None:
                metrics.update(held_out_metrics("predictor/no_history", self.without_history.predict(anchors), anchors))
                self.without_history.update(anchors)
        self.cost_model.update(ctx.trees)
        self.history.observe(ctx.trees)  # after training: an anchor is trained on the history it was predicted with
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

    @property
    def _prefix_ids(self) -> bool:
        return getattr(self.predictor, "needs_prefix_ids", False)

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
        anchors = training_anchors(trees, with_prefix_ids=self._prefix_ids, history=self.history)
        fitted: dict[str, float] = {}
        for _ in range(cfg.predictor_warmup_updates):
            fitted = self.predictor.update(anchors)
            if self.without_history is not None:
                self.without_history.update(anchors)
        self.cost_model.update(trees)
        self.history.observe(trees)
        return {
            "prompts": float(len(trees)),
            "rollouts": float(stats.rollouts),
            "generated_tokens": float(stats.generated_tokens),
            "effective_ratio": figures.effective_ratio(trees),
            **fitted,
        }

    # ------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Predictor (params, optimizer, statistics), prompt history, the recent held-out prefix predictions (the
        gate's), cost model and step: plain dicts / numpy arrays."""
        state = {
            "predictor": self.predictor.state_dict(),
            "history": self.history.state_dict(),
            # One [3, 1 + N] array (a padding column first: a checkpoint cannot hold an empty array) and each
            # batch's N (a 0 first).
            "recent_prefixes": np.concatenate([np.zeros((3, 1)), *self.recent_prefixes], axis=1),
            "recent_prefix_sizes": np.asarray([0] + [held.shape[1] for held in self.recent_prefixes], np.int64),
            "cost_model": self.cost_model.state_dict(),
            "step": self.step,
        }
        if self.without_history is not None:
            state["without_history"] = self.without_history.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.predictor.load_state_dict(state["predictor"])
        self.cost_model.load_state_dict(state["cost_model"])
        self.step = int(state["step"])
        if "history" in state:  # a checkpoint written before the scheduler kept prompt history holds none
            self.history.load_state_dict(state["history"])
        if "recent_prefixes" in state:
            held = np.asarray(state["recent_prefixes"], float).reshape(3, -1)[:, 1:]
            sizes = np.asarray(state["recent_prefix_sizes"], np.int64).reshape(-1)[1:]
            self.recent_prefixes = np.split(held, np.cumsum(sizes)[:-1], axis=1) if sizes.size else []
        if self.without_history is not None and "without_history" in state:
            self.without_history.load_state_dict(state["without_history"])
