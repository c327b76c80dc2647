"""Host time between engine calls: how long the scheduler, environment and tree bookkeeping take per rollout
round and per decode dispatch on this host, beside the device time the same round would take on a TPU slice.

    python -m trace_jax.bench.host_time [--steps 2] [--sft] [--plan docs/plans/qwen3-8b_v5p-64.json] [--out F]

The default job's world, engine (slots, steps per call, page size), runner and TRACE scheduler; the policy is
the job's tiny Qwen3 with random weights unless ``--sft`` trains (or reuses, in ``--workdir``) the warm start.
Each rollout phase runs with every device program timed to completion (``ProgramSet.timed``): the phase's
host time is its wall time less the programs' (generate, append, fork, ...), and a rollout round is one
``generate`` call (a decode dispatch of ``steps_per_call`` steps for every running slot) with the host work
around it. Beside it: the predicted device time of one such dispatch for a real model on a slice, from a
saved plan (``python -m trace_jax.plan ... --json``: its ``timing.decode.call_s``), and the predicted idle
fraction of the chips if the host work ran in series with the device: host / (host + device).

Host time here does not depend on the model's size (the host never touches weights); it grows with slots
and turns. The figures are this host's: a TPU VM's host CPUs are faster than a shared CI core.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time
from typing import Any

from flax import nnx

from trace_jax.bench.report import emit, machine
from trace_jax.data.prompts import PromptStream
from trace_jax.job import build
from trace_jax.job.commands import load_config
from trace_jax.job.sft import run_sft
from trace_jax.models import create_model
from trace_jax.rollout.tree import RolloutTree


def _policy(config, world, workdir: pathlib.Path, sft: bool):
    if sft:
        result = run_sft(config.sft, world.world, world.tokenizer, workdir, env=world.env)
        return result.model_config, result.params, "sft warm start"

    model_config = config.sft.model_config(len(world.tokenizer))
    params = nnx.split(create_model(model_config, nnx.Rngs(0)), nnx.Param)[1]
    return model_config, params, "random weights"


def host_time(config, world, engine, steps: int, seed: int) -> dict[str, Any]:
    """Per timed rollout phase: wall, device-program and host seconds, generate calls and rounds."""
    runner = build.build_runner(config, engine.model_config, None, world, seed=seed, engine=engine)
    scheduler = build.build_scheduler(config, runner)
    prompts = PromptStream(world.world.questions("train"), config.rl.prompts_per_step, seed)
    phases = []
    engine.programs.timed = True
    try:
        for _ in range(steps):
            tasks = prompts.next_batch()
            trees = [RolloutTree(world.env.prompt_ids(task), task, i) for i, task in enumerate(tasks)]
            engine.programs.seconds.clear()
            before = dict(engine.counters)
            start = time.perf_counter()
            scheduler.run(trees)
            wall = time.perf_counter() - start
            device = sum(engine.programs.seconds.values())
            counts = {k: v - before.get(k, 0) for k, v in engine.counters.items()}
            calls = int(counts.get("generate_calls", 0))
            phases.append(
                {
                    "wall_s": wall,
                    "device_programs_s": device,
                    "host_s": wall - device,
                    "generate_calls": calls,
                    "host_s_per_generate_call": (wall - device) / max(calls, 1),
                    "program_seconds": dict(engine.programs.seconds),
                    "counters": counts,
                }
            )
    finally:
        engine.programs.timed = False
    return {"phases": phases}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="runs/bench_host_time", help="the tokenizer (and --sft warm start)")
    parser.add_argument("--steps", type=int, default=2, help="timed rollout phases")
    parser.add_argument("--sft", action="store_true", help="the SFT warm start instead of random weights")
    parser.add_argument("--plan", default="docs/plans/qwen3-8b_v5p-64.json", help="a saved plan's JSON")
    parser.add_argument("--out", default="bench_results/host_time.json")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    config, _ = load_config(["host_time"])  # the default recipe's RunConfig, checked
    workdir = pathlib.Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    world = build.build_world(config, workdir)
    model_config, params, policy = _policy(config, world, workdir, args.sft)
    engine = build.build_engine(config, model_config, params)
    state = engine.acquire_state([list(s) for s in world.env.stop_sequences])
    engine.warmup(None, state)
    engine.release_state(state)
    host_time(config, world, engine, 1, config.seed + 1000)  # first executions and one-time host work
    measured = host_time(config, world, engine, args.steps, config.seed)
    phases = measured["phases"]
    per_call = statistics.median(p["host_s_per_generate_call"] for p in phases)
    result: dict[str, Any] = {
        "policy": policy,
        "engine": {"max_slots": config.engine.max_slots, "steps_per_call": config.engine.steps_per_call},
        "prompts_per_step": config.rl.prompts_per_step,
        **measured,
        "host_s_per_round_median": per_call,
        "device_s_per_round_here_median": statistics.median(
            p["program_seconds"].get("generate", 0.0) / max(p["generate_calls"], 1) for p in phases
        ),
    }
    if args.plan and os.path.exists(args.plan):
        with open(args.plan) as f:
            plan = json.load(f)
        decode = (plan.get("timing") or {}).get("decode")
        if decode:
            # The same round on the slice: one generate call of steps_per_call steps for every slot.
            device = decode["call_s"] * config.engine.steps_per_call / decode.get("steps_per_call", 64)
            result["tpu"] = {
                "plan": args.plan,
                "model": plan["model"],
                "topology": plan["topology"]["name"],
                "predicted_device_s_per_round": device,
                "host_s_per_round": per_call,
                "predicted_idle_fraction_in_series": per_call / (per_call + device),
            }
    result["machine"] = machine()
    result["bench_wall_s"] = round(time.perf_counter() - start, 1)
    return emit(result, args.out)


if __name__ == "__main__":
    main()
