"""Update benchmark: the achieved FLOP/s of the job's update against a jitted matmul measured in the same process.

``python -m trace_jax.bench.update [--quick] [--out bench_results/update.json]`` prints JSON.
``python -m trace_jax.bench.update --trees default [flags of bench.tree_packing]`` measures instead the
tokens and step time of tree-packed against per-path training on the default run's trees
(``trace_jax.bench.tree_packing``).

The model is a ~50M-parameter Qwen3 (``BENCH_MODEL``: 10 layers, hidden 512, vocab 32,000, tied). One step
is ``RLTrainer.update`` as the job runs it, set to one epoch of one mini-batch in one micro-batch (its zero,
accumulate and apply programs: forward, chunked log-probs, PPO-clip loss, backward, AdamW) on a synthetic
batch of ``rows x seq_len`` tokens, all trained. Achieved FLOP/s = model FLOPs / best step time, where model FLOPs
= 6 x non-embedding params x tokens + 6 x LM-head params x tokens + attention (12 x layers x rows x T^2 x
heads x head_dim / 2 for the causal half): the work a step must do, without remat recompute. XLA's own
count (``cost_analysis()`` of the accumulate and apply programs, recompute included) is reported beside it.
The peak is the best of a few jitted ``[n, n] @ [n, n]`` matmuls in the same dtype, in the same process (the
CPU's practical peak, under whatever load the machine has at that moment); ``fraction_of_peak`` is the ratio.
Steps and matmuls alternate so that load from other processes hits both alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from trace_jax.bench import tree_packing
from trace_jax.models import ModelConfig, create_model, num_params
from trace_jax.optim import make_optimizer
from trace_jax.parallel.mesh import create_sharded, make_mesh
from trace_jax.rl.batch import TrainBatch
from trace_jax.rl.losses import LossConfig
from trace_jax.rl.trainer import RLTrainer, UpdateConfig

BENCH_MODEL = ModelConfig(32000, 512, 1536, 10, 8, 4, 64, 1e6, 1e-6, True, False, True, 4096)


def synthetic_batch(rows: int, seq_len: int, vocab: int, seed: int = 0) -> TrainBatch:
    """Random ids, every token trained with weight 1 and a random advantage (a fully busy step)."""
    rng = np.random.default_rng(seed)
    advantages = rng.standard_normal((rows, seq_len)).astype(np.float32)
    known = {
        "tokens": rng.integers(0, vocab, (rows, seq_len)).astype(np.int32),
        "weights": np.ones((rows, seq_len), np.float32),
        "adv_pos": np.maximum(advantages, 0),
        "adv_neg": np.minimum(advantages, 0),
        "predecessor": np.broadcast_to(np.maximum(np.arange(seq_len, dtype=np.int32) - 1, 0), (rows, seq_len)).copy(),
        "visible_end": np.full((rows, seq_len), seq_len, np.int32),
        "paths": np.ones((rows,), np.float32),
        "old_logprobs": np.full((rows, seq_len), -np.log(vocab), np.float32),
        "segment_ids": np.ones((rows, seq_len), np.int32),
        "lengths": np.full((rows,), seq_len, np.int32),
        "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), (rows, seq_len)).copy(),
    }
    optional = ("ref_logprobs", "seq_loss", "seq_grad", "routing")  # None: no reference, GSPO terms or replay
    fields = {name: known.get(name) for name in TrainBatch._fields if name not in optional}
    missing = [name for name, value in fields.items() if value is None]
    if missing:
        raise ValueError(f"synthetic_batch does not know TrainBatch fields {missing}; add them to `known`")
    return TrainBatch(**fields)


def model_flops(config: ModelConfig, rows: int, seq_len: int) -> float:
    """FLOPs one training step must do (forward + backward = 3 x forward), remat recompute excluded."""
    tokens = rows * seq_len
    embed = config.vocab_size * config.hidden_size
    matmul_params = num_params(config) - embed * (1 if config.tie_word_embeddings else 2) + embed  # + LM head
    attention = 2 * 2 * config.num_layers * rows * seq_len * seq_len * config.num_heads * config.head_dim / 2
    return 6 * matmul_params * tokens + 3 * attention


def matmul_peak(n: int, dtype: Any, repeats: int) -> float:
    """Best FLOP/s of a jitted [n, n] @ [n, n] in ``dtype``."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, b).block_until_ready()
    best = min(_timed(lambda: matmul(a, b).block_until_ready()) for _ in range(repeats))
    return 2 * n**3 / best


def _xla_flops(trainer: RLTrainer, state: Any, batch: TrainBatch) -> float | None:
    """XLA's FLOPs of one optimizer step of ``update``: its accumulate and apply programs (best effort: not
    every backend reports a cost analysis)."""
    try:
        lowered = trainer.lower_update(state, batch)
        total = 0.0
        for name in ("accumulate", "apply"):
            cost = lowered[name].compile().cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            total += float(cost.get("flops", 0.0))
        return total or None
    except Exception:
        return None


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(rows: int, seq_len: int, steps: int, chunk: int, remat: str, dtype: str, matmul_n: int) -> dict[str, Any]:
    config = dataclasses.replace(BENCH_MODEL, remat=remat, dtype=dtype, param_dtype=dtype)
    mesh = make_mesh(devices=jax.devices()[:1])
    model = create_sharded(lambda: create_model(config, nnx.Rngs(0)), mesh)
    graphdef, params = nnx.split(model, nnx.Param)
    optimizer = make_optimizer(learning_rate=1e-5, schedule="constant")
    # One optimizer step per update call (one epoch, one mini-batch, one micro-batch): the FLOPs below are one step's.
    update = UpdateConfig(ppo_epochs=1, mini_batches=1, micro_rows=rows)
    trainer = RLTrainer(graphdef, optimizer, LossConfig(), mesh=mesh, logprob_chunk=chunk, update=update)
    state = trainer.init_state(params, jax.random.key(0))
    batch = synthetic_batch(rows, seq_len, config.vocab_size)
    start = time.perf_counter()
    state, _ = trainer.update(state, batch)  # compile + first step
    first = time.perf_counter() - start
    xla_flops = _xla_flops(trainer, state, batch)
    step_times, peaks = [], []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = trainer.update(state, batch)
        step_times.append(time.perf_counter() - start)
        peaks.append(matmul_peak(matmul_n, config.compute_dtype, repeats=3))
    flops = model_flops(config, rows, seq_len)
    best_step, peak = min(step_times), max(peaks)
    return {
        "model": {"params": num_params(config), "layers": config.num_layers, "hidden": config.hidden_size},
        "rows": rows,
        "seq_len": seq_len,
        "tokens": rows * seq_len,
        "dtype": dtype,
        "remat": remat,
        "logprob_chunk": chunk,
        "compile_and_first_step_s": round(first, 2),
        "step_s": [round(t, 3) for t in step_times],
        "model_flops_per_step": flops,
        "xla_flops_per_step": xla_flops,
        "achieved_flops_per_s": flops / best_step,
        "matmul_peak_flops_per_s": peak,
        "matmul_n": matmul_n,
        "fraction_of_peak": round(flops / best_step / peak, 3),
        "loss_finite": bool(np.isfinite(metrics["loss"])),
    }


TREE_SETS = ("default",)  # tree sets ``--trees`` can name (the default run's, built by bench.tree_packing)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    trees = argparse.ArgumentParser(add_help=False)
    trees.add_argument("--trees", choices=TREE_SETS)
    chosen, rest = trees.parse_known_args(sys.argv[1:] if argv is None else argv)
    if chosen.trees:
        return tree_packing.main(rest)
    parser = argparse.ArgumentParser(prog="python -m trace_jax.bench.update", description=__doc__.split("\n")[0])
    parser.add_argument("--trees", choices=TREE_SETS, help="packed vs per-path training on these trees instead")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--logprob-chunk", type=int, default=256)
    parser.add_argument("--remat", default="none")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--matmul-n", type=int, default=2048)
    parser.add_argument("--quick", action="store_true", help="2 rows x 256 tokens, 2 steps")
    parser.add_argument("--out", default="bench_results/update.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.seq_len, args.steps = 2, 256, 2
    result = run(args.rows, args.seq_len, args.steps, args.logprob_chunk, args.remat, args.dtype, args.matmul_n)
    result["machine"] = {
        "backend": jax.default_backend(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    return result


if __name__ == "__main__":
    main()
