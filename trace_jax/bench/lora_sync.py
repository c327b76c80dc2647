"""Bytes a weight sync hands the engine: the whole policy, or only its LoRA adapters.

    python -m trace_jax.bench.lora_sync [--rank 8] [--presets qwen3-tiny,qwen3-8b] [--param-dtype bfloat16] [--out F]

What a sync after the first sends is what the job sends (``Training._set_engine_weights``): ``lora.trained_part``
of the policy, the adapters alone. A preset small enough to build (``--build-below`` parameters) is initialised,
synced whole into a decode engine, then synced again with that payload: the bytes counted are those of the arrays
handed to ``Engine.set_params``, and the engine is checked to hold every weight of the policy afterwards. A larger
preset is counted from its abstract state (``nnx.eval_shape``: shapes and dtypes, nothing allocated), which is the
same arithmetic without the memory.
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import numpy as np
from flax import nnx

from trace_jax.bench.report import emit, machine
from trace_jax.models import ModelConfig, abstract_model, create_model
from trace_jax.models.lora import trained_part
from trace_jax.rollout.engine import Engine, EngineConfig


def _nbytes(state: Any) -> int:
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state)))


def sync_bytes(config: ModelConfig, build: bool) -> dict[str, Any]:
    """Full-policy and adapter-only bytes of ``config`` (which carries ``lora_rank``)."""
    params = nnx.split(create_model(config, nnx.Rngs(0)), nnx.Param)[1] if build else abstract_model(config)[1]
    adapters = trained_part(params)  # what the job sends after its first sync
    full = _nbytes(params) - _nbytes(adapters)  # the policy a full fine-tune syncs: no adapters in it
    if build:  # the real calls: a whole sync, then the adapters alone; the engine then holds the whole policy
        engine = Engine.for_model(config, EngineConfig(max_slots=1, max_len=16, page_size=8, weight_dtype=None))
        engine.set_params(params)
        held = engine.set_params(adapters)
        assert jax.tree.structure(held) == jax.tree.structure(params)
    return {
        "counted": "arrays" if build else "abstract shapes",
        "param_dtype": config.param_dtype,
        "full_bytes": full,
        "lora_bytes": _nbytes(adapters),
        "lora_params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(adapters))),
        "ratio": _nbytes(adapters) / full,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--targets", default="q,k,v,o,gate,up,down")
    parser.add_argument("--presets", default="qwen3-tiny,qwen3-8b")
    parser.add_argument("--param-dtype", default=None, help="override the presets' param dtype (e.g. bfloat16)")
    parser.add_argument("--build-below", type=int, default=10_000_000, help="build presets with fewer params")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    results = {}
    for name in args.presets.split(","):
        fields = dict(lora_rank=args.rank, lora_alpha=args.alpha, lora_targets=args.targets)
        if args.param_dtype:
            fields["param_dtype"] = args.param_dtype
        config = ModelConfig.preset(name, **fields)
        params = abstract_model(config.without_lora)[1]
        small = sum(np.prod(x.shape) for x in jax.tree.leaves(params)) < args.build_below
        results[name] = sync_bytes(config, build=small)
    return emit({"rank": args.rank, "targets": args.targets, "presets": results, "machine": machine()}, args.out)


if __name__ == "__main__":
    main()
