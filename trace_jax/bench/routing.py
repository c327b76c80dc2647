"""Routing replay measured: a bf16 sampler and an fp32 trainer route sampled tokens, replay off vs on.

``python -m trace_jax.bench.routing [--seeds 5] [--prompts 8] [--tokens 32] [--out bench_results/routing.json]``
prints JSON. Per seed, a fresh tiny Qwen3-MoE (``qwen3-moe-tiny``, random init, ``fresh_params``) samples
``--prompts`` random prompts for ``--tokens`` tokens each on the decode engine with bf16 weights and bf16 compute
(``EngineConfig.routing_replay``: it records every sampled token's experts); the trainer's forward runs the
same rows in float32 (``trace_jax.rl.logprobs.policy_logprobs`` on the ``TrainBatch`` the trees give), once
without the record and once replaying it. Reported per setting (median over seeds, and each seed's value):

* ``decisions_differ``: share of (sampled token, sparse layer) pairs whose top-k expert set in the trainer's
  forward differs from the sampler's record;
* ``tokens_differ``: share of sampled tokens that differ in at least one sparse layer;
* ``mean_abs_logprob_gap`` / ``max_abs_logprob_gap``: |behaviour - train| log-prob over sampled tokens;
* ``max_ratio``: the largest importance ratio ``exp(train - behaviour)`` at the first PPO step.

This bench replays the sampled tokens' routing only: prompt tokens are routed by the trainer in both settings
(``trace_jax.bench.routing_context`` adds the engine's record of the prompt), and the bf16 rounding of everything
else (attention, experts, LM head) stays, so the log-prob gap does not reach zero. ``measure`` is also what the
tests call (with a perturbed router instead of bf16).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax.bench.report import emit
from trace_jax.models import MoeConfig, abstract_model, create_model
from trace_jax.rl.advantages import compute_advantages
from trace_jax.rl.batch import BatchConfig, TrainBatch, build_batch
from trace_jax.rl.logprobs import policy_logprobs
from trace_jax.rollout.engine.engine import AppendResult, Engine, EngineConfig
from trace_jax.rollout.tree import ROOT, RolloutTree


def recording_engine(sampler_config: MoeConfig, *, prompts: int, tokens: int, prompt_len: int = 8) -> Engine:
    """A decode engine running ``sampler_config``'s numerics (weights cast to its ``param_dtype``) for
    ``prompts`` prompts of ``prompt_len`` ids and ``tokens`` sampled tokens each, recording the routing."""
    engine_config = EngineConfig(
        max_slots=prompts,
        max_len=prompt_len + tokens,
        steps_per_call=tokens,
        max_turn_tokens=tokens,
        length_buckets=(prompt_len + tokens,),
        row_buckets=(prompts,),
        append_chunk=0,
        page_size=0,
        weight_dtype=sampler_config.param_dtype,
        routing_replay=True,
    )
    return Engine(abstract_model(sampler_config)[0], sampler_config, engine_config)


def sample_trees(
    engine: Engine, params: Any, seed: int, prompt_len: int = 8, context: bool = False
) -> list[RolloutTree]:
    """One single-turn tree per slot of ``engine`` (``recording_engine``), sampled with ``params`` from random
    prompts, each turn with its behaviour log-probs and routing record; ``context``: each root also keeps the
    prompt's routing as the engine's prefill recorded it (else the prompt has no record)."""
    prompts, vocab = engine.config.max_slots, engine.model_config.vocab_size
    engine.set_params(params)
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab, (prompts, prompt_len))
    state, prefill = engine.insert(None, engine.init_decode_state(), ids.tolist(), range(prompts), range(prompts))
    _, out = engine.generate(None, state)
    prefill_routing = np.asarray(prefill.routing) if context else None
    trees = []
    for slot in range(prompts):
        n = int(out.num_tokens[slot])
        tree = RolloutTree(ids[slot], prompt_index=slot)
        tree.add_turn(
            ROOT,
            out.tokens[slot, :n],
            logprobs=out.logprobs[slot, :n],
            sample_logprobs=out.sample_logprobs[slot, :n],
            entropies=out.entropies[slot, :n],
            reward=float(slot % 2),
            routed_experts=out.routing[slot, :n],
        )
        if context:
            first, experts = AppendResult.item_routing(prefill_routing, prefill.routing_spans[slot])
            tree.record_routing(ROOT, experts, first)
        trees.append(tree)
    return trees


def replay_batch(trees: list[RolloutTree], length: int) -> TrainBatch:
    """One row per tree (the "paths" layout), ``length`` tokens long, with the trees' routing records."""
    config = BatchConfig(layout="paths", length_buckets=(length,), row_buckets=None)
    return build_batch(trees, compute_advantages("grpo", trees), config)[0]


@functools.cache
def _trainer_fns(graphdef: Any) -> tuple[Any, Any]:
    """Jitted (routing, log-probs) of the trainer's forward for ``graphdef`` (compiled once per model)."""

    def routing(params: Any, batch: TrainBatch) -> jax.Array:
        model = nnx.merge(graphdef, params)
        replayed = {} if batch.routing is None else {"routing_btlk": batch.routing}
        hidden = model.forward_hidden(
            batch.tokens,
            positions_bt=batch.positions,
            kv_visible_end_bt=batch.visible_end,
            record_routing=True,
            **replayed,
        )
        return hidden[2].experts_btlk

    return jax.jit(routing), jax.jit(lambda params, batch: policy_logprobs(graphdef, params, batch)[0])


def compare(graphdef: Any, params: Any, batch: TrainBatch, replay: bool) -> dict[str, float]:
    """Sampler (the batch's record and behaviour log-probs) against the trainer's forward under ``params``."""
    sampled = np.asarray(batch.routing)[..., 0, 0] >= 0  # [B, T]: tokens with a record
    recorded = np.sort(np.asarray(batch.routing)[sampled], axis=-1)  # [n, layers, k] as sets
    routing_fn, logprobs_fn = _trainer_fns(graphdef)
    rows = jax.tree.map(jnp.asarray, batch if replay else batch._replace(routing=None))
    trained = np.sort(np.asarray(routing_fn(params, rows))[sampled], axis=-1)
    differ_nl = np.any(recorded != trained, axis=-1)
    train_lp = np.asarray(logprobs_fn(params, rows))[sampled]
    gap = train_lp - np.asarray(batch.old_logprobs)[sampled]
    return {
        "decisions_differ": float(differ_nl.mean()),
        "tokens_differ": float(differ_nl.any(axis=-1).mean()),
        "mean_abs_logprob_gap": float(np.abs(gap).mean()),
        "max_abs_logprob_gap": float(np.abs(gap).max()),
        "max_ratio": float(np.exp(gap).max()),
        "sampled_tokens": int(sampled.sum()),
    }


def measure(
    engine: Engine, trainer_config: MoeConfig, params: Any, *, seed: int, trainer_params: Any = None
) -> dict[str, dict[str, float]]:
    """``{"replay_off": compare(...), "replay_on": compare(...)}`` for one sampled batch: ``engine``
    (``recording_engine``) samples with ``params``; ``trainer_config``'s numerics train with
    ``trainer_params`` (default ``params``)."""
    trees = sample_trees(engine, params, seed)
    batch = replay_batch(trees, length=engine.config.max_len)
    graphdef = abstract_model(trainer_config)[0]
    trainer_params = params if trainer_params is None else trainer_params
    return {
        f"replay_{name}": compare(graphdef, trainer_params, batch, replay)
        for name, replay in (("off", False), ("on", True))
    }


def fresh_params(config: MoeConfig, seed: int) -> Any:
    """A random ``config`` policy whose (tied) embedding has std ``1 / sqrt(hidden)``, so its logits have
    std ~1: the unit-std init makes a tiny model's sampling all but deterministic (log-probs ~0)."""
    model = create_model(config, nnx.Rngs(seed))
    model.embed.value = model.embed.value / np.sqrt(config.hidden_size)
    return nnx.split(model, nnx.Param)[1]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="fresh models (and prompts); medians reported")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32, help="sampled tokens per prompt")
    parser.add_argument("--model", default="qwen3-moe-tiny", help="a MoeConfig preset")
    parser.add_argument("--out", default="bench_results/routing.json")
    args = parser.parse_args(argv)
    trainer = MoeConfig.preset(args.model)  # float32 weights and compute
    sampler = dataclasses.replace(trainer, dtype="bfloat16", param_dtype="bfloat16")
    engine = recording_engine(sampler, prompts=args.prompts, tokens=args.tokens)
    runs = [measure(engine, trainer, fresh_params(trainer, seed), seed=seed) for seed in range(args.seeds)]
    results: dict[str, Any] = {
        "model": args.model,
        "sampler": "bf16 weights and compute (engine)",
        "trainer": "fp32 weights and compute",
        "seeds": args.seeds,
        "prompts": args.prompts,
        "tokens_per_prompt": args.tokens,
        "backend": jax.default_backend(),
    }
    for setting in ("replay_off", "replay_on"):
        results[setting] = {
            key: {
                "median": float(np.median([r[setting][key] for r in runs])),
                "per_seed": [r[setting][key] for r in runs],
            }
            for key in runs[0][setting]
        }
    return emit(results, args.out)


if __name__ == "__main__":
    main()
