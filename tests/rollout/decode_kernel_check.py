"""Run in a subprocess with 4 fake CPU devices (XLA_FLAGS before jax is imported): the engine decoding through
the Pallas paged-attention kernel (TPU interpret mode) in ``shard_map`` on a (data 2, tensor 2) mesh, with
shard-local pages and forks across shards, against the reference engine on one device. Prints one JSON line."""

import json

import jax
import numpy as np
from flax import nnx

from trace_jax.models import ModelConfig, Qwen, abstract_model
from trace_jax.parallel import mesh as mesh_lib
from trace_jax.rollout.engine import pages
from trace_jax.rollout.engine.engine import AppendItem, Engine, EngineConfig
from trace_jax.rollout.engine.layout import SamplingLayout
from trace_jax.rollout.engine.sampling import SamplingConfig

# head_dim 128: the kernel's block rule; tiny otherwise.
CONFIG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=128)  # fmt: skip
CACHE_DTYPE = "bfloat16"  # the kernel computes on bf16 pages (see pages.DecodeKernel): the same values both ways
PROMPTS = [[5, 17, 3, 99, 42, 8, 1, 9, 4], [64, 2], [11, 12, 13, 14, 15, 16, 17, 18, 19], [7, 7, 7, 30]]


def run(engine: Engine, params) -> tuple[list, np.ndarray]:
    engine.set_params(params)
    state = engine.init_decode_state()
    # Slots 0..3 are shard 0's and 4..7 shard 1's: prompts in 0, 1, 4, 5; forks of slot 0 and 4 cross shards.
    state, result = engine.insert(None, state, PROMPTS, [0, 1, 4, 5], [0, 1, 2, 3], keep=True)
    state = engine.fork(state, [result.prefixes[0], result.prefixes[2]], [6, 2], [4, 5])
    state, out = engine.generate(None, state)
    state, _ = engine.append(None, state, [AppendItem(1, [40, 41, 42])])
    state, more = engine.generate(None, state)
    taken = lambda o, b: o.tokens[b, : o.num_tokens[b]].tolist()
    tokens = [taken(out, b) + taken(more, b) for b in range(8)]
    logprobs = np.concatenate([out.logprobs, more.logprobs], axis=1)
    return tokens, logprobs, state


def main() -> None:
    assert len(jax.devices()) == 4, jax.devices()
    params = nnx.split(Qwen(CONFIG, rngs=nnx.Rngs(3)), nnx.Param)[1]
    params["embed"][...] = params["embed"][...] * 0.05  # unit-variance tied embeddings give peaky argmaxes
    engine_config = EngineConfig(
        max_slots=8, max_len=24, steps_per_call=4, max_turn_tokens=8, page_size=8, length_buckets=(24,),
        row_buckets=(8,), append_row_buckets=(8,), append_windows=(24,), sampling=SamplingConfig.make_greedy(),
        weight_dtype=None, cache_dtype=CACHE_DTYPE,
    )  # fmt: skip
    graphdef = abstract_model(CONFIG)[0]
    mesh = mesh_lib.make_mesh(data=2, fsdp=1, tensor=2)
    pages.KERNEL_INTERPRET = True
    kernel_engine = Engine(graphdef, CONFIG, engine_config, SamplingLayout(mesh))
    pages.KERNEL_INTERPRET = False
    tokens, logprobs, state = run(kernel_engine, mesh_lib.shard_state(params, mesh))
    hlo = kernel_engine.lower_generate().as_text()
    reference = Engine(graphdef, CONFIG, engine_config)
    ref_tokens, ref_logprobs, _ = run(reference, jax.device_put(params, jax.devices()[0]))
    print(
        json.dumps(
            {
                "decode_attention": kernel_engine.decode_attention,
                "reference_attention": reference.decode_attention,
                "shards": state.pool.shards,
                "shard_pages": state.pool.shard_pages,
                "tables": state.pool.table.tolist(),
                "cross_shard_copies": kernel_engine.counters["cross_shard_page_copies"],
                "tokens": tokens,
                "ref_tokens": ref_tokens,
                "max_logprob_diff": float(np.abs(logprobs - ref_logprobs).max()),
                "shard_map_in_hlo": "shard_map" in hlo or "sdy.manual_computation" in hlo,
            }
        )
    )


if __name__ == "__main__":
    main()
