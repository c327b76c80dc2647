"""The ground-truth simulator: a RolloutBackend whose trees and costs are what a real runner would give."""

import numpy as np
import pytest

from trace_jax.allocation.simulate import Simulator, SimulatorConfig
from trace_jax.rollout.backend import ContinuationRequest


def test_rollouts_are_finished_trees_with_features_and_charged_tokens():
    sim = Simulator(SimulatorConfig(num_prompts=64), seed=0)
    trees = sim.sample_batch(8)
    stats = sim.continue_anchors([ContinuationRequest(t, 0, 3) for t in trees])
    assert stats.rollouts == 24 == sum(len(t.leaves()) for t in trees)
    assert stats.generated_tokens == sum(t.num_sampled_tokens() for t in trees)
    for tree in trees:
        for node in tree:
            assert node.feature is not None and node.feature.shape == (sim.config.feature_dim,)
            assert node.depth <= sim.config.max_turns
            if node.is_leaf:
                assert node.reward in (0.0, 1.0) and node.observation_ids.size == 0
            elif node.depth > 0:
                assert node.observation_ids.size == sim.config.observation_tokens
                assert node.entropies.shape == node.token_ids.shape


def test_leaf_success_rate_matches_the_true_probability_of_the_anchor():
    # the martingale makes P(success | prefix) equal to the prefix's current p, at the root and deeper
    sim = Simulator(SimulatorConfig(num_prompts=16), seed=1)
    tree = sim.new_tree(int(np.argmin(np.abs(sim.root_p - 0.5))))
    sim.continue_anchors([ContinuationRequest(tree, 0, 1)])
    anchor = tree.anchors()[-1]
    sim.continue_anchors([ContinuationRequest(tree, 0, 1500), ContinuationRequest(tree, anchor, 1500)])
    for node_id in (0, anchor):
        below = [leaf for leaf in tree.leaves() if node_id in tree.path(leaf)]
        rate = np.mean([tree[leaf].reward for leaf in below])
        assert rate == pytest.approx(sim.true_success_probability(tree, node_id), abs=0.05)


def test_same_seed_same_world_and_leaves_cannot_be_continued():
    a, b = Simulator(seed=3), Simulator(seed=3)
    ta, tb = a.sample_batch(4), b.sample_batch(4)
    a.continue_anchors([ContinuationRequest(t, 0, 2) for t in ta])
    b.continue_anchors([ContinuationRequest(t, 0, 2) for t in tb])
    assert [t.to_dict()["nodes"][-1]["reward"] for t in ta] == [t.to_dict()["nodes"][-1]["reward"] for t in tb]
    with pytest.raises(ValueError, match="leaf"):
        a.continue_anchors([ContinuationRequest(ta[0], ta[0].leaves()[0], 1)])
    with pytest.raises(ValueError, match="stop_probability"):
        Simulator(SimulatorConfig(stop_probability=0.0))
