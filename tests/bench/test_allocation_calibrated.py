"""The allocation bench's simulator fitted to real-rollout statistics, and its simulator-vs-real table."""

import json

import pytest

from trace_jax.bench import allocation

STATS = {
    "pool": {"uniform_effective_ratio_by_group_size": {"2": 0.1, "4": 0.25}},
    "beta_binomial": {"a": 0.3, "b": 0.5},
    "turns": {"max_turns": 4, "stop_probability": 0.4, "turn_tokens_mean": 20.0, "answer_tokens_mean": 12.0},
    "prefix": {"kappa": 6.0},
    "predictor": {"auc": 0.8},
    "setup": {"samples": 4},
}


def test_calibrated_simulator_takes_the_measured_world():
    config, record = allocation.calibrated_simulator(STATS, match_auc=False)
    assert (config.difficulty_a, config.difficulty_b) == (0.3, 0.5)
    assert (config.max_turns, config.stop_probability, config.kappa_median) == (4, 0.4, 6.0)
    assert (config.turn_tokens_mean, config.answer_tokens_mean) == (20.0, 12.0)
    assert record["fitted"]["kappa_median"] == 6.0
    # No spread measured: turns barely move p, so a large finite kappa, not the default's swinging turns.
    no_spread = {**STATS, "prefix": {"kappa": float("inf")}}
    assert allocation.calibrated_simulator(no_spread, match_auc=False)[0].kappa_median == allocation.KAPPA_NO_SPREAD
    assert allocation.SimulatorConfig().kappa_median < allocation.KAPPA_NO_SPREAD
    unmeasured = {k: v for k, v in STATS.items() if k != "prefix"}
    assert allocation.calibrated_simulator(unmeasured, match_auc=False)[0].kappa_median == 4.0  # the default


def test_feature_signal_is_matched_to_the_real_auc():
    config, record = allocation.calibrated_simulator(STATS, prompts=24)
    assert config.feature_signal in allocation.FEATURE_SIGNALS
    aucs = record["simulated_auc"]
    assert abs(aucs[config.feature_signal] - 0.8) == pytest.approx(min(abs(a - 0.8) for a in aucs.values()))


def test_main_prints_simulator_vs_real(tmp_path):
    stats_file, curve_file = tmp_path / "difficulty.json", tmp_path / "curve.json"
    stats_file.write_text(json.dumps({**STATS, "predictor": {}}))  # no AUC: the feature signal stays default
    curve_file.write_text(json.dumps({"policies": {"trace": {"mean_effective_ratio": {"mean": 0.5}}}}))
    argv = ["--policy", "uniform", "--policy", "trace", "--seeds", "1", "--batch", "8", "--warmup", "1"]
    argv += ["--steps", "1", "--group-size", "4", "--no-ablation", "--no-worlds", "--no-overhead"]
    argv += ["--no-predictors", "--calibrated", str(stats_file), "--real-curve", str(curve_file)]
    result = allocation.main([*argv, "--out", str(tmp_path / "out.json")])
    rows = {row["policy"]: row for row in result["simulator_vs_real"]}
    assert rows["uniform"]["real"] == 0.25 and rows["trace"]["real"] == 0.5
    assert 0 <= rows["uniform"]["simulator"] <= 1
    assert result["simulator"]["difficulty_a"] == 0.3
    assert "| uniform |" in result["markdown"] and "real eff. ratio" in result["markdown"]
