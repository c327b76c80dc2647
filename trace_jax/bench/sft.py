"""SFT warm-start benchmark: per-hop success of the warm-started tiny policy, sampled with real retrieval.

``python -m trace_jax.bench.sft [--workdir DIR] [--samples 4] [--out bench_results/sft.json]`` builds the
default synthetic world, trains its BPE tokenizer, runs (or reuses, from ``DIR/sft``) the default SFT warm
start, then samples ``--samples`` rollouts per question of the ``test`` split (1..3 hops, questions never
trained on) and the ``ood`` split (4 hops) at temperature 1 through the real rollout runner and engine, with
BM25 retrieval over the world's corpus. It prints JSON (also written to ``--out``): per hop, the success
rate over all rollouts, the share of questions solved at least once and the share of *mixed* questions
(some rollouts right, some wrong: the questions that give RL a gradient), plus format errors and turns.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import pathlib
import platform
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from trace_jax.bench.report import emit
from trace_jax.data.synthetic import SyntheticWorld, WorldConfig
from trace_jax.data.tokenizer import train_world_tokenizer
from trace_jax.envs.react import ReActEnv
from trace_jax.job.sft import SFTConfig, make_env, run_sft
from trace_jax.models import num_params
from trace_jax.rollout.backend import ContinuationRequest
from trace_jax.rollout.engine.engine import Engine, EngineConfig
from trace_jax.rollout.engine.sampling import SamplingConfig
from trace_jax.rollout.runner import RolloutRunner, RunnerConfig
from trace_jax.rollout.tree import ROOT, RolloutTree


def sample_trees(runner: RolloutRunner, env: ReActEnv, tasks: Sequence[Mapping[str, Any]], k: int) -> list[RolloutTree]:
    """``k`` rollouts from the root of each task's tree (one runner call: slots refill continuously)."""
    trees = [RolloutTree(env.prompt_ids(task), dict(task), i) for i, task in enumerate(tasks)]
    runner.continue_anchors([ContinuationRequest(tree, ROOT, k) for tree in trees])
    return trees


def per_hop_table(trees: Sequence[RolloutTree]) -> dict[str, dict[str, float]]:
    """Per hop count: rollout success rate, questions solved at least once, mixed questions, format errors."""
    groups: dict[int, list[RolloutTree]] = collections.defaultdict(list)
    for tree in trees:
        groups[int(tree.task["hops"])].append(tree)
    table = {}
    for hops, group in sorted(groups.items()):
        rewards = np.concatenate([t.leaf_rewards() for t in group])
        leaves = [t[i] for t in group for i in t.leaves()]
        table[str(hops)] = {
            "questions": len(group),
            "rollouts": int(rewards.size),
            "success": round(float(np.mean(rewards)), 4),
            "solved_at_least_once": round(float(np.mean([t.leaf_rewards().max() > 0 for t in group])), 4),
            "mixed": round(float(np.mean([t.is_mixed() for t in group])), 4),
            "format_errors": round(float(np.mean([bool(n.info.get("format_error")) for n in leaves])), 4),
            "mean_turns": round(float(np.mean([n.depth for n in leaves])), 3),
        }
    return table


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="runs/sft_bench", help="holds the tokenizer and the SFT checkpoint")
    parser.add_argument("--samples", type=int, default=4, help="rollouts per question")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--time-budget-s", type=float, default=SFTConfig.time_budget_s)
    parser.add_argument("--max-steps", type=int, default=SFTConfig.max_steps)
    parser.add_argument("--ood-questions", type=int, default=100, help="how many ood (4-hop) questions to sample")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--out", default="bench_results/sft.json")
    args = parser.parse_args(argv)

    workdir = pathlib.Path(args.workdir)
    world = SyntheticWorld(WorldConfig())
    tokenizer = train_world_tokenizer(world, workdir / "tokenizer", vocab_size=args.vocab_size)
    config = SFTConfig(time_budget_s=args.time_budget_s, max_steps=args.max_steps)
    start = time.monotonic()
    sft = run_sft(config, world, tokenizer, workdir)
    sft_wall = time.monotonic() - start

    env = make_env(world, tokenizer, config.react)
    engine = Engine.for_model(
        sft.model_config,
        EngineConfig(
            max_slots=64,
            max_len=512,
            steps_per_call=32,
            max_turn_tokens=48,
            sampling=SamplingConfig(temperature=args.temperature),
        ),
    )
    # refill_after=8: return to the host once 8 turns have ended (fewer round trips than refilling at each).
    runner_config = RunnerConfig(seed=args.seed, eos_ids=(tokenizer.eos_token_id,), refill_after=8)
    runner = RolloutRunner(engine, sft.params, env, runner_config)
    tasks = world.questions("test") + world.questions("ood")[: args.ood_questions]
    start = time.monotonic()
    trees = sample_trees(runner, env, tasks, args.samples)
    sample_wall = time.monotonic() - start

    result = {
        "command": "python -m trace_jax.bench.sft " + " ".join(argv if argv is not None else os.sys.argv[1:]),
        "per_hop": per_hop_table(trees),
        "sft": {
            "steps": sft.steps,
            "final_loss": round(sft.final_loss, 4),
            "train_seconds": round(sft.seconds, 1),
            "wall_seconds_incl_setup": round(sft_wall, 1),
            "reused_checkpoint": sft.restored,
            "config": dataclasses.asdict(config),
            "model_params": num_params(sft.model_config),
            "vocab_size": sft.model_config.vocab_size,
        },
        "sampling": {
            "temperature": args.temperature,
            "samples_per_question": args.samples,
            "retriever": "bm25 (in process), top-3",
            "seconds": round(sample_wall, 1),
            "retrieval_failures": env.retrieval_failures,
        },
        "machine": {"platform": platform.platform(), "jax_devices": [str(d) for d in jax.devices()]},
    }
    return emit(result, args.out)


if __name__ == "__main__":
    main()
