"""Run in a subprocess with 8 fake CPU devices (XLA_FLAGS must be set before jax is imported)."""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax.checkpoint.hf import load_hf
from trace_jax.models import Qwen, abstract_model
from trace_jax.parallel import mesh as mesh_lib


def main(hf_dir: str) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    mesh = mesh_lib.make_mesh(data=2, fsdp=2, tensor=2)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (4, 9)))

    config, params = load_hf(hf_dir)
    graphdef = abstract_model(config)[0]
    single = nnx.merge(graphdef, params)(ids).logits_btv

    _, sharded_params = load_hf(hf_dir, mesh=mesh)

    @jax.jit
    def forward(p, tokens):
        return nnx.merge(graphdef, p)(tokens).logits_btv

    with jax.set_mesh(mesh):
        sharded = forward(sharded_params, jax.device_put(ids, mesh_lib.batch_sharding(mesh)))
    specs = {
        ".".join(map(str, path)): str(v.get_value().sharding.spec) for path, v in nnx.to_flat_state(sharded_params)
    }
    random_model = mesh_lib.create_sharded(lambda: Qwen(config, rngs=nnx.Rngs(0)), mesh)
    random_spec = str(random_model.layers.mlp.up_proj.get_value().sharding.spec)
    shard_shape = sharded_params["layers"]["mlp"]["up_proj"].get_value().addressable_shards[0].data.shape
    print(
        json.dumps(
            {
                "max_diff": float(np.abs(np.asarray(sharded) - np.asarray(single)).max()),
                "specs": specs,
                "random_up_proj_spec": random_spec,
                "up_proj_shard_shape": list(shard_shape),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
