"""The layout the plan picks flows into the pod job: ``launch/tpu_pod.sh --plan-layout`` (search now) and
``--layout-from PLAN.json`` (a saved plan) put its mesh, micro-batch rows and remat into the job's overrides on
every host (``trace_jax.plan.layout_overrides``, ``launch/pod_helper.py layout`` / ``layout-from``)."""

import copy
import json
import shlex
import subprocess
import sys

import pytest

from tests.test_launch import ENV, POD, ROOT, commands, flag, gcloud, launch
from trace_jax.configs import ConfigError, load
from trace_jax.models import ModelConfig
from trace_jax.plan.layout_overrides import NoLayout, layout_overrides, pinned_keys
from trace_jax.rl.trainer import UpdateConfig

sys.path.insert(0, str(ROOT / "launch"))
import pod_helper  # launch/ is not a package

SAVED_PLAN = ROOT / "docs" / "plans" / "qwen3-30b-a3b_v5p-64.json"  # a committed plan (the TPU compiler's pick)
# Trimmed from that plan: what the planner's JSON says of the train layout it picked.
RECORDED = {
    "model": "qwen3-30b-a3b",
    "topology": {"name": "v5p-64", "chips": 32},
    "train": {
        "fits": {
            "mesh": {"data": 1, "fsdp": 2, "expert": 16, "tensor": 1},
            "settings": {"rows": 256, "micro_rows": 32, "micro_batches": 8, "remat": "full"},
        },
        "tried": [],
    },
}


def _starts(cmds):
    """The job of every ``tpu_worker.sh start`` command (each runs on all workers of its slice)."""
    jobs = [shlex.split(flag(c, "command")) for c in gcloud(cmds, "ssh")]
    return [
        j[j.index("--") + 1 :] for j in jobs if j[:3] == ["bash", "trace_jax_run/code/launch/tpu_worker.sh", "start"]
    ]


def test_the_plans_layout_becomes_the_jobs_mesh_micro_rows_and_remat():
    """Fails if the mapping drops or misreads a part of the layout (micro_rows, remat, windowed matmuls, an
    axis), or if a key it sets is not one the job's config door accepts."""
    overrides = layout_overrides(RECORDED)
    assert overrides == [
        "--config.mesh.data=1",
        "--config.mesh.fsdp=2",
        "--config.mesh.expert=16",
        "--config.mesh.tensor=1",
        "--config.ppo.micro_rows=32",
        "--config.ppo.remat=full",
        "--config.ppo.windowed_einsum=True",  # a plan made before the setting: the compiler's default
    ]
    run = load("configs/search_r1.py:qwen3-30b-a3b", overrides)
    assert (run.mesh.fsdp, run.mesh.expert, run.mesh.tensor) == (2, 16, 1)
    assert (run.ppo.micro_rows, run.ppo.remat, run.ppo.windowed_einsum) == (32, "full", True)
    unwindowed = copy.deepcopy(RECORDED)
    unwindowed["train"]["fits"]["settings"]["windowed_einsum"] = False
    assert not load("configs/search_r1.py:qwen3-30b-a3b", layout_overrides(unwindowed)).ppo.windowed_einsum
    # Two slices laid out as the plan's one: micro_rows counts both slices' rows; a dense plan has no expert axis.
    dense = copy.deepcopy(RECORDED)
    del dense["train"]["fits"]["mesh"]["expert"]
    two = layout_overrides(dense, slices=2)
    assert "--config.mesh.expert=1" in two and "--config.ppo.micro_rows=64" in two
    nothing = {**RECORDED, "train": {"fits": None, "tried": [{}, {}]}}
    with pytest.raises(NoLayout, match="no train layout that fits among 2"):
        layout_overrides(nothing)
    assert pinned_keys(["--config.seed=1", "--config.ppo.remat=none", "--config.mesh.tensor=4"]) == [
        "mesh.tensor",
        "ppo.remat",
    ]


def test_ppo_remat_is_a_validated_key_the_update_runs_with():
    """Fails if ``ppo.remat`` does not reach the model the update runs, or if a misspelt policy passes."""
    model = ModelConfig.preset("qwen3-tiny")
    assert model.remat == "none"  # premise: the preset keeps everything
    assert UpdateConfig(remat="full").trained_model(model).remat == "full"
    assert UpdateConfig().trained_model(model) is model  # "": the model's own
    with pytest.raises(ConfigError, match=r"ppo.*unknown remat 'ful'"):
        load("configs/default.py", ["--config.ppo.remat=ful"])


def test_a_saved_plans_layout_reaches_every_hosts_job_and_the_relaunch():
    """``--layout-from``: fails if the layout is missing from a slice's job line, from the relaunched job, or
    comes after the user's overrides; or if it is read after the slice is created."""
    extra = ["--config.model.hf_dir=gs://b/m"]
    done = launch(
        "tpu_pod.sh", "--dry-run", *POD, "--slices", "2", "--spot", "--watch", "--accelerator", "v5p-64",
        "--skip-check", "--config", "configs/search_r1.py:qwen3-30b-a3b", "--layout-from", str(SAVED_PLAN),
        "--", *extra,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    cmds = commands(done.stdout)
    expected = layout_overrides(json.loads(SAVED_PLAN.read_text()), slices=2)
    assert "--config.ppo.micro_rows=256" in expected  # premise: the saved plan's 128 rows a slice, two slices
    starts = _starts(cmds)
    assert len(starts) == 4  # two slices, started and then relaunched (the watch's dry-run round)
    for job in starts:
        at = job.index(expected[0])
        assert job[at : at + len(expected)] == expected and job[-1] == extra[0]
    layout_at = next(i for i, c in enumerate(cmds) if "layout-from" in c)
    plan_at = next(i for i, c in enumerate(cmds) if "pod_helper.py" in " ".join(c) and "plan" in c)
    create_at = next(i for i, c in enumerate(cmds) if c[0] == "gcloud" and "create" in c)
    assert layout_at < plan_at < create_at
    assert all(o in cmds[plan_at] for o in expected)  # the plan step checks the layout the job runs


def test_a_saved_plan_of_another_job_is_refused_and_a_pinned_layout_wins(capsys):
    """Fails if a plan of another model or accelerator lays out this job, or if the user's pinned mesh is
    replaced by the plan's."""
    config = "configs/search_r1.py:qwen3-8b"
    assert pod_helper.layout_from([str(SAVED_PLAN), "v5p-64", config]) == 2
    assert "planned qwen3-30b-a3b on v5p-64; this launch runs qwen3-8b on v5p-64" in capsys.readouterr().err
    config = "configs/search_r1.py:qwen3-30b-a3b"
    assert pod_helper.layout_from([str(SAVED_PLAN), "v5p-128", config]) == 2
    assert pod_helper.layout_from([str(SAVED_PLAN), "v5p-64", config]) == 0
    saved = layout_overrides(json.loads(SAVED_PLAN.read_text()))
    assert capsys.readouterr().out.split() == saved  # premise: it prints the saved plan's layout
    assert pod_helper.layout_from([str(SAVED_PLAN), "v5p-64", config, "--config.mesh.tensor=2"]) == 0
    out = capsys.readouterr()
    assert out.out == "" and "mesh.tensor set by the overrides" in out.err


def test_the_layout_search_checks_the_engine_on_the_mesh_it_picked(monkeypatch, capsys):
    """``pod_helper.py layout`` with a stand-in planner that picks ``RECORDED``'s layout: fails if the search is
    not asked for (a pinned mesh instead), if the engine is not checked on the picked layout, or if the
    overrides printed are not that layout's."""
    calls = []

    def planner(accelerator, config_spec, overrides, extra, search=False):
        calls.append((list(overrides), list(extra), search))
        argv = pod_helper.plan_command(accelerator, config_spec, overrides, extra, search)
        if search:
            assert "--mesh" not in argv and "--micro-rows" not in argv and argv[-4:-2] == ["--margin", "0.2"]
            with open(extra[extra.index("--json") + 1], "w") as f:
                json.dump(RECORDED, f)
        return 0

    monkeypatch.setattr(pod_helper, "_run_planner", planner)
    config = "configs/search_r1.py:qwen3-30b-a3b"
    assert pod_helper.layout(["v5p-64", config, "--config.seed=1", "--", "--margin", "0.2"]) == 0
    chosen = layout_overrides(RECORDED)
    assert capsys.readouterr().out.split() == chosen
    (_, _, searched), (overrides, extra, checked) = calls
    assert searched and not checked
    assert overrides == ["--config.seed=1", *chosen] and extra[-2:] == ["--rows", "0"]
    check = pod_helper.plan_command("v5p-64", config, overrides, extra)
    assert check[check.index("--mesh") + 1] == "data=1,fsdp=2,expert=16,tensor=1"
    assert check[check.index("--remat") + 1] == "full"
    # Nothing fits (the planner's exit 3): no layout printed, no engine check.
    monkeypatch.setattr(pod_helper, "_run_planner", lambda *a, **k: calls.append(a) or 3)
    assert pod_helper.layout(["v5p-64", config]) == 3
    assert capsys.readouterr().out == "" and len(calls) == 3


@pytest.mark.slow
def test_plan_layout_searches_with_the_planner_and_launches_what_it_picked():
    """The real search (XLA:CPU stand-ins, the tiny model on one chip, 8 rows of 64 tokens): fails if the
    planner's pick does not reach the job line, or if the launch plans the config's own layout instead."""
    plan_args = "--backend cpu --seq-len 64 --rows 8 --engine-len 64"
    done = subprocess.run(
        ["bash", str(ROOT / "launch" / "tpu_pod.sh"), "--dry-run", *POD, "--create", "--accelerator", "v6e-1",
         "--plan-layout", "--plan-args", plan_args, "--", "--config.seed=3"],
        capture_output=True, text=True, timeout=600, env=ENV,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "update     1 " in done.stderr and "generate   1 " in done.stderr  # both programs compiled
    (job,) = _starts(commands(done.stdout))
    layout = ["--config.mesh.fsdp=1", "--config.ppo.micro_rows=8", "--config.ppo.remat=none"]
    assert all(o in job for o in layout) and job[-1] == "--config.seed=3"
    assert not any(c[:3] == [sys.executable, "launch/pod_helper.py", "plan"] for c in commands(done.stdout))


class _Stop(Exception):
    """Raised by the stand-in trainer: the test needs only what the job built it with."""


def test_the_job_builds_its_update_with_ppo_remat(monkeypatch, tmp_path):
    """The main job's ``Training`` with a stand-in start (a fresh tiny policy, no warm start) and a stand-in
    ``RLTrainer`` that records the model its graph is of: fails if ``ppo.remat`` does not reach the update's
    model (the job building its trainer from the start's model config alone)."""
    import contextlib

    from flax import nnx

    from trace_jax.job import recipes, training
    from trace_jax.models import create_model

    model_config = ModelConfig.preset("qwen3-tiny", num_layers=1)
    assert model_config.remat == "none"  # premise: the start's model keeps everything
    params = nnx.split(create_model(model_config, nnx.Rngs(0)), nnx.Param)[1]

    class Source:
        def start(self, config, workdir, mesh=None, progress=None, notify=None):
            return recipes.Start(None, model_config, params, "a fresh policy")

    built = {}

    def trainer(graphdef, *args, **kwargs):
        built["model"] = nnx.merge(graphdef, params).config
        raise _Stop

    monkeypatch.setattr(recipes, "source_of", lambda config: Source())
    monkeypatch.setattr(training, "RLTrainer", trainer)
    console = type("Console", (), {"info": lambda self, *a: None, "progress": None})()
    timer = type("Timer", (), {"phase": lambda self, name: contextlib.nullcontext()})()
    config = load("configs/default.py", ["--config.ppo.remat=full"])
    with pytest.raises(_Stop):
        training.Training(config, tmp_path, console, timer)
    assert built["model"].remat == "full"
