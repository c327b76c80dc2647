"""Routing replay over the context measured: what replaying prompt tokens' routing too would change.

``python -m trace_jax.bench.routing_context [--seeds 5] [--prompt-len 32] [--tokens 16]`` prints JSON. The setup
of ``trace_jax.bench.routing`` (``qwen3-moe-tiny``, a bf16 engine sampling 8 random prompts and recording the
sampled tokens' experts, an fp32 trainer's forward of the same rows), with longer prompts so that most of a row
is context, and three settings: replay off, the sampled tokens replayed (what the trainer does), and the context
replayed too. The engine records no prefill routing, so the context's record is the routing of a bf16 forward of
the rows (the sampler's numerics, replaying the engine's record on sampled tokens), a stand-in for the prefill's.

Per setting, per seed: ``tokens_differ`` (sampled tokens whose trainer top-k differs from the record in some
sparse layer), ``ctx_decisions_differ`` (context (token, layer) decisions that differ from the stand-in
record), ``mean_abs_gap`` / ``max_abs_gap`` (|behaviour − train| log-prob over sampled tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.bench import routing
from trace_jax.bench.report import emit
from trace_jax.models import MoeConfig, abstract_model


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=16, help="sampled tokens per prompt")
    parser.add_argument("--out", default="bench_results/routing_context.json")
    args = parser.parse_args(argv)
    trainer = MoeConfig.preset("qwen3-moe-tiny")
    sampler = dataclasses.replace(trainer, dtype="bfloat16", param_dtype="bfloat16")
    engine = routing.recording_engine(sampler, prompts=args.prompts, tokens=args.tokens, prompt_len=args.prompt_len)
    route_t, logprobs_t = routing._trainer_fns(abstract_model(trainer)[0])
    route_s, _ = routing._trainer_fns(abstract_model(sampler)[0])
    runs: dict[str, list[dict[str, float]]] = {"replay_off": [], "replay_sampled": [], "replay_context": []}
    for seed in range(args.seeds):
        params = routing.fresh_params(trainer, seed)
        trees = routing.sample_trees(engine, params, seed, prompt_len=args.prompt_len)
        batch = routing.replay_batch(trees, length=engine.config.max_len)
        record = np.asarray(batch.routing)
        sampled = record[..., 0, 0] >= 0
        real = np.arange(record.shape[1])[None] < np.asarray(batch.lengths)[:, None]
        context = real & ~sampled
        bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
        prefill = np.asarray(route_s(bf16, jax.tree.map(jnp.asarray, batch)))
        whole = np.where(real[..., None, None], np.where(sampled[..., None, None], record, prefill), -1)
        for name, replayed in (("replay_off", None), ("replay_sampled", record), ("replay_context", whole)):
            rows = jax.tree.map(jnp.asarray, batch._replace(routing=None if replayed is None else replayed))
            own = np.sort(np.asarray(route_t(params, rows)), -1)
            gap = (np.asarray(logprobs_t(params, rows)) - np.asarray(batch.old_logprobs))[sampled]
            differ = np.any(own[sampled] != np.sort(record[sampled], -1), -1)
            ctx_differ = np.any(own[context] != np.sort(prefill[context], -1), -1)
            runs[name].append(
                {
                    "tokens_differ": float(differ.any(-1).mean()),
                    "ctx_decisions_differ": float(ctx_differ.mean()),
                    "mean_abs_gap": float(np.abs(gap).mean()),
                    "max_abs_gap": float(np.abs(gap).max()),
                }
            )
    results: dict[str, Any] = {
        "model": "qwen3-moe-tiny",
        "sampler": "bf16 weights and compute (engine)",
        "trainer": "fp32 weights and compute",
        "seeds": args.seeds,
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "tokens_per_prompt": args.tokens,
        "backend": jax.default_backend(),
    }
    for name, per_seed in runs.items():
        results[name] = {
            key: {"mean": float(np.mean([r[key] for r in per_seed])), "per_seed": [r[key] for r in per_seed]}
            for key in per_seed[0]
        }
    return emit(results, args.out)


if __name__ == "__main__":
    main()
