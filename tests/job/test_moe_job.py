"""The main job with a Qwen3-MoE policy: warm start, engine rollouts and two RL steps on the tiny world."""

import json
import os
import pathlib
import subprocess

import jax
import numpy as np

from tests.helpers import TINY_MAIN_JOB, main_job_command
from trace_jax.checkpoint.state import StateCheckpointer

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_two_rl_steps_with_the_tiny_moe_policy(tmp_path):
    """Catches any part of the job (SFT, engine, trainer, checkpoints) that builds or reads a dense model only,
    with routing replay on (the engine records, the trees and rows carry it, the trainer replays it)."""
    flags = [
        *TINY_MAIN_JOB,
        "--config.sft.model=qwen3-moe-tiny",
        "--config.rl.steps=2",
        "--config.engine.routing_replay=True",
    ]
    done = subprocess.run(
        main_job_command(tmp_path / "run", tmp_path / "cache", flags),
        cwd=ROOT,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "alloc/effective_ratio" in r] == [1, 2]
    # The load-balancing loss of the trained policy is logged (not added: loss.router_aux_loss_coef is 0).
    assert all(r["train/router_aux_loss"] > 0 for r in records if "alloc/effective_ratio" in r)
    restored = StateCheckpointer(tmp_path / "run" / "checkpoints").restore_latest(keys=["params"])
    leaves = jax.tree_util.tree_leaves_with_path(restored.state["params"])
    gates = [np.asarray(x) for path, x in leaves if "moe_layers" in str(path) and "gate_proj" in str(path)]
    # Premise: the policy trained is the mixture of experts (its [layers, experts, d, f] weights are saved).
    assert len(gates) == 1 and gates[0].shape[1:3] == (4, 64)
