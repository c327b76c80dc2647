"""Prompt history across visits: features for the predictor, the GRESO baseline, the gated stage 2, and the
per-step held-out predictor figures on roots and prefixes."""

import numpy as np
import pytest

from trace_jax.allocation.anchors import gather_anchors, training_anchors
from trace_jax.allocation.calibration import calibration_metrics, weighted_auc
from trace_jax.allocation.context import AllocationContext, Budget, CostModel
from trace_jax.allocation.history import PromptHistory
from trace_jax.allocation.policies import GresoPolicy, StagedPolicy
from trace_jax.allocation.predictor import MLPPredictor
from trace_jax.allocation.scheduler import SchedulerConfig, TreeScheduler
from trace_jax.allocation.simulate import Simulator, SimulatorConfig
from trace_jax.rollout.backend import ContinuationRequest
from trace_jax.rollout.tree import ROOT

WORLD = SimulatorConfig(num_prompts=64, max_turns=3, feature_dim=8)
SMALL = {"hidden": 16, "train_steps": 8, "batch_size": 32}


def sampled(sim, indices, k=4):
    trees = [sim.new_tree(i) for i in indices]
    sim.continue_anchors([ContinuationRequest(t, ROOT, k) for t in trees])
    return trees


def context(sim, trees, rollouts, **kwargs):
    """An allocation context over ``trees`` with a small untrained predictor and a fixed rng."""
    predictor, costs = MLPPredictor(**SMALL), CostModel(prior_tokens_per_rollout=50.0)
    rng = np.random.default_rng(0)
    return AllocationContext(trees, sim, Budget(rollouts=rollouts), predictor, costs, rng, **kwargs)


def test_history_changes_the_prediction_of_a_seen_prompt_only():
    # Catches: history features given to a prompt never seen (its prediction must stay the network's), features
    # not looked up per prompt, and a predictor that ignores them.
    sim = Simulator(WORLD, 0)
    predictor = MLPPredictor(history=True, seed=0, **SMALL)
    history = PromptHistory()
    for start in (0, 8, 0, 8):  # two epochs over 16 prompts: the predictor learns from seen prompts' history
        trees = sampled(sim, range(start, start + 8))
        predictor.update(training_anchors(trees, history=history))
        history.observe(trees)
    seen, unseen = sim.new_tree(3), sim.new_tree(40)
    unseen.root.feature = seen.root.feature  # identical hidden state: only the history differs
    before = predictor.predict(gather_anchors([seen, unseen], [(0, ROOT), (1, ROOT)], history=PromptHistory()))
    after = predictor.predict(gather_anchors([seen, unseen], [(0, ROOT), (1, ROOT)], history=history))
    assert history.visits(np.asarray([3, 40])).tolist() == [2, 0]  # premise
    assert before[0] == pytest.approx(before[1])
    assert abs(after[0] - before[0]) > 1e-3
    assert after[1] == pytest.approx(before[1], abs=1e-7)


def test_the_scheduler_trains_on_the_history_an_anchor_was_predicted_with_and_checkpoints_it():
    # Catches: observing a batch before training on it (the anchor's own outcome leaks into its input), and a
    # resume that loses the history or the gate's recent held-out predictions.
    sim = Simulator(WORLD, 1)
    config = SchedulerConfig(policy="uniform", rollouts_per_prompt=4, predictor_kwargs={"history": True, **SMALL})
    sched = TreeScheduler(sim, config)
    sched.run([sim.new_tree(i) for i in range(8)])
    assert len(sched.history) == 8 and sched.history.clock == 1
    assert not sched.predictor.replay.columns["history"][:, 0].any()  # first visit: trained as unseen
    sched.run([sim.new_tree(i) for i in range(8)])
    assert sched.predictor.replay.columns["history"][-1, 0] == 1.0  # second visit: trained with its history
    restored = TreeScheduler(sim, config)
    restored.load_state_dict(sched.state_dict())
    keys = np.arange(8)
    np.testing.assert_array_equal(restored.history.features(keys), sched.history.features(keys))
    assert restored.prefix_auc == pytest.approx(sched.prefix_auc, nan_ok=True)
    assert len(restored.recent_prefixes) == 2


def test_greso_skips_a_prompt_whose_last_visit_was_all_equal():
    # Catches: a GRESO that ignores history (random candidates) or flags mixed prompts.
    sim = Simulator(WORLD, 2)
    history = PromptHistory()
    trees = sampled(sim, range(16), k=4)
    history.observe(trees)
    equal = np.asarray([not t.is_mixed() for t in trees])
    assert 4 <= equal.sum() <= 12  # premise: enough of both kinds
    ctx = context(sim, [sim.new_tree(i) for i in range(16)], 64, history=history)
    policy = GresoPolicy(explore_probability=0.0)
    kept = policy.select_prompts(ctx, int((~equal).sum()))
    assert set(kept.tolist()) == set(np.flatnonzero(~equal).tolist())
    policy.run(ctx)  # no candidates to spare: flagged prompts are down-weighted, not dropped
    counts = np.asarray([len(t.leaves()) for t in ctx.trees])
    assert counts[equal].max() < counts[~equal].min() and counts[equal].min() >= 1


def test_the_gate_switches_stage_two_to_random_anchors_below_the_threshold(monkeypatch):
    # Catches: a gate that never closes (active stage 2 whatever the AUC) or never opens.
    sim = Simulator(WORLD, 3)
    modes = []
    original = StagedPolicy.prefix_round
    monkeypatch.setattr(
        StagedPolicy,
        "prefix_round",
        lambda self, ctx, share, mode=None: (modes.append(mode), original(self, ctx, share, mode)),
    )
    policy = StagedPolicy(stage1="active", stage2="active", gate_auc=0.7, rounds=2)
    for auc, mode, is_open in ((0.5, "uniform", 0.0), (float("nan"), "uniform", 0.0), (0.8, "active", 1.0)):
        modes.clear()
        ctx = context(sim, [sim.new_tree(i) for i in range(6)], 48, prefix_auc=auc)
        policy.run(ctx)
        assert modes == [mode, mode] and ctx.notes["gate/open"] == is_open


def test_the_scheduler_logs_held_out_figures_on_roots_and_prefixes_and_feeds_the_gate():
    # Catches: figures scored after the predictor learned from the batch (not held out), roots and prefixes
    # mixed up, and a gate reading something other than the recent held-out prefix AUC.
    sim = Simulator(WORLD, 4)
    config = SchedulerConfig(policy="trace", policy_kwargs={"gate_auc": 0.99}, rollouts_per_prompt=6)
    sched = TreeScheduler(sim, config, predictor=MLPPredictor(seed=0, **SMALL))
    first = sched.run([sim.new_tree(i) for i in range(8)])
    assert first.metrics["gate/open"] == 0.0 and np.isnan(first.metrics["gate/auc"])  # nothing measured yet
    before = MLPPredictor(seed=0, **SMALL)
    before.load_state_dict(sched.predictor.state_dict())
    result = sched.run([sim.new_tree(i) for i in range(8, 16)])
    anchors = training_anchors(result.trees)
    pred = before.predict(anchors)
    for name, keep in (("root", anchors.depths_n == 0), ("prefix", anchors.depths_n > 0)):
        assert keep.any()  # premise
        expected = calibration_metrics(pred[keep], anchors.targets_n[keep], anchors.weights_n[keep])
        assert result.metrics[f"predictor/{name}/brier"] == pytest.approx(expected["brier"])
        assert result.metrics[f"predictor/{name}/auc"] == pytest.approx(expected["auc"], nan_ok=True)
    pooled = np.concatenate(sched.recent_prefixes, axis=1)
    assert sched.prefix_auc == pytest.approx(weighted_auc(*pooled), nan_ok=True)
