"""Run in a subprocess with 4 fake CPU devices: the tiny MoE's engine on a (data 2, expert 2) mesh with the
model's ``gather`` dispatch and with ``engine.expert_dispatch="all_to_all"``, greedy, float32.

The engine's CPU programs are traced without the mesh (``Engine``), where every dispatch runs as the plain
compute; here each call runs under the mesh's abstract mesh, as the engine's TPU programs are traced, so the
dispatch really exchanges rows. Prints one JSON line: per dispatch, the tokens, their log-probs, the model
config's dispatch and whether the lowered decode program holds an all-to-all.
"""

import dataclasses
import json

import jax
from flax import nnx

from trace_jax.models import PRESETS, create_model
from trace_jax.parallel import mesh as mesh_lib
from trace_jax.rollout.engine.engine import Engine, EngineConfig
from trace_jax.rollout.engine.layout import SamplingLayout
from trace_jax.rollout.engine.sampling import SamplingConfig

CONFIG = dataclasses.replace(
    PRESETS["qwen3-moe-tiny"],
    vocab_size=128,
    num_layers=2,
    num_experts=8,
    num_experts_per_tok=2,
    tie_word_embeddings=False,  # tied, the random model repeats its last token with log-prob ~0
)
PROMPTS = [[5, 17, 3, 99, 42, 8, 1], [64, 2], [11, 12, 13, 14, 15, 16, 17, 18], [7, 7, 7, 30]]


def run(dispatch: str, mesh, params) -> dict:
    engine_config = EngineConfig(
        max_slots=4, max_len=32, steps_per_call=8, max_turn_tokens=8, page_size=8, length_buckets=(32,),
        row_buckets=(4,), sampling=SamplingConfig.make_greedy(), weight_dtype=None, cache_dtype="float32",
        expert_dispatch=dispatch,
    )  # fmt: skip
    engine = Engine.for_model(CONFIG, engine_config, SamplingLayout(mesh))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        engine.set_params(params)
        state = engine.init_decode_state()
        state, _ = engine.insert(None, state, PROMPTS, [0, 1, 2, 3], [0, 1, 2, 3])
        state, out = engine.generate(None, state)
        hlo = engine.lower_generate().as_text()
    return {
        "tokens": [out.tokens[b, : out.num_tokens[b]].tolist() for b in range(4)],
        "logprobs": [out.logprobs[b, : out.num_tokens[b]].tolist() for b in range(4)],
        "model_dispatch": engine.model_config.expert_dispatch,
        "all_to_all_in_decode": "all_to_all" in hlo,
    }


def main() -> None:
    assert len(jax.devices()) == 4, jax.devices()
    assert CONFIG.expert_dispatch == "gather", "premise: the model's own dispatch is gather"
    mesh = mesh_lib.make_mesh(data=2, fsdp=1, expert=2)
    params = mesh_lib.shard_state(nnx.split(create_model(CONFIG, nnx.Rngs(0)), nnx.Param)[1], mesh)
    print(json.dumps({dispatch: run(dispatch, mesh, params) for dispatch in ("", "all_to_all")}))


if __name__ == "__main__":
    main()
