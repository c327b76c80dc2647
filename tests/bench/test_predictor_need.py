"""How good must the predictor be: the blurred oracle, the mixed-prompt AUC it gives, and the AUC a ratio needs."""

import json

import numpy as np
import pytest

from trace_jax.allocation.simulate import BlurredOracle, Simulator, SimulatorConfig
from trace_jax.bench import predictor_need
from trace_jax.rollout.backend import ContinuationRequest

WORLD = SimulatorConfig(num_prompts=256, difficulty_a=0.4, difficulty_b=0.4, max_turns=3)


def _blurred(noise: float) -> tuple[BlurredOracle, list]:
    """A blurred oracle over 64 prompts with 2 rollouts each, and every (tree, node) of them."""
    oracle = BlurredOracle(Simulator(WORLD, seed=3), noise, seed=3)
    trees = oracle.sample_batch(64)
    oracle.continue_anchors([ContinuationRequest(t, 0, 2) for t in trees])
    return oracle, [(t, n) for t in trees for n in range(len(t))]


def _seen(oracle, items) -> np.ndarray:
    return np.asarray([oracle.true_success_probability(t, n) for t, n in items])


def test_the_blurred_oracle_is_the_oracle_without_noise_and_a_fixed_estimate_per_node_with_it():
    exact, items = _blurred(0.0)
    np.testing.assert_array_equal(_seen(exact, items), _seen(exact.simulator, items))
    oracle, items = _blurred(2.0)
    first, again, truth = _seen(oracle, items), _seen(oracle, items), _seen(oracle.simulator, items)
    assert np.abs(first - truth).mean() > 0.05  # premise: the noise moves the estimates
    np.testing.assert_array_equal(first, again)  # mutant caught: a fresh draw on every call
    # Still an estimate of the truth: it ranks nodes with it, less well than the truth itself.
    assert 0.5 < np.corrcoef(first, truth)[0, 1] < 0.99
    assert oracle.sample_batch is not None and oracle.config is oracle.simulator.config  # the rest is the simulator's
    with pytest.raises(ValueError, match="noise"):
        BlurredOracle(Simulator(WORLD, seed=0), -1.0)


def test_more_noise_ranks_the_mixed_prompts_worse():
    aucs = [predictor_need.mixed_auc(WORLD, noise, 256, 8, 8, seed=1) for noise in (0.0, 2.0, 20.0)]
    assert aucs[0] > 0.8  # the oracle finds them (the labels are sampled, so not 1)
    assert aucs[0] > aucs[1] > aucs[2]
    assert aucs[2] == pytest.approx(0.5, abs=0.1)  # noise swamps the truth: a coin


def test_needed_auc_interpolates_where_the_ratio_crosses_the_target():
    rows = [
        {"mixed_auc": 0.95, "ratio": 2.4},
        {"mixed_auc": 0.6, "ratio": 1.1},
        {"mixed_auc": 0.8, "ratio": 1.6},
    ]
    # between 0.8 (1.6x) and 0.95 (2.4x): a quarter of the way
    assert predictor_need.needed_auc(rows, 1.8) == {"mixed_auc": pytest.approx(0.8375), "bracketed": True}
    assert predictor_need.needed_auc(rows, 1.1) == {"mixed_auc": 0.6, "bracketed": False}  # every row reaches it
    assert predictor_need.needed_auc(rows, 3.0) == {"mixed_auc": None, "bracketed": False}


def test_main_writes_the_table_and_selection_needs_less_noise_to_pay(tmp_path):
    out = tmp_path / "need.json"
    argv = ["--noise", "0,30", "--candidates", "1,4", "--seeds", "2", "--steps", "2", "--batch", "8"]
    results = predictor_need.main([*argv, "--auc-prompts", "128", "--samples", "8", "--out", str(out)])
    assert json.loads(out.read_text())["candidates"].keys() == {"1.0", "4.0"}
    select4 = {row["noise"]: row for row in results["candidates"]["4.0"]["rows"]}
    # The oracle keeping 1 of 4 candidates mixes far more groups than uniform; a blind estimate does not.
    assert select4[0.0]["ratio"] > 1.5
    assert select4[30.0]["ratio"] < select4[0.0]["ratio"] - 0.3
    assert results["mixed_auc"]["0.0"] > results["mixed_auc"]["30.0"]
    assert "AUC for 1.8x" in results["markdown"]
