"""Stage-1 and stage-2 solvers: optimality on small instances, budgets, and the shape of their choices."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_jax.allocation import solvers

probabilities = st.floats(0.0, 1.0, allow_nan=False)


def brute_force_roots(v, budget, lo, hi):
    best = -1.0
    for counts in itertools.product(range(lo, hi + 1), repeat=len(v)):
        if sum(counts) <= budget:
            best = max(best, float(solvers.root_value(v, np.asarray(counts)).sum()))
    return best


def test_root_value_matches_the_formula_and_is_zero_without_a_pair():
    assert solvers.root_value(0.3, 0) == 0.0
    assert solvers.root_value(0.3, 1) == pytest.approx(0.0)
    assert solvers.root_value(0.3, 4) == pytest.approx(1 - 0.3**4 - 0.7**4)


@settings(max_examples=150, deadline=None)
@given(
    v=st.lists(probabilities, min_size=1, max_size=4),
    budget=st.integers(0, 9),
    lo=st.integers(0, 2),
    extra=st.integers(0, 5),
)
def test_stage1_greedy_equals_brute_force_and_respects_bounds(v, budget, lo, extra):
    v = np.asarray(v)
    hi = lo + extra
    if len(v) * lo > budget:
        with pytest.raises(ValueError, match="min_per_prompt"):
            solvers.allocate_roots(v, budget, lo, hi)
        return
    counts = solvers.allocate_roots(v, budget, lo, hi)
    assert counts.sum() <= budget
    assert np.all((counts >= lo) & (counts <= hi))
    assert solvers.root_value(v, counts).sum() == pytest.approx(brute_force_roots(v, budget, lo, hi), abs=1e-12)


@settings(max_examples=80, deadline=None)
@given(
    v=st.lists(probabilities, min_size=1, max_size=4),
    rho=st.lists(st.floats(0.0, 0.95), min_size=4, max_size=4),
    budget=st.integers(0, 9),
)
def test_stage1_greedy_is_optimal_for_expected_values_under_dispersion(v, rho, budget):
    v, rho = np.asarray(v), np.asarray(rho[: len(v)])
    counts = solvers.allocate_roots(v, budget, 0, 6, rho)
    table = solvers.root_value_table(v, rho, 6)
    best = max(
        table[np.arange(len(v)), list(c)].sum() for c in itertools.product(range(7), repeat=len(v)) if sum(c) <= budget
    )
    assert counts.sum() <= budget
    assert table[np.arange(len(v)), counts].sum() == pytest.approx(best, abs=1e-12)


def test_dispersion_moments_match_a_beta_and_shrink_the_value_of_ambiguous_prompts():
    # rho -> 1: p is 0 or 1, so a predicted 0.5 promises no mixed group; rho = 0: the plug-in formula
    moments = solvers.success_moments(np.asarray([0.3]), 0.2, 3)[0]
    a, b = 0.3 * 4, 0.7 * 4  # rho = 1 / (kappa + 1) with kappa = 4
    second = a * (a + 1) / ((a + b) * (a + b + 1))
    np.testing.assert_allclose(moments, [1, a / (a + b), second, second * (a + 2) / (a + b + 2)])
    assert solvers.root_value_table(np.asarray([0.5]), 0.0, 4)[0, 4] == pytest.approx(solvers.root_value(0.5, 4))
    assert solvers.root_value_table(np.asarray([0.5]), 0.99, 4)[0, 4] < 0.1


def test_stage1_filters_certain_prompts_and_feeds_uncertain_ones():
    counts = solvers.allocate_roots(np.asarray([0.5, 0.001, 0.999, 0.3]), budget=8)
    assert counts[0] >= counts[3] > 0
    assert counts[1] == counts[2] == 0


def test_stage1_rejects_inconsistent_bounds():
    with pytest.raises(ValueError, match="max_per_prompt"):
        solvers.allocate_roots(np.asarray([0.5]), 4, min_per_prompt=3, max_per_prompt=2)


@settings(max_examples=150, deadline=None)
@given(
    q=st.lists(probabilities, min_size=1, max_size=30),
    seed=st.integers(0, 1000),
    tokens=st.one_of(st.none(), st.floats(0, 5000)),
    rollouts=st.one_of(st.none(), st.integers(0, 40)),
    max_k=st.integers(1, 5),
)
def test_stage2_never_exceeds_either_budget(q, seed, tokens, rollouts, max_k):
    if tokens is None and rollouts is None:
        rollouts = 10
    cost = np.random.default_rng(seed).uniform(1, 800, len(q))
    counts = solvers.allocate_prefixes(np.asarray(q), cost, tokens, rollouts, max_k)
    assert np.all((counts >= 0) & (counts <= max_k))
    if tokens is not None:
        assert float((counts * cost).sum()) <= tokens + 1e-6
    if rollouts is not None:
        assert counts.sum() <= rollouts
    assert np.all(counts[np.asarray(q) >= 1.0] == 0)  # nothing for an anchor that cannot become mixed


def test_stage2_prefers_gain_per_token():
    # same repeat probability: the cheaper (deeper) anchor is worth more per token
    counts = solvers.allocate_prefixes(np.asarray([0.5, 0.5]), np.asarray([400.0, 100.0]), token_budget=300)
    assert counts.tolist() == [0, 3]
    # same cost: the anchor likelier to flip its outcome goes first
    counts = solvers.allocate_prefixes(np.asarray([0.9, 0.4]), np.asarray([100.0, 100.0]), None, 1)
    assert counts.tolist() == [0, 1]


def test_repeat_probability_reads_the_outcome_already_seen():
    # a failed rollout is worth branching where it was on track; a success where it was lucky
    q = solvers.repeat_probability(np.asarray([0.8, 0.8, 0.1]), np.asarray([0, 1, 1]))
    np.testing.assert_allclose(q, [0.2, 0.8, 0.1])


def test_fill_by_priority_goes_on_with_cheaper_items_after_one_does_not_fit():
    counts = solvers.fill_by_priority(np.asarray([[3.0], [2.0], [1.0]]), np.asarray([50.0, 80.0, 40.0]), 100.0, None)
    assert counts.tolist() == [1, 0, 1]
    with pytest.raises(ValueError, match="budget"):
        solvers.fill_by_priority(np.ones((1, 1)), np.ones(1), None, None)
