"""One key per fact: retired keys are refused with the key that replaces them, derived values are derived, saved
runs with retired keys still resume and evaluate, and the warm-start keys of the shipped configs stay put. The run's
config is typed once (``RunConfig``), and each recipe shows and takes only the keys it reads."""

import dataclasses
import json
import pathlib

import jax
import numpy as np
import pytest

from tests.helpers import one_line_error
from trace_jax.config_utils import from_config
from trace_jax.configs import RunConfig, load_config_file, schema, validate
from trace_jax.job import build, rundir, warm_start
from trace_jax.job.cli import WorkdirError
from trace_jax.job.warm_start import fingerprint
from trace_jax.optim import make_optimizer, make_schedule
from trace_jax.rl.trainer import UpdateConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]


def config_file(name):
    return load_config_file(str(ROOT / "configs" / name))


def typed(name):
    """The shipped config ``name`` as the job reads it: a ``RunConfig``."""
    return validate.validate(config_file(name))


# The values configs/default.py held under the retired keys (read from a config.json it wrote).
OLD_DEFAULT = {
    "rl.recompute_old_logprobs": False,
    "rl.micro_batches": 1,
    "optim.total_steps": 30,
    "optim.warmup_steps": 2,
    "runner.max_turn_tokens": None,
    "batch.row_buckets": [32, 64, 96, 128, 192, 256],
    "batch.row_multiple": 1,
    "batch.pad_id": 0,
    "runner.eos_ids": [],
    "runner.greedy": False,
}


def old_run_config(config, **values):
    """``config`` as the ``config.json`` a run with the retired keys wrote (``values`` override OLD_DEFAULT)."""
    saved = rundir.config_dict(validate.validate(config))
    del saved["rl"]["warmup_steps"]
    for key, value in {**OLD_DEFAULT, **values}.items():
        section, _, field = key.partition(".")
        saved[section][field] = value
    return saved


# ------------------------------------------------------------------------------------------ retired keys
@pytest.mark.parametrize("key", sorted(schema.RETIRED))
def test_a_retired_key_on_the_command_line_names_its_replacement(capsys, tmp_path, key):
    value = {"rl.recompute_old_logprobs": "True", "runner.greedy": "True"}.get(key, "2")
    line = one_line_error(capsys, f"--workdir={tmp_path / 'run'}", f"--config.{key}={value}")
    assert f"config key '{key}' is gone: " in line
    assert not (tmp_path / "run").exists()


def test_the_messages_name_the_new_key_and_how_the_meaning_differs():
    messages = {key: schema.retired_message(key) for key in schema.RETIRED}
    assert messages["rl.recompute_old_logprobs"] == (
        "config key 'rl.recompute_old_logprobs' is gone: use 'ppo.behaviour_logprobs': 'recompute' where it was "
        "True, 'sampler' (the default) where it was False"
    )
    assert "use 'ppo.micro_rows'" in messages["rl.micro_batches"] and "row count" in messages["rl.micro_batches"]
    assert "use 'engine.max_turn_tokens'" in messages["runner.max_turn_tokens"]
    assert "set 'rl.steps'" in messages["optim.total_steps"]
    assert "use 'rl.warmup_steps', counted in RL steps" in messages["optim.warmup_steps"]


def test_a_retired_key_in_a_config_file_is_refused(capsys, tmp_path):
    path = tmp_path / "old.py"
    path.write_text(
        "import pathlib\n"
        "from trace_jax.configs import load_config_file\n\n\n"
        "def get_config():\n"
        f"    config = load_config_file({str(ROOT / 'configs' / 'default.py')!r})\n"
        "    config.rl.micro_batches = 2\n"
        "    config.optim.total_steps = 100\n"
        "    return config\n"
    )
    line = one_line_error(capsys, f"--config={path}", f"--workdir={tmp_path / 'run'}")
    assert "config key 'rl.micro_batches' is gone: use 'ppo.micro_rows'" in line
    assert "config key 'optim.total_steps' is gone" in line
    # A config built in code (benchmarks) is refused the same way before any work.
    config = config_file("default.py")
    config.rl.recompute_old_logprobs = True
    assert validate.problems(config) == [schema.retired_message("rl.recompute_old_logprobs")]


def test_sections_leave_out_the_keys_the_job_sets():
    from trace_jax.rl.batch import BatchConfig

    section = schema.section(BatchConfig(row_multiple=4))
    assert {"row_buckets", "row_multiple", "pad_id"}.isdisjoint(section.keys()) and "layout" in section
    shipped = (
        "default.py",
        "ablation.py",
        "realistic.py",
        "realistic_large.py",
        "default_ushaped.py",
        "search_r1.py:tiny",
    )
    for name in shipped:
        config = config_file(name)
        assert schema.retired_problems(config) == [], name
        assert validate.problems(config) == [], name


# --------------------------------------------------------------------------------------------- derived
def test_the_schedule_spans_the_run_in_optimizer_steps():
    default = config_file("default.py")
    assert schema.steps_per_rl_step(default) == UpdateConfig().steps_per_batch == 4
    assert schema.derived(validate.validate(default)) == {"optim.total_steps": 120, "optim.warmup_steps": 2}
    search_r1 = config_file("search_r1.py:qwen3-8b")
    assert schema.derived(validate.validate(search_r1)) == {"optim.total_steps": 4000, "optim.warmup_steps": 40}
    search_r1.ppo.mini_batches = 3
    assert schema.derived(validate.validate(search_r1)) == {"optim.total_steps": 6000, "optim.warmup_steps": 60}
    default.rl.steps = 0  # evaluation only: the optimizer still builds
    assert schema.optimizer_config(validate.validate(default)).total_steps == 1
    shown = schema.describe(typed("default.py"))
    assert "optim.total_steps = 120  # optimizer steps of the whole run: rl.steps × ppo.ppo_epochs" in shown


def test_the_default_runs_learning_rates_are_the_ones_it_always_had():
    # configs/default.py held warmup_steps=2 and total_steps=30 under a constant schedule, which ignores the
    # total: the derived 120 gives the very same learning rate at every step.
    new = schema.optimizer_config(typed("default.py"))
    old = dataclasses.replace(new, total_steps=30, warmup_steps=2)
    steps = np.arange(200)
    np.testing.assert_array_equal(
        np.asarray(jax.vmap(make_schedule(new))(steps)), np.asarray(jax.vmap(make_schedule(old))(steps))
    )
    make_optimizer(new)  # builds


# ----------------------------------------------------------------------------------------- saved runs
def test_a_run_saved_with_retired_keys_resumes_under_the_new_keys(tmp_path):
    config = config_file("default.py")
    (tmp_path / rundir.CONFIG_FILE).write_text(json.dumps(old_run_config(config), indent=2, sort_keys=True))
    rundir.check_same_run(tmp_path, validate.validate(config))  # the same run: no error
    loaded = build.load_run_config(tmp_path)  # what trace_jax.evaluate and trace_jax.hf export read
    assert isinstance(loaded, RunConfig) and loaded == validate.validate(config)
    assert schema.retired_problems(loaded.to_dict()) == [] and validate.problems(loaded.to_dict()) == []
    assert loaded.rl.warmup_steps == 0.5 and schema.derived(loaded)["optim.warmup_steps"] == 2
    assert rundir.changed_keys(rundir.config_dict(loaded), validate.validate(config)) == []
    changed = config_file("default.py")
    changed.rl.warmup_steps = 1.0
    with pytest.raises(WorkdirError, match=r"rl.warmup_steps: 0.5 -> 1.0"):
        rundir.check_same_run(tmp_path, validate.validate(changed))


def test_what_a_retired_key_did_is_carried_into_its_replacement():
    config = config_file("default.py")
    saved = old_run_config(
        config, **{"rl.recompute_old_logprobs": True, "runner.max_turn_tokens": 24, "optim.warmup_steps": 10}
    )
    upgraded = schema.upgrade(saved)
    assert upgraded["ppo"]["behaviour_logprobs"] == "recompute"
    assert upgraded["engine"]["max_turn_tokens"] == 24  # the runner's limit overrode the engine's
    assert upgraded["rl"]["warmup_steps"] == 2.5  # 10 optimizer steps of 4 per RL step
    assert "micro_batches" not in upgraded["rl"] and "row_buckets" not in upgraded["batch"]
    assert "total_steps" not in upgraded["optim"] and "max_turn_tokens" not in upgraded["runner"]
    assert saved["rl"]["recompute_old_logprobs"] is True  # the saved dict itself is left alone
    assert from_config(UpdateConfig, upgraded["ppo"]).behaviour_logprobs == "recompute"


# ----------------------------------------------------------------------------------------- warm start
# The warm-start keys of the shipped configs, their config part: computed under this jax version and with the
# code digest held at "code" (the key hashes both; an edit of the warm start's code moves every key, which
# test_warm_start.py covers). A config refactor that moves one of these retrains every user's warm start.
WARM_START_KEYS = {
    "default.py": "fde1c28b476bd470",
    "realistic.py": "66345a55723be7bb",
    "realistic_large.py": "a9c11bd85fed4aac",
    "default_ushaped.py": "58d3ad25fbcc31f3",
}


@pytest.mark.parametrize("name", sorted(WARM_START_KEYS))
def test_the_shipped_configs_keep_their_warm_start_keys(monkeypatch, name):
    monkeypatch.setattr(jax, "__version__", "0.10.2")
    monkeypatch.setattr(warm_start, "code_digest", lambda: "code")
    assert fingerprint(typed(name)) == WARM_START_KEYS[name]
