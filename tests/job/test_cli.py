"""The main job's command line: help, --show-config, and every bad input ends in one line, a distinct exit
code and no work done (nothing written to the workdir)."""

import pathlib
import subprocess
import sys

import pytest

from trace_jax.job import train
from trace_jax.job.cli import ExitCode
from trace_jax.job.commands import evaluate_main, train_main

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run(capsys, *args):
    code = train_main(["trace_jax.train", *args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(err, *fragments):
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_help_exits_0_and_points_to_show_config(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == ExitCode.OK
    assert "--show-config" in out and "--config.KEY=VALUE" in out and "exit codes" in out


def test_show_config_lists_every_key_with_value_and_doc(capsys):
    code, out, _ = run(capsys, "--show-config", "--config.rl.steps=7", "--config.sft.time_budget_s=90")
    assert code == ExitCode.OK
    lines = out.splitlines()
    assert any(line.startswith("rl.steps = 7  # number of RL updates") for line in lines)
    assert any(line.startswith("sft.time_budget_s = 90.0  # None (the default) trains exactly") for line in lines)
    assert any(line.startswith("warm_start.cache_dir = ") for line in lines)
    assert any(line.startswith("allocation.policy = 'trace'  # ") for line in lines)
    assert any(line.startswith("seed = 0") for line in lines)
    assert any(line.startswith("rl.warmup_steps = 0.5  # linear learning-rate warm-up") for line in lines)
    # Derived values are shown apart, with their formula; the keys the job sets are not listed.
    assert "optim.total_steps = 28  # optimizer steps of the whole run: rl.steps × ppo.ppo_epochs" in out
    assert not any(
        line.startswith(("rl.micro_batches", "batch.row_multiple", "runner.max_turn_tokens")) for line in lines
    )


@pytest.mark.parametrize(
    "args,code,fragments",
    [
        (["--config.rl.steps=-1"], ExitCode.CONFIG, ["config.rl.steps=-1", "an integer >= 0"]),
        (["--config.sft.time_budget_s=0"], ExitCode.CONFIG, ["config.sft.time_budget_s=0.0", "seconds > 0"]),
        (["--config.allocation.rollouts_per_prompt=0"], ExitCode.CONFIG, ["rollouts_per_prompt=0.0", "> 0"]),
        (["--config.allocation.policy=bogus"], ExitCode.CONFIG, ["allocation.policy='bogus'", "uniform"]),
        (
            ["--config.allocation.candidates_per_prompt=0.5"],
            ExitCode.CONFIG,
            ["config.allocation: candidates_per_prompt must be >= 1", "0.5"],
        ),
        (["--config.engine.max_len=0"], ExitCode.CONFIG, ["config.engine.max_len=0 is not allowed", ">= 2"]),
        (["--config.rl.warmup_steps=-1"], ExitCode.CONFIG, ["config.rl.warmup_steps=-1.0", "a number >= 0"]),
        (["--config.ppo.micro_rows=-1"], ExitCode.CONFIG, ["config.ppo", "micro_rows must be >= 1, or 0"]),
        (
            ["--config.rl.micro_batches=2"],
            ExitCode.CONFIG,
            ["config key 'rl.micro_batches' is gone: use 'ppo.micro_rows'"],
        ),
        (["--config.rl.advantage=bogus"], ExitCode.CONFIG, ["rl.advantage='bogus'", "grpo"]),
        (["--config.loss.policy_loss=bogus"], ExitCode.CONFIG, ["config.loss", "policy_loss 'bogus'"]),
        (["--config.mesh.data=-1", "--config.mesh.fsdp=-1"], ExitCode.CONFIG, ["at most one axis may be -1"]),
        (["--config.mesh.rollout_devices=-1"], ExitCode.CONFIG, ["config.mesh.rollout_devices=-1", ">= 0"]),
        (["--config.rl.max_staleness=-1"], ExitCode.CONFIG, ["config.rl.max_staleness=-1", ">= 0"]),
        (["--config.rl.steps=abc"], ExitCode.CONFIG, ["rl.steps"]),
        (["--config.rl.learnin_rate=1e-5"], ExitCode.CONFIG, ["unknown config key 'rl.learnin_rate'"]),
        (["stray"], ExitCode.CONFIG, ["unexpected arguments ['stray']"]),
        ([f"--config={ROOT}/configs/ablation.py:bogus"], ExitCode.CONFIG, ["unknown policy 'bogus'"]),
        # A pool the train split cannot fill (the default world has 1,001 train questions) or that cannot fill
        # one step; without the check the run would build its warm start first and fail in the prompt stream.
        (
            ["--config.rl.pool_size=5000"],
            ExitCode.CONFIG,
            ["rl.pool_size=5000 is larger than the world's train split (1001 questions)", "pool_size=1001"],
        ),
        (["--config.rl.pool_size=4"], ExitCode.CONFIG, ["rl.pool_size=4 holds fewer prompts than one step draws (16"]),
        (["--config.rl.pool_size=-1"], ExitCode.CONFIG, ["config.rl.pool_size=-1 is not allowed", ">= 0"]),
        # Splits with question kinds: a kind that does not exist, and one the default world has none of.
        (
            ["--config.eval.split=test:bogus"],
            ExitCode.CONFIG,
            ["config.eval.split='test:bogus' is not allowed", "kinds"],
        ),
        (["--config.rl.split=dev"], ExitCode.CONFIG, ["config.rl.split='dev' is not allowed", "train, test or ood"]),
        (
            ["--config.rl.split=train:trivial"],
            ExitCode.CONFIG,
            ["config.rl.split='train:trivial' holds no question in this world", "trivial_questions"],
        ),
        (
            ["--config.rl.split=train:chain", "--config.rl.pool_size=5000"],
            ExitCode.CONFIG,
            ["rl.pool_size=5000 is larger than the world's train:chain split (1001 questions)"],
        ),
        (
            ["--config.allocation.select_on=bogus"],
            ExitCode.CONFIG,
            ["config.allocation", "unknown allocation.select_on 'bogus'", "first_search"],
        ),
        (
            ["--config.allocation.policy=uniform", "--config.allocation.select_on=first_search"],
            ExitCode.CONFIG,
            ["select_on='first_search' scores prompts", "policy 'uniform'", "use select_on='root'"],
        ),
        (["--config=configs/missing.py"], ExitCode.MISSING_FILE, ["config file configs/missing.py does not exist"]),
    ],
)
def test_bad_inputs_end_in_one_line_and_do_nothing(capsys, tmp_path, args, code, fragments):
    workdir = tmp_path / "run"
    got, _, err = run(capsys, f"--workdir={workdir}", *args)
    assert got == code
    assert_one_line_error(err, *fragments)
    assert not workdir.exists()


def test_a_mesh_that_does_not_match_the_devices_is_refused_before_work(capsys, tmp_path):
    workdir = tmp_path / "run"
    code, _, err = run(capsys, f"--workdir={workdir}", "--config.mesh.data=3", "--config.mesh.fsdp=1")
    assert code == ExitCode.CONFIG
    assert_one_line_error(err, "mesh.data=3", "does not fit the 1 available device")
    assert not (workdir / "config.json").exists() and not (workdir / "checkpoints").exists()
    code, _, err = run(capsys, f"--workdir={workdir}", "--config.mesh.rollout_devices=1")
    assert code == ExitCode.CONFIG
    assert_one_line_error(err, "rollout_devices=1 leaves no device to train")
    assert not (workdir / "config.json").exists() and not (workdir / "checkpoints").exists()


def test_unusable_workdirs_are_refused_before_work(capsys, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("not a directory")
    code, _, err = run(capsys, f"--workdir={a_file}")
    assert code == ExitCode.WORKDIR
    assert_one_line_error(err, "is a file, not a directory")
    code, _, err = run(capsys, "--workdir=/proc/trace_jax_run")  # cannot be created, even by root
    assert code == ExitCode.WORKDIR
    assert_one_line_error(err, "cannot be written")


def test_a_workdir_holding_another_run_is_refused(capsys, tmp_path):
    from trace_jax.configs import load_config_file
    from trace_jax.configs.validate import validate
    from trace_jax.job.build import save_run_config

    config = validate(load_config_file(str(ROOT / "configs" / "default.py")))
    save_run_config(config, tmp_path)
    code, _, err = run(capsys, f"--workdir={tmp_path}", "--config.optim.learning_rate=1e-3")
    assert code == ExitCode.WORKDIR
    assert_one_line_error(err, "holds a run with other settings", "optim.learning_rate: 0.0002 -> 0.001")


def test_ctrl_c_ends_in_one_line_with_the_last_checkpoint(capsys, tmp_path, monkeypatch):
    (tmp_path / "checkpoints" / "5").mkdir(parents=True)

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "_train", interrupted)
    code, _, err = run(capsys, f"--workdir={tmp_path}")
    assert code == ExitCode.INTERRUPTED
    assert_one_line_error(err, "interrupted", "last checkpoint is step 5", "rerun the same command")


def test_the_real_command_exits_with_the_code_and_no_traceback(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "trace_jax.train", f"--workdir={tmp_path / 'run'}", "--config.rl.steps=-1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == ExitCode.CONFIG
    assert_one_line_error(done.stderr, "config.rl.steps=-1")
    done = subprocess.run(
        [sys.executable, "-m", "trace_jax.train", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "--show-config" in done.stdout


def test_evaluate_on_a_directory_that_is_not_a_run_ends_in_one_line(capsys, tmp_path):
    code = evaluate_main(["--workdir", str(tmp_path / "nowhere")])
    assert code == ExitCode.MISSING_FILE
    assert_one_line_error(capsys.readouterr().err, "has no config.json", "trace_jax.train run")
