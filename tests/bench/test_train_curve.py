"""The train-curve bench's bookkeeping on fake run logs: curves, equal-token comparison, table, plots, CLI."""

import json

import numpy as np
import pytest

from trace_jax.bench import train_curve
from trace_jax.configs import schema
from trace_jax.job.metrics import MetricWriter, read_jsonl


def fake_records(tokens_per_step, em_by_step, eff=0.5, step_seconds=1.0, signal=0.4):
    """metrics.jsonl records the way ``trace_jax.job.train.train`` writes them (final eval on a separate line)."""
    records = []
    last = len(tokens_per_step)
    for step, tokens in enumerate(tokens_per_step, start=1):
        record = {
            "step": step,
            "alloc/effective_ratio": eff,
            "alloc/budget/generated_tokens": float(tokens),
            "alloc/budget/rollouts": 10.0,
            "rollout/mean_reward": 0.4,
            "time/step_s": step_seconds,
            "alloc/predictor/auc": 0.75,
            "alloc/nonzero_adv_token_share": signal,
        }
        if step in em_by_step and step != last:
            record["eval/em"] = em_by_step[step]
        records.append(record)
    records.append({"step": last, "eval/em": em_by_step[last]})
    return records


def test_run_curve_reads_evals_tokens_and_sft_point(tmp_path):
    with MetricWriter(tmp_path, tensorboard=False) as writer:  # round trip through the real log format
        for record in fake_records([100, 200, 300, 400], {2: 0.5, 4: 0.6}):
            writer.write(record["step"], {k: v for k, v in record.items() if k != "step"})
    curve = train_curve.run_curve("trace", 0, read_jsonl(tmp_path / "metrics.jsonl"), sft_em=0.4)
    np.testing.assert_array_equal(curve.eval_steps, [0, 2, 4])
    np.testing.assert_allclose(curve.eval_em, [0.4, 0.5, 0.6])
    np.testing.assert_allclose(curve.cumulative_tokens_at(curve.eval_steps), [0, 300, 1000])
    # Halfway (in tokens) between the step-2 and step-4 evaluations.
    np.testing.assert_allclose(curve.em_at_tokens(np.asarray(650.0)), 0.55)


def test_run_without_rl_steps_is_a_clear_error():
    with pytest.raises(ValueError, match="no RL step"):
        train_curve.run_curve("trace", 0, [{"step": 0, "eval/em": 0.3}], sft_em=0.3)


def fake_runs():
    """trace reaches EM 0.6 on 1000 tokens; uniform spends 2000 tokens to reach 0.6 (0.5 at 1000)."""
    runs = []
    for seed, jitter in enumerate([-0.02, 0.0, 0.02]):
        trace = fake_records([250] * 4, {2: 0.5 + jitter, 4: 0.6 + jitter})
        uniform = fake_records([500] * 4, {2: 0.5 + jitter, 4: 0.6 + jitter})
        runs.append(train_curve.run_curve("trace", seed, trace, sft_em=0.4 + jitter, seconds=10.0))
        runs.append(train_curve.run_curve("uniform", seed, uniform, sft_em=0.4 + jitter, seconds=12.0))
    return runs


def test_aggregate_compares_at_equal_generated_tokens():
    result = train_curve.aggregate(fake_runs())
    assert result["equal_tokens"] == 1000.0  # the smallest total any run spent
    trace, uniform = result["policies"]["trace"], result["policies"]["uniform"]
    # Same EM per step, but trace got there on half the tokens: ahead at equal cost, tied at equal steps.
    assert trace["em_final"]["mean"] == pytest.approx(uniform["em_final"]["mean"])
    assert trace["em_at_equal_tokens"]["mean"] == pytest.approx(0.6)
    assert uniform["em_at_equal_tokens"]["mean"] == pytest.approx(0.5)
    assert trace["em_gain"]["mean"] == pytest.approx(0.2)
    assert trace["em_final"]["std"] == pytest.approx(np.std([0.58, 0.6, 0.62]))
    assert uniform["generated_tokens"]["mean"] == 2000.0
    assert trace["predictor_auc"]["mean"] == pytest.approx(0.75)
    em_steps = result["curves"]["trace"]["em_vs_step"]
    assert em_steps["x"] == [0.0, 2.0, 4.0]
    assert result["curves"]["uniform"]["em_vs_tokens"]["x"][-1] == 1000.0
    assert [row["policy"] for row in result["table"]] == ["trace", "uniform"]
    assert "EM @ equal tokens" in result["markdown"].splitlines()[0]
    assert "0.600 ± 0.016" in result["markdown"]


def test_plots_are_written(tmp_path):
    runs = fake_runs()
    result = train_curve.aggregate(runs)
    paths = train_curve.plot(runs, result["equal_tokens"], tmp_path, result["equal_seconds"])
    assert {p.rsplit("/", 1)[1] for p in paths} == {
        "em_vs_tokens.png",
        "em_vs_step.png",
        "effective_ratio.png",
        "effective_ratio_vs_tokens.png",
        "em_vs_seconds.png",
    }
    for path in paths:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_quick_flag_and_budget_overrides_reach_the_run_config():
    args = train_curve.parse_args(["--quick", "--seeds", "3,4", "--policies", "uniform", "--tokens-per-prompt", "200"])
    assert (args.seeds, args.steps, args.eval_every) == ([3], 2, 1)
    config = train_curve.run_config("uniform", 3, args)
    assert config.allocation.policy == "uniform"
    assert config.allocation.tokens_per_prompt == 200.0
    assert (config.seed, config.allocation.seed, config.rl.steps, config.rl.prompts_per_step) == (3, 3, 2, 4)
    json.dumps(config.to_dict())  # the run config is what train() writes to config.json


def test_bad_budget_flags_are_rejected():
    with pytest.raises(SystemExit):
        train_curve.parse_args(["--tokens-per-prompt", "0"])


def test_report_only_aggregates_finished_run_dirs(tmp_path, capsys):
    for policy, tokens in [("trace", 250), ("uniform", 500)]:
        rundir = tmp_path / f"{policy}_s0"
        with MetricWriter(rundir, tensorboard=False) as writer:
            for record in fake_records([tokens] * 4, {2: 0.5, 4: 0.6}):
                writer.write(record["step"], {k: v for k, v in record.items() if k != "step"})
        (rundir / "eval_before.json").write_text(json.dumps({"step": 0, "rows": [{"group": "all", "em": 0.4}]}))
        (rundir / "summary.json").write_text(json.dumps({"total_seconds": 5.0}))
    out = tmp_path / "result.json"
    argv = ["--report-only", "--seeds", "0", "--workdir", str(tmp_path), "--out", str(out), "--compile-cache", "none"]
    result = train_curve.main(argv)
    assert json.loads(out.read_text())["equal_tokens"] == result["equal_tokens"] == 1000.0
    assert result["policies"]["uniform"]["em_at_equal_tokens"]["mean"] == pytest.approx(0.5)
    assert "| trace" in capsys.readouterr().out  # the Markdown table is printed
    with pytest.raises(FileNotFoundError, match=r"no summary\.json"):
        train_curve.main([*argv[:2], "1", *argv[3:]])  # seed 1 never ran


def test_em_at_equal_time_reads_the_step_wall_clock():
    # trace: 2 s a step; uniform: 1 s a step; both reach 0.6 at step 4.
    trace = train_curve.run_curve("trace", 0, fake_records([250] * 4, {2: 0.5, 4: 0.6}, step_seconds=2.0), 0.4)
    uniform = train_curve.run_curve("uniform", 0, fake_records([250] * 4, {2: 0.5, 4: 0.6}), 0.4)
    result = train_curve.aggregate([trace, uniform])
    assert result["equal_seconds"] == 4.0  # uniform's whole run
    assert result["policies"]["uniform"]["em_at_equal_time"]["mean"] == pytest.approx(0.6)
    assert result["policies"]["trace"]["em_at_equal_time"]["mean"] == pytest.approx(0.5)  # trace is at step 2


def test_em_final_pairs_the_last_evaluations_whatever_tokens_the_steps_took():
    # uniform: 500 tokens a step; dynamic_sampling: 250 (it reaches uniform's last step's tokens only at step 4 of
    # 4, uniform at step 2 of 4). At equal tokens (1,000) uniform reads its step-2 EM, at equal updates its last.
    runs = []
    for seed, gain in enumerate([0.0, 0.02]):
        uniform = fake_records([500] * 4, {2: 0.5, 4: 0.6 + gain}, eff=0.5)
        dynamic = fake_records([250] * 4, {2: 0.45, 4: 0.55}, eff=0.6)
        runs.append(train_curve.run_curve("uniform", seed, uniform, sft_em=0.4))
        runs.append(train_curve.run_curve("dynamic_sampling", seed, dynamic, sft_em=0.4))
    result = train_curve.aggregate(runs)
    rows = result["paired"]["policies"]["dynamic_sampling"]
    assert result["equal_tokens"] == 1000.0  # premise: dynamic sampling's whole run, half of uniform's
    assert rows["em_at_equal_tokens"]["mean"] == pytest.approx(0.05)  # 0.55 against uniform's step-2 0.5
    assert rows["em_final"]["mean"] == pytest.approx(-0.06)  # 0.55 against 0.6 and 0.62
    assert (rows["em_final"]["n"], rows["em_final"]["wins"]) == (2, 0)
    assert "| EM final (equal updates) |" in result["markdown"]


def test_paired_differences_against_uniform_with_standard_errors():
    runs = []
    for seed, gain in enumerate([0.02, 0.04, 0.0]):
        runs.append(train_curve.run_curve("uniform", seed, fake_records([500] * 2, {2: 0.5}), sft_em=0.4))
        trace = fake_records([500] * 2, {2: 0.5 + gain}, eff=0.7, signal=0.4 + gain)
        runs.append(train_curve.run_curve("trace", seed, trace, sft_em=0.4))
    result = train_curve.aggregate(runs)
    paired = result["paired"]
    assert paired["baseline"] == "uniform"
    em = paired["policies"]["trace"]["em_at_equal_tokens"]
    assert em["mean"] == pytest.approx(0.02)
    assert em["se"] == pytest.approx(np.std([0.02, 0.04, 0.0], ddof=1) / np.sqrt(3))
    assert (em["n"], em["wins"]) == (3, 2)
    assert paired["policies"]["trace"]["mean_effective_ratio"]["mean"] == pytest.approx(0.2)
    signal = paired["policies"]["trace"]["mean_signal_token_share"]  # the share of tokens that carry signal
    assert (signal["mean"], signal["wins"]) == (pytest.approx(0.02), 2)
    assert result["policies"]["trace"]["mean_signal_token_share"]["mean"] == pytest.approx(0.42)
    assert "trace | +0.0200 ± 0.0115 (2/3)" in result["markdown"]


def test_every_policy_is_paired_against_uniform_and_dynamic_sampling_with_the_ratio_of_effective_ratios():
    """Fails if a baseline that ran is left out, if the table's "× uniform's" is a difference or the wrong way up,
    or if a baseline that did not run is asked for silently."""
    runs = []
    for seed in range(2):
        for policy, eff in (("uniform", 0.3), ("dynamic_sampling", 0.4), ("trace", 0.6)):
            records = fake_records([500] * 2, {2: 0.5}, eff=eff + 0.1 * seed)
            runs.append(train_curve.run_curve(policy, seed, records, sft_em=0.4))
    result = train_curve.aggregate(runs)
    by_baseline = result["paired_by_baseline"]
    assert list(by_baseline) == ["uniform", "dynamic_sampling"]
    assert by_baseline["uniform"] == result["paired"]  # the default baseline's table, unchanged
    trace_vs = {name: table["policies"]["trace"] for name, table in by_baseline.items()}
    assert trace_vs["uniform"]["effective_ratio_times"] == pytest.approx(0.65 / 0.35)  # means over the seeds
    assert trace_vs["dynamic_sampling"]["effective_ratio_times"] == pytest.approx(0.65 / 0.45)
    assert trace_vs["dynamic_sampling"]["mean_effective_ratio"]["mean"] == pytest.approx(0.2)
    assert "| trace | " in result["markdown"] and "| 1.86× |" in result["markdown"]
    assert "policy − dynamic_sampling (paired by seed)" in result["markdown"]
    with pytest.raises(ValueError, match="did not run"):
        train_curve.paired_differences(runs, 1000.0, 2.0, baseline="greso")


def test_held_out_em_change_per_group_is_the_last_evaluation_minus_the_sft_policys(tmp_path):
    """Per question group, from a run directory: the SFT rows of ``eval_before.json`` and the *last* evaluation's
    ``eval/em/<group>`` (fails if an earlier evaluation is read, or the overall row counted as a group)."""
    rundir = tmp_path / "uniform_s0"
    with MetricWriter(rundir, tensorboard=False) as writer:
        for record in fake_records([500] * 4, {2: 0.5, 4: 0.45}):
            groups = {4: {"1-hop": 0.75, "2-hop": 0.1}, 2: {"1-hop": 0.0, "2-hop": 0.9}}.get(record["step"], {})
            if "eval/em" in record:
                record.update({f"eval/em/{group}": em for group, em in groups.items()})
            writer.write(record["step"], {k: v for k, v in record.items() if k != "step"})
    rows = [{"group": "1-hop", "n": 4, "em": 0.5}, {"group": "2-hop", "n": 10, "em": 0.3}, {"group": "all", "em": 0.4}]
    (rundir / "eval_before.json").write_text(json.dumps({"step": 0, "rows": rows}))
    (rundir / "summary.json").write_text(json.dumps({"total_seconds": 5.0}))
    run = train_curve.load_run("uniform", 0, rundir)
    assert run.group_em_change() == pytest.approx({"1-hop": 0.25, "2-hop": -0.2})
    result = train_curve.aggregate([run])
    change = result["policies"]["uniform"]["group_em_change"]
    assert (change["1-hop"]["mean"], change["2-hop"]["questions"]) == (pytest.approx(0.25), 10)
    assert "| uniform | +0.250 | -0.200 |" in result["markdown"] and "1-hop (4 q.)" in result["markdown"]


def test_config_file_selects_the_world():
    args = train_curve.parse_args(["--quick", "--config-file", str(train_curve.CONFIG_DIR / "realistic.py")])
    config = train_curve.run_config("trace", 0, args)
    assert config.world.buried_questions > 0 and config.allocation.policy == "trace"
    with pytest.raises(SystemExit):
        train_curve.parse_args(["--config-file", "configs/nope.py"])


def test_stage_ablation_arms_run_trace_with_one_stage_swapped():
    from trace_jax.allocation.policies import StagedPolicy, make_policy

    args = train_curve.parse_args(["--quick", "--config-file", str(train_curve.CONFIG_DIR / "realistic.py")])
    built = {}
    for arm in ("active1_uniform2", "uniform1_active2", "trace"):
        scheduler = train_curve.run_config(arm, 0, args).allocation
        policy = make_policy(scheduler.policy, **scheduler.policy_kwargs)
        assert isinstance(policy, StagedPolicy)
        built[arm] = (policy.stage1, policy.stage2)
    assert built == {
        "active1_uniform2": ("active", "uniform"),
        "uniform1_active2": ("uniform", "active"),
        "trace": ("active", "active"),
    }


def test_prompt_selection_arms_draw_three_candidates_per_trained_prompt():
    args = train_curve.parse_args(["--quick", "--config-file", str(train_curve.CONFIG_DIR / "realistic.py")])
    drawn = {}
    for arm in ("trace_select3", "root_only_select3", "active1_uniform2_select3", "trace"):
        config = train_curve.run_config(arm, 0, args)
        scheduler = config.allocation
        drawn[arm] = (scheduler.policy, schema.prompts_drawn_per_step(config) / config.rl.prompts_per_step)
    assert drawn == {
        "trace_select3": ("trace", 3.0),
        "root_only_select3": ("root_only", 3.0),
        "active1_uniform2_select3": ("trace", 3.0),
        "trace": ("trace", 1.0),
    }


def test_a_predictor_warm_up_is_charged_on_both_cost_axes():
    records = [{"step": 0, "alloc/warmup/generated_tokens": 500.0, "time/warmup_s": 3.0}]
    records += fake_records([250] * 4, {2: 0.5, 4: 0.6}, step_seconds=2.0)
    warm = train_curve.run_curve("trace_warm", 0, records, sft_em=0.4)
    cold = train_curve.run_curve("trace", 0, fake_records([250] * 4, {2: 0.5, 4: 0.6}, step_seconds=2.0), 0.4)
    assert (warm.warmup_tokens, warm.warmup_seconds, cold.warmup_tokens) == (500.0, 3.0, 0.0)
    np.testing.assert_allclose(warm.cumulative_tokens_at(warm.eval_steps), [500, 1000, 1500])
    np.testing.assert_allclose(warm.cumulative_seconds_at(warm.eval_steps), [3, 7, 11])
    assert warm.total_tokens == 1500.0 and cold.total_tokens == 1000.0
    result = train_curve.aggregate([warm, cold])
    assert result["equal_tokens"] == 1000.0
    # At 1,000 tokens the cold run has its final EM; the warm one is only at its step-2 evaluation.
    assert result["policies"]["trace"]["em_at_equal_tokens"]["mean"] == pytest.approx(0.6)
    assert result["policies"]["trace_warm"]["em_at_equal_tokens"]["mean"] == pytest.approx(0.5)


def test_the_dispersion_arm_gives_the_scheduler_a_predictor_with_a_dispersion_head():
    from trace_jax.allocation.predictor import make_predictor

    args = train_curve.parse_args(["--quick", "--config-file", str(train_curve.CONFIG_DIR / "realistic.py")])
    predictors = {}
    for arm in ("trace_select3_warm_dispersion", "trace_select3_warm"):
        allocation = train_curve.run_config(arm, 0, args).allocation
        assert (allocation.candidates_per_prompt, allocation.predictor_warmup_prompts) == (3.0, 96)
        predictors[arm] = make_predictor(allocation.predictor, **allocation.predictor_kwargs)
    assert predictors["trace_select3_warm_dispersion"].dispersion
    assert not predictors["trace_select3_warm"].dispersion


def test_epochs_over_a_pool_set_each_policys_steps():
    # Catches: --epochs ignored (steps stay --steps) and steps not derived from each policy's draws a step.
    args = train_curve.parse_args(
        ["--config-file", str(train_curve.CONFIG_DIR / "realistic.py"), "--pool-size", "32", "--epochs", "3"]
    )
    for policy, steps in (("uniform", 12), ("greso_select2", 6)):  # 8 prompts (16 drawn for select2) a step
        config = train_curve.run_config(policy, 0, args)
        assert (config.rl.pool_size, config.rl.steps) == (32, steps)
        assert schema.derived(config)["rl.epochs"] == 3.0


def test_per_epoch_figures_average_each_epochs_steps():
    # Catches: epochs cut at the wrong step, and the history-free predictor's AUC not carried per epoch.
    records = fake_records([100] * 6, {6: 0.5})
    for step, record in enumerate(records[:6], start=1):
        record["alloc/predictor/root/auc"] = 0.5 + 0.1 * ((step - 1) // 2)  # 0.5, 0.5, 0.6, 0.6, 0.7, 0.7
        record["alloc/predictor/no_history/root/auc"] = 0.5
    runs = [train_curve.run_curve("trace_history", s, records, 0.4, steps_per_epoch=2) for s in (0, 1)]
    assert runs[0].per_epoch()["root_auc"] == pytest.approx([0.5, 0.6, 0.7])
    per_epoch = train_curve.aggregate(runs)["policies"]["trace_history"]["per_epoch"]
    assert per_epoch["root_auc"]["mean"] == pytest.approx([0.5, 0.6, 0.7])
    assert per_epoch["no_history_root_auc"]["mean"] == pytest.approx([0.5] * 3)
    assert "gate_open" not in per_epoch  # never logged by this arm
