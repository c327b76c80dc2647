"""Run in a subprocess with 8 fake CPU devices (XLA_FLAGS must be set before jax is imported): the engine in
the sampling layout on a (data 2, fsdp 2, tensor 2) mesh, against the same engine on one device."""

import json

import jax
import numpy as np
from flax import nnx

from trace_jax.models import ModelConfig, Qwen, abstract_model
from trace_jax.parallel import mesh as mesh_lib
from trace_jax.rollout.engine.engine import Engine, EngineConfig
from trace_jax.rollout.engine.layout import SamplingLayout
from trace_jax.rollout.engine.sampling import SamplingConfig

PROMPTS = [[5, 17, 3, 99, 42, 8, 1], [64, 2], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [7, 7, 7, 30]]


def run(engine: Engine, params) -> tuple[list, np.ndarray, object]:
    engine.set_params(params)
    state = engine.init_decode_state()
    state, result = engine.insert(None, state, PROMPTS, [0, 1, 2, 3], [0, 1, 2, 3], keep=True)
    state = engine.fork(state, result.prefixes[:2] * 2, [4, 5, 6, 7], [4, 5, 6, 7])
    state, out = engine.generate(None, state)
    state, more = engine.generate(None, state)
    tokens = [
        out.tokens[b, : out.num_tokens[b]].tolist() + more.tokens[b, : more.num_tokens[b]].tolist() for b in range(8)
    ]
    return tokens, out.logprobs, state


def main() -> None:
    assert len(jax.devices()) == 8, jax.devices()
    config = ModelConfig.preset("qwen3-tiny", vocab_size=128)
    mesh = mesh_lib.make_mesh(data=2, fsdp=2, tensor=2)
    train_params = mesh_lib.shard_state(nnx.split(Qwen(config, rngs=nnx.Rngs(0)), nnx.Param)[1], mesh)
    engine_config = EngineConfig(
        max_slots=8, max_len=32, steps_per_call=6, max_turn_tokens=12, page_size=8, length_buckets=(32,),
        row_buckets=(8,), sampling=SamplingConfig(temperature=1.0),
    )  # fmt: skip
    graphdef = abstract_model(config)[0]
    sharded = Engine(graphdef, config, engine_config, SamplingLayout(mesh))
    tokens, logprobs, state = run(sharded, train_params)
    compiled = sharded.programs.total
    sharded.set_params(jax.tree.map(lambda x: x * 1.0, train_params))  # a new policy: resharded, not recompiled
    run(sharded, train_params)
    single_params = jax.device_put(train_params, jax.devices()[0])
    single = Engine(graphdef, config, engine_config)
    single_tokens, single_logprobs, _ = run(single, single_params)

    weights = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(sharded.params):
        name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        weights[name] = {
            "spec": str(leaf.sharding.spec), "dtype": str(leaf.dtype), "shape": list(leaf.shape),
            "shard": list(leaf.addressable_shards[0].data.shape),
        }  # fmt: skip
    train_specs = {
        ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): str(leaf.sharding.spec)
        for path, leaf in jax.tree_util.tree_leaves_with_path(train_params)
    }
    cache = {
        name: {"spec": str(x.sharding.spec), "shape": list(x.shape), "shard": list(x.addressable_shards[0].data.shape)}
        for name, x in zip(state.device._fields, state.device, strict=True)
        if x is not None  # the int8 cache's scale pools, absent with a float cache
    }
    print(
        json.dumps(
            {
                "weights": weights,
                "train_specs": train_specs,
                "cache": cache,
                "same_tokens": tokens == single_tokens,
                "max_logprob_diff": float(np.max(np.abs(logprobs - single_logprobs))),
                "compiled_first": compiled,
                "compiled_after_new_params": sharded.programs.total,
            }
        )
    )


if __name__ == "__main__":
    main()
