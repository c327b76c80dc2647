"""Run in a subprocess with 8 fake CPU devices: the tiny MoE's logits on 2x2x2 meshes with an expert axis."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tests.parallel.optimizer_sharding_check import per_device_bytes
from trace_jax.models import PRESETS, create_model
from trace_jax.optim import init_sharded, make_optimizer
from trace_jax.parallel import mesh as mesh_lib

# (data, fsdp, expert, tensor) layouts of 8 devices, each with experts split in two.
MESHES = {"data-fsdp-expert": (2, 2, 2, 1), "fsdp-expert-tensor": (1, 2, 2, 2), "data-expert-tensor": (2, 1, 2, 2)}


def main() -> None:
    assert len(jax.devices()) == 8, jax.devices()
    # A dense layer between two sparse ones, so both stacks and the run-by-run scan are sharded.
    base = dataclasses.replace(PRESETS["qwen3-moe-tiny"], vocab_size=128, num_layers=3, mlp_only_layers=(1,))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (8, 9)))
    out = {}
    for compute in ("grouped", "dense"):
        config = dataclasses.replace(base, expert_compute=compute)
        model = create_model(config, nnx.Rngs(0))
        graphdef, params = nnx.split(model, nnx.Param)
        single = np.asarray(model(ids).logits_btv)

        @jax.jit
        def forward(p, tokens, graphdef=graphdef):
            return nnx.merge(graphdef, p)(tokens).logits_btv

        for name, (data, fsdp, expert, tensor) in MESHES.items():
            mesh = mesh_lib.make_mesh(data, fsdp, tensor, expert=expert)
            sharded_params = mesh_lib.shard_state(params, mesh)
            with jax.set_mesh(mesh):
                logits = forward(sharded_params, jax.device_put(ids, mesh_lib.batch_sharding(mesh)))
            gate = sharded_params["moe_layers"]["mlp"]["gate_proj"].get_value()
            replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            opt_state = init_sharded(make_optimizer(weight_decay=0.1), sharded_params, replicated)
            out[f"{compute}/{name}"] = {
                "max_diff": float(np.abs(np.asarray(logits) - single).max()),
                "gate_proj_spec": str(gate.sharding.spec),
                "gate_proj_shard_shape": list(gate.addressable_shards[0].data.shape),
                "param_bytes_per_device": per_device_bytes(sharded_params),
                "optimizer_bytes_per_device": per_device_bytes(opt_state),
                "param_bytes_total": sum(x.nbytes for x in jax.tree.leaves(sharded_params)),
            }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
