"""Selection on the first search (``allocation.select_on``): probes of one turn, scored at depth 1, reused.

The scheduler runs on the rollout runner with the mock engine and the toy env, so every probe is known by hand:
the i-th continuation the runner starts has seed i, and its first move is GOOD exactly when i is odd.
"""

import numpy as np
import pytest

from trace_jax.allocation.context import AllocationContext, Budget, CostModel
from trace_jax.allocation.scheduler import SchedulerConfig, TreeScheduler
from trace_jax.allocation.selection import selection_metrics
from trace_jax.allocation.simulate import Simulator, SimulatorConfig
from trace_jax.rollout.backend import ContinuationRequest
from trace_jax.rollout.engine.engine import EngineConfig
from trace_jax.rollout.engine.mock import EOS, FILLER, GOOD, OBS, MockEngine, ToyEnv, mock_hidden, toy_policy
from trace_jax.rollout.runner import RolloutRunner, RunnerConfig
from trace_jax.rollout.tree import ROOT, RolloutTree

CANDIDATES, BATCH = 8, 4
GOOD_PROBES = {1, 3, 5, 7}  # candidate i is probed with seed i: move bit 0 set


class ProbeReader:
    """A stub predictor that can tell nothing useful at the root and everything after the first turn: roots of
    even tasks look promising (0.5, the rest 0.02); a depth-1 prefix is 0.5 when its move was GOOD, else 0.02."""

    needs_prefix_ids = True

    def predict(self, anchors):
        out = np.full(len(anchors), 0.5)
        for a, (depth, key) in enumerate(zip(anchors.depths_n, anchors.prompt_keys_n, strict=True)):
            if depth == 0:
                out[a] = 0.5 if key % 2 == 0 else 0.02
            elif depth == 1:
                first_move = anchors.prefix_ids[a][-5]  # [..., move, STOP_A, STOP_B, OBS, FILLER + 1]
                out[a] = 0.5 if first_move == GOOD else 0.02
        return out

    def update(self, anchors):
        return {}


def _runner(policy=toy_policy, max_turns=2, reuse_prefixes=True):
    engine = MockEngine(EngineConfig(max_slots=4, max_len=64, steps_per_call=4, max_turn_tokens=8), policy)
    config = RunnerConfig(seed=0, eos_ids=(EOS,), reuse_prefixes=reuse_prefixes)
    return RolloutRunner(engine, None, ToyEnv(max_turns=max_turns), config)


def _candidates(runner, count=CANDIDATES):
    return [RolloutTree(runner.env.prompt_ids(t), task=t, prompt_index=t) for t in range(count)]


def _schedule(runner, predictor, select_on, policy="trace", candidates=CANDIDATES, batch=BATCH, **config):
    config = SchedulerConfig(
        policy=policy, select_on=select_on, rollouts_per_prompt=4, prior_tokens_per_rollout=6.0, **config
    )
    return TreeScheduler(runner, config, predictor=predictor).run(_candidates(runner, candidates), batch_size=batch)


def test_a_probe_stops_after_its_first_turn_and_its_continuation_reuses_the_held_prefix():
    """Fails if the runner ignores ``max_turns`` (the probe runs to a leaf and counts as a rollout), if a stopped
    probe's observation is not appended (no anchor feature), or if its pages are not held (the continuation
    re-prefills the whole history)."""
    forward = {}
    for reuse in (True, False):
        runner = _runner(reuse_prefixes=reuse)
        tree = _candidates(runner, 1)[0]
        stats = runner.continue_anchors([ContinuationRequest(tree, ROOT, 2, max_turns=1)])
        probes = tree.root.children
        assert stats.rollouts == 0 and stats.generated_tokens == 6 and len(probes) == 2  # 2 × [move, STOP_A, STOP_B]
        for probe in probes:
            node = tree[probe]
            assert node.depth == 1 and not node.is_leaf and not node.children
            assert node.observation_ids.tolist() == [OBS, FILLER + 1]
            np.testing.assert_array_equal(node.feature, mock_hidden(tree.prefix_ids(probe)))
        history = len(tree.prefix_ids(probes[0]))
        stats = runner.continue_anchors([ContinuationRequest(tree, probes[0], 1)])
        assert stats.rollouts == 1 and len(tree.leaves()) == 1 and stats.generated_tokens == 3
        forward[reuse] = stats.forward_tokens - stats.generated_tokens  # the history's share
    assert forward == {True: 1, False: history}  # held: only the last id is computed again


def test_the_simulator_stops_a_probe_after_its_first_turn():
    """Fails if the simulator ignores ``max_turns`` (a probe that did not end counts as a rollout)."""
    sim = Simulator(SimulatorConfig(num_prompts=64, max_turns=4), 0)
    trees = sim.sample_batch(32)
    stats = sim.continue_anchors([ContinuationRequest(t, ROOT, 1, max_turns=1) for t in trees])
    depths = {node.depth for t in trees for node in t.nodes[1:]}
    ended = sum(len(t.leaves()) for t in trees)
    assert depths == {1} and 0 < ended < 32  # premise: some first turns answer, most do not
    assert stats.rollouts == ended


def test_selection_on_the_first_search_keeps_the_prompts_its_depth_1_prefixes_favour():
    """Fails if selection scores the roots instead of the probes (it would keep the even tasks), if stage 1
    starts a kept prompt afresh instead of continuing its probe (the probe stays without children), or if the
    dropped probes' tokens are not charged to the step (generated tokens would equal the kept trees')."""
    on_roots = _schedule(_runner(), ProbeReader(), "root")
    assert {t.prompt_index for t in on_roots.trees} == {0, 2, 4, 6}  # premise: the roots point the other way

    result = _schedule(_runner(), ProbeReader(), "first_search")
    metrics = result.metrics
    assert {t.prompt_index for t in result.trees} == GOOD_PROBES
    assert metrics["select/probes"] == CANDIDATES and metrics["select/probe_tokens"] == 3 * CANDIDATES
    for tree in result.trees:
        probe = tree.root.children[0]  # the probe is the root's first child, continued by stage 1
        assert tree[probe].depth == 1 and tree[probe].children and tree.leaf_counts()[probe] >= 1
    kept_tokens = sum(t.num_sampled_tokens() for t in result.trees)
    assert metrics["select/dropped_tokens"] == 3 * (CANDIDATES - BATCH)
    assert result.stats.generated_tokens == kept_tokens + metrics["select/dropped_tokens"]
    assert metrics["budget/generated_tokens"] == result.stats.generated_tokens
    assert result.stats.rollouts <= 4 * BATCH
    for figures in (metrics, on_roots.metrics):  # kept prompts' scores against their groups' mixed-ness
        assert np.isnan(figures["select/mixed_auc"]) or 0.0 <= figures["select/mixed_auc"] <= 1.0


def test_stage_1_splits_the_budget_on_the_probes_too():
    """Without selection (one candidate a prompt), the probes still steer stage 1: root_only gives the prompts
    whose first move was GOOD more rollouts. Fails if stage 1 scores the roots (which favour the other half)."""
    result = _schedule(_runner(), ProbeReader(), "first_search", policy="root_only", candidates=BATCH)
    leaves = {t.prompt_index: len(t.leaves()) for t in result.trees}
    assert sorted(leaves) == [0, 1, 2, 3] and sum(leaves.values()) == 4 * BATCH
    assert min(leaves[1], leaves[3]) > max(leaves[0], leaves[2]), leaves
    assert result.metrics["select/dropped_tokens"] == 0  # nothing dropped: every probe is part of a rollout


def test_a_probe_that_already_answered_is_scored_by_its_reward_and_not_continued():
    """Candidates 0 and 4 end their first turn with EOS (reward 0): their ``V_root`` is 0, so they are dropped,
    although the stub predictor rates a featureless depth-1 node (such a leaf) above the others. Fails if an
    ended probe is scored by the predictor (0 and 4 would be kept) or if stage 1 tries to continue it (the
    runner refuses a leaf: seen when every candidate is kept)."""

    def eos_for_seeds_0_and_4(history, turn, seed):
        return EOS if seed % 4 == 0 and not turn else toy_policy(history, turn, seed)

    class FavoursLeaves:
        needs_prefix_ids = False

        def predict(self, anchors):
            return np.where((anchors.depths_n == 1) & ~anchors.has_feature_n, 0.5, 0.1)

        def update(self, anchors):
            return {}

    result = _schedule(_runner(eos_for_seeds_0_and_4), FavoursLeaves(), "first_search")
    assert not {0, 4} & {t.prompt_index for t in result.trees}
    assert result.metrics["select/dropped_tokens"] > 0

    every = _schedule(_runner(eos_for_seeds_0_and_4), FavoursLeaves(), "first_search", "root_only", BATCH)
    answered = every.trees[0]
    assert answered.prompt_index == 0 and answered[answered.root.children[0]].is_leaf  # premise: kept, ended
    assert every.stats.rollouts == sum(len(t.leaves()) for t in every.trees) == 4 * BATCH  # the probe counts


def test_selection_counts_kept_and_dropped_candidates_by_kind():
    """Fails if a kind is counted on the wrong side, or a kind seen on one side only lacks the other key."""
    trees = [RolloutTree([1], task={"kind": kind}, prompt_index=i) for i, kind in enumerate("abba")]
    ctx = AllocationContext(trees, None, Budget(rollouts=4), None, CostModel(), np.random.default_rng(0))
    metrics = selection_metrics(ctx, ctx.keep([1, 2]))
    expected = {"select/kept/a": 0.0, "select/dropped/a": 2.0, "select/kept/b": 2.0, "select/dropped/b": 0.0}
    assert {k: v for k, v in metrics.items() if k.count("/") == 2} == expected
    assert metrics["select/dropped_tokens"] == 0.0  # scored at the roots: no probe to drop


def test_config_refuses_an_unknown_place_and_a_policy_that_would_not_read_the_scores():
    """Fails if ``select_on`` accepts any string, a policy that keeps random candidates (whose probes would be
    paid for nothing), or a rollout budget that the probes alone could exhaust."""
    with pytest.raises(ValueError, match=r"unknown allocation\.select_on 'bogus'; choose one of first_search, root"):
        SchedulerConfig(select_on="bogus")
    with pytest.raises(ValueError, match="policy 'uniform' would not read the scores"):
        SchedulerConfig(policy="uniform", select_on="first_search")
    too_few = r"rollouts_per_prompt \(2\.0\) must be at least candidates_per_prompt \(3\.0\)"
    with pytest.raises(ValueError, match=too_few):
        SchedulerConfig(select_on="first_search", rollouts_per_prompt=2.0, candidates_per_prompt=3.0)
    assert SchedulerConfig(policy="root_only", select_on="first_search").select_on == "first_search"
