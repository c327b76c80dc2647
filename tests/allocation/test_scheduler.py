"""TreeScheduler: one call per RL step returns the batch's trees, figures, and a checkpointable state."""

import numpy as np
import pytest

from trace_jax.allocation import solvers
from trace_jax.allocation.anchors import training_anchors
from trace_jax.allocation.calibration import calibration_metrics
from trace_jax.allocation.predictor import MLPPredictor
from trace_jax.allocation.scheduler import SchedulerConfig, TreeScheduler
from trace_jax.allocation.simulate import Simulator, SimulatorConfig
from trace_jax.rollout.backend import ContinuationRequest
from trace_jax.rollout.engine.engine import EngineConfig
from trace_jax.rollout.engine.mock import MockEngine, ToyEnv, toy_policy
from trace_jax.rollout.runner import RolloutRunner, RunnerConfig
from trace_jax.rollout.tree import RolloutTree

WORLD = SimulatorConfig(num_prompts=256, max_turns=4)


def scheduler(sim, **config):
    predictor = MLPPredictor(hidden=32, train_steps=8, batch_size=64, seed=0)
    return TreeScheduler(sim, SchedulerConfig(**config), predictor=predictor)


def test_run_returns_the_batch_in_order_with_figures_and_cost():
    sim = Simulator(WORLD, 0)
    sched = scheduler(sim, policy="trace", rollouts_per_prompt=6)
    trees = sim.sample_batch(12)
    result = sched.run(trees)
    assert [t.prompt_index for t in result.trees] == [t.prompt_index for t in trees]
    assert result.stats.rollouts <= 72
    assert result.stats.generated_tokens == sum(t.num_sampled_tokens() for t in result.trees)
    for key in ("effective_ratio", "nonzero_advantage_tokens", "predictor/brier", "time/allocate_ms"):
        assert np.isfinite(result.metrics[key]), key
    assert sched.step == 1


def test_budget_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="rollouts_per_prompt"):
        scheduler(Simulator(WORLD, 0), rollouts_per_prompt=None, tokens_per_prompt=None).budget(4)


def test_state_dict_restores_predictor_and_cost_model():
    sim = Simulator(WORLD, 1)
    sched = scheduler(sim, policy="trace", tokens_per_prompt=1200, rollouts_per_prompt=None)
    for _ in range(2):
        sched.run(sim.sample_batch(8))
    restored = scheduler(sim, policy="trace")
    restored.load_state_dict(sched.state_dict())
    probe = sim.sample_batch(8)
    sim.continue_anchors([ContinuationRequest(t, 0, 2) for t in probe])
    anchors = training_anchors(probe)
    np.testing.assert_allclose(restored.predictor.predict(anchors), sched.predictor.predict(anchors), atol=1e-6)
    depths = np.arange(4)
    np.testing.assert_allclose(restored.cost_model.remaining_tokens(depths), sched.cost_model.remaining_tokens(depths))
    assert restored.step == 2
    assert not np.allclose(
        scheduler(sim).cost_model.remaining_tokens(depths), sched.cost_model.remaining_tokens(depths)
    )


@pytest.mark.parametrize("policy", ["uniform", "dynamic_sampling", "root_only", "tree_random", "tree_entropy", "trace"])
def test_every_policy_runs_on_the_rollout_runner_with_the_mock_engine(policy):
    engine = MockEngine(EngineConfig(max_slots=4, max_len=64, steps_per_call=4, max_turn_tokens=8), toy_policy)
    env = ToyEnv(max_turns=2)
    runner = RolloutRunner(engine, None, env, RunnerConfig(seed=0))
    sched = scheduler(runner, policy=policy, rollouts_per_prompt=4, prior_tokens_per_rollout=6.0)
    # Every policy, root_only and trace included (min_per_prompt 1 by default): each prompt's tree gets
    # rollouts, the budget (4 prompts × 4) is spent and every rollout is a leaf of a returned tree. Catches the
    # mutant "trace leaves a prompt without rollouts" (policies.StagedPolicy.root_stage giving the last prompt 0).
    for _ in range(2):
        trees = [RolloutTree(env.prompt_ids(t), task=t, prompt_index=t) for t in range(4)]
        result = sched.run(trees)
        leaves = [len(t.leaves()) for t in result.trees]
        assert len(result.trees) == 4 and min(leaves) > 0, leaves
        assert result.stats.rollouts == sum(leaves) == 16
        sampled = sum(t.num_sampled_tokens() for t in result.trees)
        if policy == "dynamic_sampling":  # it may also generate groups it then discards
            assert result.stats.generated_tokens >= sampled
        else:
            assert result.stats.generated_tokens == sampled


def test_scheduler_asks_a_backend_for_root_features_when_it_can():
    class FeaturizingSimulator(Simulator):
        def featurize_roots(self, trees):
            self.featurized = len(trees)
            for tree in trees:
                tree.root.feature = self._feature(tree.prompt_index, self.root_p[tree.prompt_index], 0)

    sim = FeaturizingSimulator(WORLD, 0)
    trees = sim.sample_batch(4)
    for tree in trees:
        tree.root.feature = None
    scheduler(sim, policy="trace", rollouts_per_prompt=4).run(trees)
    assert sim.featurized == 4 and all(t.root.feature is not None for t in trees)


def test_trace_selects_the_candidates_most_likely_to_be_mixed_and_spends_the_batch_budget():
    sim = Simulator(WORLD, 3)
    candidates = sim.sample_batch(32)
    sched = scheduler(sim, policy="oracle", rollouts_per_prompt=8, candidates_per_prompt=4)
    assert sched.config.candidates(8) == 32
    result = sched.run(candidates, batch_size=8)
    kept = {t.prompt_index for t in result.trees}
    assert len(result.trees) == 8 and len(kept) == 8
    assert result.stats.rollouts <= 64  # the budget of the 8 kept prompts, not of the 32 candidates
    closeness = {t.prompt_index: abs(sim.root_p[t.prompt_index] - 0.5) for t in candidates}
    dropped = sorted(closeness[i] for i in closeness if i not in kept)
    assert dropped[0] < dropped[-1]  # premise: the candidates differ
    assert max(closeness[i] for i in kept) <= min(dropped) + 1e-12


class _SpreadByPrompt:
    """A stub predictor: every anchor's mean is 0.5; the dispersion is high for the odd positions of ``trees``."""

    def __init__(self, trees):
        self.odd = {t.prompt_key: i % 2 == 1 for i, t in enumerate(trees)}

    def predict(self, anchors):
        return np.full(len(anchors), 0.5)

    def predict_dispersion(self, anchors):
        return np.asarray([0.9 if self.odd[int(k)] else 0.01 for k in anchors.prompt_keys_n])

    def update(self, anchors):
        return {}


def test_a_predicted_dispersion_steers_selection_and_stage_1_to_prompts_that_can_be_mixed():
    sim = Simulator(WORLD, 6)
    candidates = sim.sample_batch(16)
    config = SchedulerConfig(policy="trace", rollouts_per_prompt=8, candidates_per_prompt=2)
    sched = TreeScheduler(sim, config, predictor=_SpreadByPrompt(candidates))
    assert len({t.prompt_key for t in candidates}) == 16  # premise: the stub tells every candidate apart
    kept = {t.prompt_key for t in sched.run(candidates, batch_size=8).trees}
    # The means tie (the plug-in V_root would keep a random half); the spread says the even ones can be mixed.
    assert kept == {t.prompt_key for t in candidates[::2]}
    roots = solvers.allocate_roots(np.full(4, 0.5), 16, 1, 8, dispersion_b=np.asarray([0.9, 0.01, 0.9, 0.01]))
    assert roots[1] > roots[0] and roots[3] > roots[2] and roots.sum() == 16


def test_policies_without_a_predictor_keep_random_candidates_reproducibly():
    sim = Simulator(WORLD, 4)
    candidates = sim.sample_batch(24)

    def kept(seed):
        sched = scheduler(sim, policy="uniform", rollouts_per_prompt=4, seed=seed)
        fresh = [sim.new_tree(t.prompt_index) for t in candidates]
        return [t.prompt_index for t in sched.run(fresh, batch_size=6).trees]

    first = kept(0)
    position = {t.prompt_index: i for i, t in enumerate(candidates)}
    assert len(set(first)) == 6 and [position[i] for i in first] == sorted(position[i] for i in first)
    assert kept(0) == first
    assert any(kept(seed) != first for seed in (1, 2, 3))


def test_prompt_selection_refuses_bad_sizes():
    with pytest.raises(ValueError, match="candidates_per_prompt"):
        SchedulerConfig(candidates_per_prompt=0.5)
    sim = Simulator(WORLD, 0)
    with pytest.raises(ValueError, match="batch_size"):
        scheduler(sim).run(sim.sample_batch(4), batch_size=5)


def test_predictor_warm_up_trains_the_predictor_before_the_first_batch():
    sim = Simulator(WORLD, 5)
    sched = scheduler(sim, policy="trace", predictor_warmup_prompts=48, predictor_warmup_rollouts=4)
    probe = sim.sample_batch(64)
    sim.continue_anchors([ContinuationRequest(t, 0, 4) for t in probe])
    held_out = training_anchors(probe)

    def auc():
        return calibration_metrics(sched.predictor.predict(held_out), held_out.targets_n, held_out.weights_n)["auc"]

    before = auc()  # an untrained network's ranking
    metrics = sched.warm_up(sim.sample_batch(48))
    assert metrics["prompts"] == 48 and metrics["rollouts"] == 48 * 4 and metrics["generated_tokens"] > 0
    assert 0.0 < metrics["effective_ratio"] < 1.0 and np.isfinite(metrics["predictor/loss"])
    assert auc() > max(0.65, before + 0.1)
    assert sched.step == 0  # the warm-up is not an RL step


def test_predictor_warm_up_refuses_groups_that_cannot_be_mixed():
    sim = Simulator(WORLD, 0)
    with pytest.raises(ValueError, match="predictor_warmup_rollouts >= 2"):
        scheduler(sim, predictor_warmup_rollouts=1).warm_up(sim.sample_batch(4))
