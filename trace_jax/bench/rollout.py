"""Rollout benchmark: the default run's rollout phase against its decode loop, KV bytes of a tree rollout
against the same leaves decoded flat, and decode throughput against transformers and a bare jit loop.

``python -m trace_jax.bench.rollout [--workdir runs/bench_rollout] [--steps 3] [--quick]`` prints JSON (also
written to ``--out``).

Part 1, rollout phase. The default config's world, SFT warm start (trained into ``--workdir`` once, or reused
from it: copy a run's ``sft/`` and ``tokenizer/`` there), engine, runner and TRACE scheduler; ``--steps``
RL steps' rollout phases (``scheduler.run`` on a fresh prompt batch; no training, so the policy is fixed).
The engine's program set is compiled first (``warmup``), then one rollout phase on other prompts runs
unmeasured (one-time work outside the engine, e.g. the scheduler's predictor compiling). The same steps run
twice from the same seeds, so the same rollouts are sampled: once as the main job runs them (wall time), once
with every device program timed to completion (``ProgramSet.timed``), which gives the time of the
``generate`` calls alone. Target: rollout phase <= 1.5x its generate calls.

Part 2, KV bytes. 8 prompts x 4 rollouts each (stage 1), then for every rollout 2 anchors (its turn
prefixes; the root where it has fewer) x 4 continuations (stage 2), through the paged engine (the runner
holds every appended history's pages under its tree node, so a stage-2 anchor shares them): the KV pages
the tree rollout allocated (shared prefix pages counted once; ``tree_kv_bytes`` includes the pages reserved
ahead of each ``generate`` call, ``tree_kv_bytes_written`` only those that held a position) against the
pages its leaves need decoded flat, each leaf's whole history in its own pages (no reservation slack).
Target <= 0.6.

Part 3, decode throughput (``trace_jax.bench.decode``): tiny Qwen3 at 16 x 64 and the 12.6M-parameter
``qwen3-20m`` at 64 x 128, ours against transformers ``generate`` and a bare jit decode loop.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import time
from typing import Any

import numpy as np

from trace_jax import configs
from trace_jax.bench.decode import throughput_rows
from trace_jax.bench.report import machine
from trace_jax.data.prompts import PromptStream
from trace_jax.job import build
from trace_jax.job.commands import DEFAULT_CONFIG
from trace_jax.job.sft import run_sft
from trace_jax.rollout.backend import ContinuationRequest
from trace_jax.rollout.tree import ROOT, RolloutTree


def _setup(workdir: pathlib.Path):
    config = configs.load(str(DEFAULT_CONFIG))  # the default run's RunConfig
    world = build.build_world(config, workdir)
    sft = run_sft(config.sft, world.world, world.tokenizer, workdir, env=world.env)
    engine = build.build_engine(config, sft.model_config, sft.params)
    return config, world, engine


def _rollout_steps(config, world, engine, steps: int, timed: bool, seed: int | None = None) -> list[float]:
    """Wall seconds of ``steps`` rollout phases from the run's seeds (fresh runner, scheduler and prompts;
    ``seed`` replaces the run's)."""
    seed = config.seed if seed is None else seed
    runner = build.build_runner(config, engine.model_config, None, world, seed=seed, engine=engine)
    scheduler = build.build_scheduler(config, runner)
    prompts = PromptStream(world.world.questions("train"), config.rl.prompts_per_step, seed)
    engine.programs.timed = timed
    walls = []
    for _ in range(steps):
        tasks = prompts.next_batch()
        trees = [RolloutTree(world.env.prompt_ids(task), task, i) for i, task in enumerate(tasks)]
        start = time.perf_counter()
        scheduler.run(trees)
        walls.append(time.perf_counter() - start)
    engine.programs.timed = False
    return walls


def rollout_phase(config, world, engine, steps: int) -> dict[str, Any]:
    state = engine.acquire_state([list(s) for s in world.env.stop_sequences])
    start = time.perf_counter()
    programs = engine.warmup(None, state)
    warmup_s = time.perf_counter() - start
    engine.release_state(state)
    # One phase on other prompts first: what compiles or warms up once per run outside the engine (the
    # scheduler's predictor, first executions) stays out of the measured phases, as it stays in a run's step 1.
    start = time.perf_counter()
    _rollout_steps(config, world, engine, 1, timed=False, seed=config.seed + 1000)
    warmup_phase_s = time.perf_counter() - start
    before = dict(engine.counters)
    walls = _rollout_steps(config, world, engine, steps, timed=False)
    counts = {k: v - before.get(k, 0) for k, v in engine.counters.items()}
    engine.programs.seconds.clear()
    timed_walls = _rollout_steps(config, world, engine, steps, timed=True)
    seconds = dict(engine.programs.seconds)
    generate_s = seconds.get("generate", 0.0)
    return {
        "steps": steps,
        "warmup_programs": programs,
        "warmup_s": round(warmup_s, 2),
        "warmup_phase_s": round(warmup_phase_s, 2),
        "rollout_wall_s": [round(w, 2) for w in walls],
        "rollout_wall_total_s": round(sum(walls), 2),
        "generate_calls_s": round(generate_s, 2),
        "rollout_over_generate": round(sum(walls) / generate_s, 2) if generate_s else None,
        "timed_pass_wall_s": round(sum(timed_walls), 2),
        "program_seconds_timed_pass": {k: round(v, 2) for k, v in seconds.items()},
        "calls": counts,
        # The append program's cost scales with rows x width (padded), not with the ids it appends.
        "append_padding": round(counts.get("append_padded_tokens", 0) / max(counts.get("append_tokens", 0), 1), 2),
        "compiles_after_warmup": [shapes for _, shapes in engine.programs.late],
    }


def kv_bytes(config, world, engine, prompts: int = 8, roots: int = 4, anchors: int = 2, k: int = 4) -> dict[str, Any]:
    runner = build.build_runner(config, engine.model_config, None, world, seed=config.seed + 1, engine=engine)
    state = engine.acquire_state([list(s) for s in world.env.stop_sequences])
    engine.release_state(state)
    stats_before = dataclasses.replace(state.pool.stats)
    tasks = world.world.questions("train")[:prompts]
    trees = [RolloutTree(world.env.prompt_ids(task), task, i) for i, task in enumerate(tasks)]
    runner.continue_anchors([ContinuationRequest(tree, ROOT, roots) for tree in trees])
    requests = []
    for tree in trees:
        for leaf in tree.leaves():  # its turn prefixes, deepest last; the root (an anchor too) fills up
            inner = [n for n in tree.path(leaf)[1:] if not tree[n].is_leaf][:anchors]
            inner += [ROOT] * (anchors - len(inner))
            requests += [ContinuationRequest(tree, n, k) for n in inner]
    runner.continue_anchors(requests)
    cfg, mc = engine.config, engine.model_config
    itemsize = np.dtype(cfg.cache_dtype or mc.dtype).itemsize
    page_bytes = 2 * mc.num_layers * cfg.page * mc.num_kv_heads * mc.head_dim * itemsize
    stats = state.pool.stats
    tree_pages = stats.allocated - stats_before.allocated
    unwritten = stats.unwritten - stats_before.unwritten
    lengths = [tree.prefix_length(leaf) for tree in trees for leaf in tree.leaves()]
    flat_pages = sum(-(-n // cfg.page) for n in lengths)
    return {
        "prompts": prompts,
        "stage1_rollouts_per_prompt": roots,
        "stage2_requests": len(requests),
        "stage2_continuations_per_anchor": k,
        "leaves": len(lengths),
        "page_size": cfg.page,
        "tree_kv_bytes": tree_pages * page_bytes,
        "tree_kv_bytes_written": (tree_pages - unwritten) * page_bytes,
        "flat_kv_bytes": flat_pages * page_bytes,
        "tree_over_flat": round(tree_pages / flat_pages, 3),
        "tree_written_over_flat": round((tree_pages - unwritten) / flat_pages, 3),
        "fork_page_copies": stats.fork_copies - stats_before.fork_copies,
        "pages_shared_by_forks": stats.shared_by_forks - stats_before.shared_by_forks,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="runs/bench_rollout", help="holds (or gets) the SFT warm start")
    parser.add_argument("--steps", type=int, default=3, help="rollout phases to time")
    parser.add_argument("--quick", action="store_true", help="decode throughput on the tiny model only")
    parser.add_argument("--skip-decode", action="store_true", help="parts 1 and 2 only")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench_results/rollout.json")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    config, world, engine = _setup(pathlib.Path(args.workdir))
    result: dict[str, Any] = {"rollout_phase": rollout_phase(config, world, engine, args.steps)}
    print(json.dumps(result["rollout_phase"]), flush=True)
    result["kv_bytes"] = kv_bytes(config, world, engine)
    print(json.dumps(result["kv_bytes"]), flush=True)
    if not args.skip_decode:
        import torch  # the transformers reference only: not a dependency of the package

        torch.set_num_threads(1)
        rows = throughput_rows("qwen3-tiny", [16], [64], args.repeats)
        if not args.quick:
            rows += throughput_rows("qwen3-20m", [64], [128], args.repeats)
        result["decode"] = rows
    result["machine"] = machine()
    result["bench_wall_s"] = round(time.perf_counter() - start, 1)
    result["rollout_phase"]["median_step_s"] = round(statistics.median(result["rollout_phase"]["rollout_wall_s"]), 2)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
