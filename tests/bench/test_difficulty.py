"""The difficulty bench's statistics: exact group mixing, pool shape, and calibration that recovers a known world."""

import itertools
import math

import numpy as np
import pytest

from trace_jax.allocation.simulate import Simulator, SimulatorConfig
from trace_jax.allocation.solvers import root_value
from trace_jax.bench import difficulty


def test_mixed_group_probability_is_the_share_of_mixed_subsets():
    samples, group = 6, 3
    for successes in range(samples + 1):
        outcomes = [1] * successes + [0] * (samples - successes)
        subsets = list(itertools.combinations(outcomes, group))
        brute = np.mean([0 < sum(s) < group for s in subsets])
        assert difficulty.mixed_group_probability(np.asarray([successes]), samples, group)[0] == pytest.approx(brute)


def test_mixed_group_probability_is_unbiased_for_the_true_mixing_chance():
    samples, group, p = 8, 4, 0.3
    pmf = np.asarray([math.comb(samples, c) * p**c * (1 - p) ** (samples - c) for c in range(samples + 1)])
    estimates = difficulty.mixed_group_probability(np.arange(samples + 1), samples, group)
    assert float(pmf @ estimates) == pytest.approx(float(root_value(p, group)))
    # The plug-in p̂ is biased: the point of the exact form.
    plug_in = root_value(np.arange(samples + 1) / samples, group)
    assert abs(float(pmf @ plug_in) - float(root_value(p, group))) > 0.01
    with pytest.raises(ValueError, match="group size"):
        difficulty.mixed_group_probability(np.asarray([1]), 4, 5)


def test_pool_summary_counts_extreme_prompts():
    counts = np.asarray([0, 0, 16, 8, 1])  # of 16: two all-wrong, one all-right, two in between
    summary = difficulty.pool_summary(counts, 16, 8)
    assert summary["share_p_below_0.05"] == pytest.approx(0.4)
    assert summary["share_p_above_0.95"] == pytest.approx(0.2)
    assert summary["share_extreme"] == pytest.approx(0.6)
    assert sum(summary["histogram"]["share"]) == pytest.approx(1.0)
    # Extreme prompts never mix; the count-1 prompt mixes only when its success is in the group (8 of 16).
    expected = (difficulty.mixed_group_probability(np.asarray([8]), 16, 8)[0] + 0.5) / 5
    assert summary["uniform_effective_ratio"] == pytest.approx(expected)


def test_beta_binomial_fit_recovers_a_u_shaped_pool():
    rng = np.random.default_rng(0)
    p = rng.beta(0.3, 0.4, 4000)
    fit = difficulty.fit_beta_binomial(rng.binomial(16, p), 16)
    assert fit["a"] == pytest.approx(0.3, rel=0.15)
    assert fit["b"] == pytest.approx(0.4, rel=0.15)


def test_capped_stop_probability_inverts_the_capped_geometric_mean():
    q, cap = 0.3, 6
    mean = (1 - (1 - q) ** cap) / q
    assert difficulty.capped_stop_probability(mean, cap) == pytest.approx(q, abs=1e-6)
    assert difficulty.capped_stop_probability(1.0, cap) == 1.0


def test_first_turn_concentration_recovers_kappa():
    rng = np.random.default_rng(1)
    kappa, roots, children = 6.0, [], []
    for _ in range(3000):
        p0 = rng.uniform(0.2, 0.8)
        p1 = rng.beta(kappa * p0, kappa * (1 - p0), 4)
        roots.append(p0)
        children.append([(float(rng.binomial(8, q)), 8) for q in p1])
    found = difficulty.first_turn_concentration(roots, children)
    assert found["prefixes"] == 12000
    assert found["kappa"] == pytest.approx(kappa, rel=0.15)


def test_measure_trees_on_the_simulator_recovers_its_world():
    """The bench's statistics, run on a simulator whose truth is known, give that truth back."""
    config = SimulatorConfig(
        num_prompts=400, difficulty_a=0.3, difficulty_b=0.5, kappa_median=5.0, kappa_log_std=0.0, max_turns=4
    )
    sim = Simulator(config, seed=0)
    args = difficulty.parse_args(["--samples", "12", "--group-size", "4", "--prefix-prompts", "200"])
    trees = sim.sample_batch(config.num_prompts)
    result = difficulty.measure_trees(sim, trees, args, np.random.default_rng(0))
    assert set(result) >= {"pool", "by_group", "beta_binomial", "turns", "predictor", "prefix"}
    true_mixing = float(np.mean(root_value(sim.root_p, 4)))
    assert result["pool"]["uniform_effective_ratio"] == pytest.approx(true_mixing, abs=0.04)
    assert result["beta_binomial"]["mean"] == pytest.approx(0.3 / 0.8, abs=0.05)
    assert result["turns"]["max_turns"] == 4
    assert result["turns"]["stop_probability"] == pytest.approx(config.stop_probability, abs=0.05)
    assert result["prefix"]["prefixes"] > 100
    assert result["prefix"]["kappa"] == pytest.approx(5.0, rel=0.5)
    assert result["predictor"]["auc"] > 0.6  # the simulator's features carry the success signal
    # Split by depth: the roots (what stage 1 ranks) and the deeper prefixes, each scored on its own.
    assert result["predictor"]["roots"]["auc"] > 0.6 and 0.0 <= result["predictor"]["prefixes"]["brier"] <= 1.0
    assert result["predictor"]["mixed_root_auc"] > 0.55  # V_root on predicted roots finds the mixed prompts
    assert 0.0 <= result["predictor"]["mixed_root_auc_dispersion"] <= 1.0  # and the dispersion head's ranking
    # The same ranking at each prompt's first turn (selection on the first search): p moves little in one turn
    # here (kappa 5), so it finds the mixed prompts too; fails if the first turn is scored on a wrong node.
    assert result["predictor"]["mixed_first_turn_auc"] > 0.55


def test_bad_flags_are_rejected():
    with pytest.raises(SystemExit):
        difficulty.parse_args(["--samples", "4", "--group-size", "8"])


def test_reweighted_pool_mixes_measured_groups():
    stats = {
        "1-hop": difficulty.pool_summary(np.asarray([8, 8]), 16, 8),
        "trivial/0-hop": difficulty.pool_summary(np.asarray([16, 16]), 16, 8),
    }
    mixed = difficulty.reweighted_pool(stats, {"1-hop": 1.0, "trivial/0-hop": 3.0})
    assert mixed["share_extreme"] == pytest.approx(0.75)
    assert mixed["mean_success"] == pytest.approx(0.25 * 0.5 + 0.75)
    assert mixed["uniform_effective_ratio"] == pytest.approx(0.25 * stats["1-hop"]["uniform_effective_ratio"])
    with pytest.raises(ValueError, match="no measurement"):
        difficulty.reweighted_pool(stats, {"5-hop": 1.0})
