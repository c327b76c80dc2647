"""int8 KV cache against the bf16 cache: greedy agreement and the sampler-trainer log-prob gap (random weights).

``python -m trace_jax.bench.kv_int8 [--model qwen3-0.6b] [--slots 8] [--prompt 16] [--new 32]
[--out bench_results/kv_int8.json]`` prints JSON (also written to ``--out``).

For each cache dtype (``bfloat16``, ``int8``) one engine samples with the model's weights in bf16 and bf16
compute (the sampler as the job runs it), the model's config otherwise; random weights (tied embeddings scaled
by 0.05, as the tests do: unit-variance ones give peaky argmaxes), random prompts, the same seeds both ways.

- Greedy agreement: each row decoded greedily with each cache; ``greedy.token_agreement`` is the share of
  positions where the int8 row equals the bf16 row, ``greedy.first_divergence`` each row's first differing
  position (``new`` if none).
- Log-prob gap: rows sampled at temperature 1 with each cache; the trainer's log-probs of the sampled tokens
  are recomputed by a float32 forward of prompt + sample (what ``UpdateConfig.behaviour_logprobs="recompute"``
  does); ``gap`` = sampler - trainer per token: mean and max of ``|gap|`` and the share of tokens whose
  first-step PPO ratio ``exp(-gap)`` leaves ``[1 - clip, 1 + clip]`` (``--clip``, the loss's default 0.2),
  which ``behaviour_logprobs="sampler"`` would clip at the first step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax.bench.report import machine
from trace_jax.models import ModelConfig, abstract_model, create_model
from trace_jax.rollout.engine.engine import Engine, EngineConfig

CACHE_DTYPES = ("bfloat16", "int8")


def random_params(config: ModelConfig, seed: int) -> nnx.State:
    """float32 random weights of ``config``, the tied embedding scaled by 0.05."""
    params = nnx.split(
        create_model(dataclasses.replace(config, dtype="float32", param_dtype="float32"), nnx.Rngs(seed)), nnx.Param
    )[1]
    params["embed"][...] = params["embed"][...] * 0.05
    return params


def sample(
    config: ModelConfig, params: nnx.State, cache_dtype: str, prompts: list[list[int]], new: int, greedy: bool
) -> tuple[np.ndarray, np.ndarray]:
    """int32 tokens and float32 sampler log-probs [rows, new] of one engine with a ``cache_dtype`` cache."""
    rows, longest = len(prompts), max(len(p) for p in prompts)
    max_len = -(-(longest + new) // 16) * 16
    engine_config = EngineConfig(
        max_slots=rows, max_len=max_len, steps_per_call=new, max_turn_tokens=new, length_buckets=(max_len,),
        row_buckets=(rows,), append_row_buckets=(rows * -(-max_len // 32),), append_windows=(max_len,),
        weight_dtype="bfloat16", cache_dtype=cache_dtype,
    )  # fmt: skip
    sampler = dataclasses.replace(config, dtype="bfloat16")
    engine = Engine(abstract_model(sampler)[0], sampler, engine_config)
    engine.set_params(params)
    state = engine.init_decode_state()
    state, _ = engine.insert(None, state, prompts, list(range(rows)), list(range(rows)), greedy=greedy)
    _, out = engine.generate(None, state)
    assert (out.num_tokens == new).all(), out.num_tokens  # no EOS in a random model's vocabulary here
    return out.tokens, out.logprobs


def trainer_logprobs(
    config: ModelConfig, params: nnx.State, prompts: list[list[int]], tokens: np.ndarray
) -> np.ndarray:
    """float32 log-probs [rows, new] of ``tokens`` after each prompt under a float32 forward (one row at a time)."""
    graphdef = abstract_model(dataclasses.replace(config, dtype="float32", param_dtype="float32"))[0]

    @jax.jit
    def row_logprobs(params, ids_t, targets_n):
        model = nnx.merge(graphdef, params)
        hidden_td = model.hidden(ids_t[None])[0][0]
        n = targets_n.shape[0]
        logits_nv = model.logits(hidden_td[-n - 1 : -1])
        return jnp.take_along_axis(jax.nn.log_softmax(logits_nv, axis=-1), targets_n[:, None], axis=-1)[:, 0]

    return np.stack(
        [
            np.asarray(row_logprobs(params, jnp.asarray([*p, *t], jnp.int32), jnp.asarray(t)))
            for p, t in zip(prompts, tokens, strict=True)
        ]
    )


def gap_stats(gap: np.ndarray, clip: float) -> dict[str, float]:
    ratio = np.exp(-gap)
    return {
        "mean_abs": float(np.abs(gap).mean()),
        "max_abs": float(np.abs(gap).max()),
        "clipped_share": float(((ratio < 1 - clip) | (ratio > 1 + clip)).mean()),
    }


def run(model: str, slots: int, prompt: int, new: int, clip: float, seed: int = 0) -> dict[str, Any]:
    config = ModelConfig.preset(model)
    params = random_params(config, seed)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, config.vocab_size, prompt).tolist() for _ in range(slots)]
    start = time.perf_counter()
    greedy = {dtype: sample(config, params, dtype, prompts, new, greedy=True)[0] for dtype in CACHE_DTYPES}
    same = greedy["int8"] == greedy["bfloat16"]
    first = [int(np.argmin(row)) if not row.all() else new for row in same]
    result: dict[str, Any] = {
        "model": model,
        "shape": {
            k: getattr(config, k)
            for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size")
        },
        "slots": slots,
        "prompt": prompt,
        "new": new,
        "greedy": {
            "token_agreement": float(same.mean()),
            "rows_identical": int(same.all(axis=1).sum()),
            "first_divergence": first,
        },
        "gap": {},
    }
    for dtype in CACHE_DTYPES:
        tokens, sampler = sample(config, params, dtype, prompts, new, greedy=False)
        result["gap"][dtype] = gap_stats(sampler - trainer_logprobs(config, params, prompts, tokens), clip)
    result["clip"] = clip
    result["seconds"] = round(time.perf_counter() - start, 1)
    result["machine"] = machine()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b", help="a ModelConfig preset (random weights)")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=16, help="random prompt ids per row")
    parser.add_argument("--new", type=int, default=32, help="tokens sampled per row")
    parser.add_argument("--clip", type=float, default=0.2, help="PPO clip epsilon for the clipped share")
    parser.add_argument("--out", default="bench_results/kv_int8.json")
    args = parser.parse_args(argv)
    result = run(args.model, args.slots, args.prompt, args.new, args.clip)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
