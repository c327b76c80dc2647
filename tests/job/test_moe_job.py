"""The main job with a Qwen3-MoE policy: warm start, engine rollouts and two RL steps on the tiny world."""

import json
import os
import pathlib
import subprocess

import jax
import numpy as np

from tests.helpers import main_job_command
from trace_jax.checkpoint.state import StateCheckpointer

ROOT = pathlib.Path(__file__).resolve().parents[2]

# The smallest job that still runs every part once on the mixture of experts: a few-question world, 1 SFT
# step (the warm start trains and saves the MoE, not a useful policy), 2 prompts x 2 rollouts on 4 slots, one
# PPO epoch of one mini-batch, one eval question.
SMALL_MOE_JOB = [
    "--config.world.scale=1",
    "--config.world.questions_per_hop=6",
    "--config.world.ood_questions=2",
    "--config.tokenizer.vocab_size=300",
    "--config.sft.model=qwen3-moe-tiny",
    "--config.sft.max_steps=1",
    "--config.sft.warmup_steps=0",
    "--config.sft.practice_worlds=0",
    "--config.engine.max_slots=4",
    "--config.engine.append_windows=(512,)",
    "--config.allocation.rollouts_per_prompt=2.0",
    "--config.rl.prompts_per_step=2",
    "--config.ppo.ppo_epochs=1",
    "--config.ppo.mini_batches=1",
    "--config.eval.num_questions=1",
    "--config.eval.every=0",
]


def test_two_rl_steps_with_the_tiny_moe_policy(tmp_path):
    """Catches any part of the job (SFT, engine, trainer, checkpoints) that builds or reads a dense model only,
    with routing replay on (the engine records, the trees and rows carry it, the trainer replays it).

    Each assertion: the exit code fails on any part that cannot take the MoE; the two steps' allocation records
    fail if the second step (rollouts from the updated MoE policy) does not run; the logged load-balancing
    loss fails if the trainer's forward drops the sparse layers' router statistics; the checkpoint's expert
    weights fail if the policy trained and saved is not the mixture of experts."""
    flags = [*SMALL_MOE_JOB, "--config.rl.steps=2", "--config.engine.routing_replay=True"]
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
