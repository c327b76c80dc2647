"""How far a quantized frozen base (QLoRA's) moves the policy's logits, beside a bfloat16 base.

    python -m trace_jax.bench.qlora_error [--warm-start DIR] [--rows 8] [--len 64] [--out F]

The policy is the SFT warm start in ``DIR`` (``~/.cache/trace_jax/warm_start/<key>``: the qwen3-tiny the default job
trains, vocabulary 1,024) or, without it, a random-init qwen3-tiny. Its float32 logits on random token rows are the
reference; each variant replaces the weights of every LoRA-targeted projection (what QLoRA freezes and quantizes:
q, k, v, o, gate, up, down; embeddings, norms and the head stay float32) by

- ``bfloat16``: the weights rounded to bfloat16;
- ``int8`` / ``int4``: symmetric absmax integers per output channel of each layer (one float32 scale per output
  column: ``trace_jax.models.lora.quantize``, what ``lora.base_quant`` stores), dequantized to float32;
- ``int4_g32``: int4 with one scale per group of 32 consecutive input rows of each output column (group-wise
  scales, as 4-bit QLoRA formats use; the input axes flattened).

Reported per variant: the largest and mean absolute logit error, the error relative to the reference logits' spread
(standard deviation), and the fraction of positions whose argmax token is unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax.bench.report import emit, machine
from trace_jax.checkpoint.state import StateCheckpointer
from trace_jax.models import ModelConfig, abstract_model, create_model
from trace_jax.models.lora import TARGETS, dequantize, quantize


def per_channel(w: jax.Array, bits: int, in_axes: int) -> jax.Array:
    """``w`` (``[l, *in, *out]``) through ``lora.quantize`` (``bits`` bits, a scale per output channel) and back."""
    return dequantize(*quantize(w, bits, in_axes))


def group_wise(w: jax.Array, bits: int, in_axes: int, group: int) -> jax.Array:
    """``w`` (``[l, *in, *out]``) through ``bits``-bit integers with a scale per ``group`` consecutive input rows
    (the input axes flattened) of each output column, and back."""
    shape = w.shape
    fan_in = math.prod(shape[1 : 1 + in_axes])
    return per_channel(w.reshape(shape[0] * fan_in // group, group, -1), bits, 1).reshape(shape)


VARIANTS = {
    "bfloat16": lambda w, in_axes: w.astype(jnp.bfloat16).astype(jnp.float32),
    "int8": lambda w, in_axes: per_channel(w, 8, in_axes),
    "int4": lambda w, in_axes: per_channel(w, 4, in_axes),
    "int4_g32": lambda w, in_axes: group_wise(w, 4, in_axes, 32),
}
# A projection's input axes after the layers axis (the models' ``LORA_TARGETS``).
_IN_AXES = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2, "gate_proj": 1, "up_proj": 1, "down_proj": 1}


def _policy(warm_start: str | None) -> tuple[ModelConfig, Any]:
    if not warm_start:
        config = ModelConfig.preset("qwen3-tiny")
        return config, nnx.split(create_model(config, nnx.Rngs(0)), nnx.Param)[1]
    config = ModelConfig.preset("qwen3-tiny", vocab_size=1024)
    target = abstract_model(config)[1]
    restored = StateCheckpointer(f"{warm_start}/sft").restore_latest(target={"params": target}, keys=["params"])
    if restored is None:
        raise SystemExit(f"--warm-start {warm_start} holds no sft checkpoint")
    return config, restored.state["params"]


def _with_base(params: Any, variant: str) -> Any:
    def one(path: tuple[Any, ...], x: jax.Array) -> jax.Array:
        name = str(path[-1])
        return VARIANTS[variant](x, _IN_AXES[name]) if name in TARGETS.values() else x

    return nnx.map_state(one, params)


def measure(config: ModelConfig, params: Any, rows: int, length: int) -> dict[str, Any]:
    graphdef = abstract_model(config)[0]
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (rows, length)), jnp.int32)
    logits = lambda p: np.asarray(nnx.merge(graphdef, p)(tokens).logits_btv, np.float64)
    reference = logits(params)
    out = {}
    for variant in VARIANTS:
        got = logits(_with_base(params, variant))
        error = np.abs(got - reference)
        out[variant] = {
            "max_abs_error": float(error.max()),
            "mean_abs_error": float(error.mean()),
            "max_error_over_logit_std": float(error.max() / reference.std()),
            "argmax_agreement": float(np.mean(got.argmax(-1) == reference.argmax(-1))),
        }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warm-start", default=None, help="a warm-start cache entry (its sft/ checkpoint)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--len", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    config, params = _policy(args.warm_start)
    config = dataclasses.replace(config, dtype="float32", param_dtype="float32")
    result = {
        "policy": args.warm_start or "random-init qwen3-tiny",
        "rows": args.rows,
        "len": args.len,
        "variants": measure(config, params, args.rows, args.len),
        "machine": machine(),
    }
    return emit(result, args.out)


if __name__ == "__main__":
    main()
