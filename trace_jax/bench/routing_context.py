"""Routing replay over the context measured: the engine's record of the prompt's routing, replayed or not.

``python -m trace_jax.bench.routing_context [--seeds 5] [--prompt-len 32] [--tokens 16]`` prints JSON. The setup
of ``trace_jax.bench.routing`` (``qwen3-moe-tiny``, a bf16 engine sampling 8 random prompts and recording the
routing, an fp32 trainer's forward of the same rows), with longer prompts so that most of a row is context. The
engine records the experts of every token it computes: the sampled tokens as it decodes them and the prompt as
its prefill (``append``) runs it (``EngineConfig.routing_replay``); the trees keep both. Four settings of the
trainer's forward: replay off; the sampled tokens' record replayed (the prompt's rows left unrecorded, -1);
the whole record replayed (``replay_context``: what the trainer does with trees from the engine); and the
sampled tokens' record with the routing of a bf16 forward of the rows standing in for the prompt's
(``replay_context_bf16_forward``, the stand-in measured before the engine recorded its prefill).

Per setting, per seed: ``tokens_differ`` (sampled tokens whose trainer top-k differs from the record in some
sparse layer), ``ctx_decisions_differ`` (context (token, layer) decisions of the trainer that differ from the
engine's prefill record), ``mean_abs_gap`` / ``max_abs_gap`` (|behaviour − train| log-prob over sampled tokens,
behaviour = the engine's sampling log-probs). ``engine_vs_bf16_forward`` (per seed): context (token, layer)
decisions where the engine's prefill record and the bf16 forward of the rows differ.
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
    names = ("replay_off", "replay_sampled", "replay_context", "replay_context_bf16_forward")
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    engine_vs_forward = []
    for seed in range(args.seeds):
        params = routing.fresh_params(trainer, seed)
        trees = routing.sample_trees(engine, params, seed, prompt_len=args.prompt_len, context=True)
        batch = routing.replay_batch(trees, length=engine.config.max_len)
        record = np.asarray(batch.routing)
        sampled = batch.loss_mask > 0
        real = np.arange(record.shape[1])[None] < np.asarray(batch.lengths)[:, None]
        context = real & ~sampled
        assert sampled.sum() == sum(t.num_sampled_tokens() for t in trees)
        assert (record[real] >= 0).all()  # the engine recorded every token: prompt (prefill) and sampled
        only_sampled = np.where(sampled[..., None, None], record, -1)
        bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
        forward = np.asarray(route_s(bf16, jax.tree.map(jnp.asarray, batch._replace(routing=only_sampled))))
        standin = np.where(real[..., None, None], np.where(sampled[..., None, None], record, forward), -1)
        prefill = np.sort(record[context], -1)
        engine_vs_forward.append(float(np.any(np.sort(forward[context], -1) != prefill, -1).mean()))
        settings = (None, only_sampled, record, standin)
        for name, replayed in zip(names, settings, strict=True):
            rows = jax.tree.map(jnp.asarray, batch._replace(routing=replayed))
            own = np.sort(np.asarray(route_t(params, rows)), -1)
            gap = (np.asarray(logprobs_t(params, rows)) - np.asarray(batch.old_logprobs))[sampled]
            differ = np.any(own[sampled] != np.sort(record[sampled], -1), -1)
            ctx_differ = np.any(own[context] != prefill, -1)
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
        "engine_vs_bf16_forward": engine_vs_forward,
    }
    for name, per_seed in runs.items():
        results[name] = {
            key: {"mean": float(np.mean([r[key] for r in per_seed])), "per_seed": [r[key] for r in per_seed]}
            for key in per_seed[0]
        }
    return emit(results, args.out)


if __name__ == "__main__":
    main()
