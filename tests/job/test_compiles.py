"""A 5-step main job compiles nothing after its first step: not the engine, not the trainer."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.job.test_train import TINY

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compiles(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("compiles")
    command = [sys.executable, "-m", "tests.job.compile_check", str(workdir), "5", *TINY]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_engine_compiles_its_program_set_in_the_first_step_only(compiles):
    programs = compiles["engine_programs"]
    assert programs[0] > 0, "premise: the engine compiled during the first step"
    assert programs == [programs[0]] * 5 and not compiles["engine_late"]


def _late(compiles, watched):
    first, later = compiles["per_step"][0], compiles["per_step"][1:]
    assert any(w in name for name in first for w in watched), f"premise: {watched} compiled in step 1"
    return [(step + 2, name) for step, names in enumerate(later) for name in names if any(w in name for w in watched)]


def test_no_engine_program_compiles_after_the_first_step_by_jax_count(compiles):
    assert _late(compiles, ("append_program", "fork_program", "decode_program")) == []


# The trainer's PPO update runs fixed-shape micro-batch programs (``RLTrainer.update``) on rows of one length
# (``BatchConfig.fixed_length``), so whatever the size of a step's batch nothing compiles again.
TRAINER_PROGRAMS = ("jit(_zero_acc)", "jit(_accumulate)", "jit(_apply)", "jit(_policy_logprobs)", "jit(_behaviour")


def test_no_trainer_program_compiles_after_the_first_step(compiles):
    assert _late(compiles, TRAINER_PROGRAMS) == []
