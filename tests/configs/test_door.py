"""The config door (``trace_jax.configs``): a config file and its overrides become one checked, frozen
``RunConfig``, the same for the job's command line and for every other entry point; ``--show-config`` documents
every key the recipe reads from the docs declared with the fields."""

import dataclasses
import pathlib

import pytest

from tests.helpers import one_line_error
from trace_jax import configs
from trace_jax.config_utils import documented
from trace_jax.configs import ConfigError, RunConfig, load_config_file, schema, validate
from trace_jax.job.cli import ExitCode
from trace_jax.job.commands import load_config, train_main
from trace_jax.rl.trainer import UpdateConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]


def typed(name):
    """The shipped config ``name`` as the job reads it: a ``RunConfig``."""
    return validate.validate(load_config_file(str(ROOT / "configs" / name)))


# ------------------------------------------------------------------------------------------- the door
def test_every_entry_point_gets_the_job_s_run_config_from_the_door():
    """``configs.load`` (the launcher's, the benches') gives the very RunConfig the command line gives: fails if
    the door parses overrides its own way or fills in defaults the job does not have."""
    overrides = ["--config.rl.steps=7", "--config.engine.sampling.temperature=0.5", "--config.mesh.fsdp=1"]
    spec = str(ROOT / "configs" / "default.py")
    from_cli, _ = load_config(["train", f"--config={spec}", *overrides])
    assert from_cli.rl.steps == 7  # premise: the overrides took
    assert configs.load(spec, overrides) == from_cli
    with pytest.raises(ConfigError, match=r"unknown config key 'rl\.stepz'; near matches: rl\.steps"):
        configs.load(spec, ["--config.rl.stepz=3"])
    assert ConfigError.exit_code == ExitCode.CONFIG


def test_validate_builds_the_run_config_once(monkeypatch):
    """Fails if validate builds the RunConfig a second time after its checks (the mutant: ``return
    RunConfig.build(config)`` at its end)."""
    built = []
    original = RunConfig.build.__func__
    monkeypatch.setattr(RunConfig, "build", classmethod(lambda cls, c: built.append(1) or original(cls, c)))
    run = validate.validate(load_config_file(str(ROOT / "configs" / "default.py")))
    assert isinstance(run, RunConfig) and built == [1]


def test_a_field_is_documented_where_it_is_declared():
    """``documented`` puts the doc in the field's metadata and --show-config reads it there; a field without one
    shows ``see ClassName``, and ``documented`` refuses an empty doc."""

    @dataclasses.dataclass(frozen=True)
    class Part:
        size: int = documented(3, "how many")
        names: tuple[str, ...] = documented(default_factory=tuple, doc="which ones")
        bare: int = 1

    assert Part() == Part(3, (), 1)
    assert schema.field_docs(Part) == {"bare": "see Part", "names": "which ones", "size": "how many"}
    with pytest.raises(ValueError, match="doc"):
        documented(1)


# ----------------------------------------------------------------------------------------- typed, per recipe
def test_the_command_line_gives_a_frozen_typed_config_with_the_overrides_applied():
    """Fails if load_config hands the job a ConfigDict (or a mutable config), or drops an override."""
    from trace_jax.job.commands import load_config

    config, _ = load_config(["train", "--config.rl.steps=7", "--config.engine.sampling.temperature=0.5"])
    assert isinstance(config, RunConfig) and config.rl.steps == 7 and config.engine.sampling.temperature == 0.5
    default = typed("default.py")
    assert dataclasses.replace(config, rl=dataclasses.replace(config.rl, steps=30), engine=default.engine) == default
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.rl.steps = 8  # type: ignore[misc]


def shown_keys(text):
    """``{key: doc}`` of every ``key = value  # doc`` line of --show-config's output (derived values left out)."""
    body = text.split("\n[derived]")[0]
    shown = {}
    for line in body.splitlines():
        if " = " in line and not line.startswith("["):
            key, _, rest = line.partition(" = ")
            shown[key] = rest.partition("  # ")[2]
    return shown


def test_show_config_documents_every_key_a_recipe_reads_and_none_it_ignores(capsys):
    """The mutants: a recipe that lists the synthetic world's keys (world.*, tokenizer.*, sft.*, warm_start.*, or
    rl.pool_size) for a Hugging Face checkpoint, or a key shown with no doc line (``# see ClassName``, the
    fallback of an undocumented field)."""

    assert schema.field_docs(UpdateConfig)["ppo_epochs"] != "see UpdateConfig"  # premise: the fields carry their docs
    undocumented = dataclasses.make_dataclass("Bare", [("size", int, 1)])
    assert schema.field_docs(undocumented) == {"size": "see Bare"}  # premise: a missing doc is visible
    synthetic = ("world.", "tokenizer.", "sft.", "warm_start.", "rl.pool_size", "rl.split", "mesh.rollout_cpus")
    default = shown_keys(schema.describe(typed("default.py")))
    assert all(any(key.startswith(prefix) for key in default) for prefix in synthetic)  # premise: they exist

    assert train_main(["trace_jax.train", "--config=configs/search_r1.py:qwen3-8b", "--show-config"]) == 0
    shown = shown_keys(capsys.readouterr().out)
    assert shown["model.hf_dir"].startswith("a Qwen2 / Qwen2.5 / Qwen3 / Qwen3-MoE Hugging Face directory")
    assert {"model.tokenizer_dir", "data.dir", "recipe.kind", "eval.split", "mesh.tensor"} <= set(shown)
    assert [key for key in shown if key.startswith(synthetic)] == []
    for name in (default, shown):
        undocumented = [key for key, doc in name.items() if not doc or doc.startswith("see ")]
        assert undocumented == [], undocumented


@pytest.mark.parametrize(
    "config, key, reader",
    [
        ("configs/search_r1.py:tiny", "world.scale=2", "synthetic"),
        ("configs/search_r1.py:tiny", "sft.max_steps=5", "synthetic"),
        ("configs/search_r1.py:tiny", "rl.pool_size=8", "synthetic"),
        ("configs/default.py", "model.hf_dir=/data/Qwen3-8B", "search_r1"),
        ("configs/default.py", "data.dir=/data/search_r1", "search_r1"),
    ],
)
def test_an_override_the_recipe_does_not_read_is_refused_naming_the_recipe_that_does(
    capsys, tmp_path, config, key, reader
):
    """Fails if an override of a key the run's recipe ignores is accepted (it would change nothing), or if the
    error does not say which recipe reads it."""
    line = one_line_error(capsys, f"--config={config}", f"--config.{key}", f"--workdir={tmp_path / 'run'}")
    name = key.partition("=")[0]
    kind = "synthetic" if reader == "search_r1" else "search_r1"
    assert f"config key '{name}' is not read by this run's recipe (recipe.kind='{kind}')" in line
    assert f"it is read by the {reader} recipe" in line
    assert not (tmp_path / "run").exists()
