"""Train-step benchmark: tree-packed rows against one row per leaf path, on trees like the default run's.

``python -m trace_jax.bench.tree_packing [--steps 3] [--out bench_results/tree_packing.json]``
prints JSON: per layout the tokens the forward pass processes (real and padded), the batch shape and the
median step time of one optimizer step on the same trees, side by side from one run, and the packed/per-path
ratios (targets: <= 0.7x the tokens, <= 0.8x the time; ``targets_met`` judges real and padded tokens apart).
Both layouts start from the same params, so their first-step losses must agree (the packed objective is the
per-path one): ``first_loss_relative_difference``.

Trees. The default run's allocation (``configs/default.py``: TRACE policy, its rollout budget, prompts per
step, advantage estimator) over the ground-truth simulator with turn, observation and prompt lengths within
the default run's limits (``--prompt-tokens`` etc.; the real run needs an SFT warm start, minutes on CPU),
chosen so that path tokens / unique tokens is ~1.75, as on the default run's trees (docs/benchmarks.md,
"Tree-packed training");
more sharing (longer prompts, deeper branching) favours packing further.
The first ``--warmup`` batches teach the predictor and the cost model, as in a run. Model, batch buckets,
loss and optimizer are the default config's; one optimizer step (``ppo_epochs = mini_batches = 1``) is timed
so the two layouts do the same work per step. Timings alternate between the layouts to share machine noise.
Packed rows take the default config's row length (``BatchConfig.fixed_length``: the largest bucket); per-path
rows the length bucket of the longest path, their cheapest shape. ``--prompts`` and ``--tiny-model`` shrink the
run for tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax import configs
from trace_jax.allocation.scheduler import TreeScheduler
from trace_jax.allocation.simulate import Simulator, SimulatorConfig
from trace_jax.configs import schema
from trace_jax.models import create_model
from trace_jax.optim import make_optimizer
from trace_jax.rl.advantages import compute_advantages
from trace_jax.rl.batch import build_batch
from trace_jax.rl.trainer import RLTrainer

DEFAULT_CONFIG = pathlib.Path(__file__).resolve().parents[2] / "configs" / "default.py"


def default_config() -> Any:
    return configs.load(str(DEFAULT_CONFIG))  # the default run's RunConfig


def default_trees(config: Any, args: argparse.Namespace) -> list:
    """The trees of one training step of the default run's allocation, on the simulator."""
    world = SimulatorConfig(
        prompt_tokens=args.prompt_tokens,
        turn_tokens_mean=args.turn_tokens,
        answer_tokens_mean=args.answer_tokens,
        max_turn_tokens=config.engine.max_turn_tokens,
        observation_tokens=args.observation_tokens,
        max_turns=args.max_turns,
        vocab_size=config.tokenizer.vocab_size,
    )
    sim = Simulator(world, seed=args.seed)
    scheduler = TreeScheduler(sim, config.allocation)
    prompts = args.prompts or config.rl.prompts_per_step
    for _ in range(args.warmup):
        scheduler.run(sim.sample_batch(prompts))
    return scheduler.run(sim.sample_batch(prompts)).trees


def packed_context(layouts: dict[str, dict[str, Any]]) -> int:
    """Tokens the packed layout repeats as context (trees split over rows): packed tokens − unique tokens."""
    return int(layouts["packed"]["tokens"] - layouts["packed"]["unique_tokens"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per layout (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="allocation batches before the measured one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--turn-tokens", type=float, default=40.0, help="mean sampled tokens of a search turn")
    parser.add_argument("--answer-tokens", type=float, default=20.0, help="mean sampled tokens of the answer turn")
    parser.add_argument("--observation-tokens", type=int, default=80)
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--pack-length", type=int, default=None, help="packed row length (default: the config's)")
    parser.add_argument("--prompts", type=int, default=0, help="prompts per step (default: the config's)")
    parser.add_argument("--tiny-model", action="store_true", help="a 2-layer model of width 32 (for tests)")
    parser.add_argument("--out", default="bench_results/tree_packing.json")
    args = parser.parse_args(argv)
    config = default_config()
    start = time.perf_counter()
    trees = default_trees(config, args)
    advantages = compute_advantages(config.rl.advantage, trees)
    loss = config.loss
    model_config = config.sft.model_config(config.tokenizer.vocab_size)
    if args.tiny_model:
        model_config = dataclasses.replace(
            model_config, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16
        )
    graphdef, params = nnx.split(create_model(model_config, nnx.Rngs(args.seed)), nnx.Param)
    optimizer = make_optimizer(schema.optimizer_config(config))
    # The job's update (its micro-batches), one epoch of one mini-batch: one optimizer step a call.
    trainer = RLTrainer(graphdef, optimizer, loss, update=dataclasses.replace(config.ppo, ppo_epochs=1, mini_batches=1))

    layouts: dict[str, dict[str, Any]] = {}
    batches, states = {}, {}
    for name, layout in (("per_path", "paths"), ("packed", "tree")):
        fixed = {"fixed_length": False} if layout == "paths" else {}
        batch_config = dataclasses.replace(
            config.batch,
            layout=layout,
            pack_length=args.pack_length,
            row_buckets=(32, 64, 96, 128, 192, 256),  # a few padded row counts: a handful of programs
            skip_zero_advantage=False,  # every tree in both layouts: this compares the layouts, not the skip
            **fixed,
        )
        batch, info = build_batch(trees, advantages, batch_config, loss)
        unique = int(sum(sum(n.num_tokens for n in t) for t in trees))
        batches[name] = batch
        states[name] = trainer.init_state(jax.tree.map(jnp.copy, params), jax.random.key(0))
        compile_start = time.perf_counter()
        states[name], first = trainer.update(states[name], batches[name])  # compiles this shape
        layouts[name] = {
            "layout": layout,
            "rows": info.num_rows,
            "shape": list(batch.tokens.shape),
            "tokens": info.num_tokens,
            "padded_tokens": info.num_padded_tokens,
            "trained_tokens": info.num_trained_tokens,
            "unique_tokens": unique,
            "first_step_seconds": time.perf_counter() - compile_start,
            "first_loss": first["loss"],
            "step_seconds": [],
        }
    for _ in range(args.steps):
        for name in layouts:
            step_start = time.perf_counter()
            states[name], metrics = trainer.update(states[name], batches[name])
            layouts[name]["step_seconds"].append(time.perf_counter() - step_start)
            layouts[name]["loss"] = metrics["loss"]
    for stats in layouts.values():
        stats["median_step_seconds"] = float(np.median(stats["step_seconds"]))
    packed, per_path = layouts["packed"], layouts["per_path"]
    results = {
        "command": " ".join(["python -m trace_jax.bench.tree_packing", *(sys.argv[1:] if argv is None else argv)]),
        "device": str(jax.devices()[0].platform),
        "trees": {
            "count": len(trees),
            "leaves": int(sum(len(t.leaves()) for t in trees)),
            "unique_tokens": int(sum(sum(n.num_tokens for n in t) for t in trees)),
            "path_tokens": int(sum(t.prefix_length(leaf) for t in trees for leaf in t.leaves())),
            "context_copies": packed_context(layouts),
            "max_depth": int(max(n.depth for t in trees for n in t)),
        },
        "simulator": {k: v for k, v in vars(args).items() if k not in ("out", "steps")},
        "model": dataclasses.asdict(model_config),
        "layouts": layouts,
        "ratios": {
            "tokens": packed["tokens"] / per_path["tokens"],
            "padded_tokens": packed["padded_tokens"] / per_path["padded_tokens"],
            "step_time": packed["median_step_seconds"] / per_path["median_step_seconds"],
        },
        "first_loss_relative_difference": abs(packed["first_loss"] - per_path["first_loss"])
        / max(abs(per_path["first_loss"]), 1e-12),
        "targets": {"tokens": 0.7, "step_time": 0.8},
        "seconds": time.perf_counter() - start,
    }
    results["targets_met"] = {
        "tokens": results["ratios"]["tokens"] <= 0.7,
        "padded_tokens": results["ratios"]["padded_tokens"] <= 0.7,
        "step_time": results["ratios"]["step_time"] <= 0.8,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
