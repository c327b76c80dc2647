"""Run in a subprocess with 8 fake CPU devices: the tiny MoE's logits and gradients with each expert dispatch.

Prints one JSON line: per (routing, mesh, dispatch), the largest differences of the logits and of every
gradient (relative to that gradient's largest entry) from one device and from the ``gather`` dispatch on the
same mesh, and the expert shards the routing sends rows to.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax.models import PRESETS, create_model
from trace_jax.parallel import mesh as mesh_lib

# (data, fsdp, expert, tensor) layouts of 8 devices.
MESHES = {"fsdp2-expert4": (1, 2, 4, 1), "fsdp2-expert2-tensor2": (1, 2, 2, 2)}
CONFIG = dataclasses.replace(
    PRESETS["qwen3-moe-tiny"], vocab_size=128, num_layers=2, num_experts=8, num_experts_per_tok=2
)
B, T = 8, 6


def _routings() -> dict[str, np.ndarray | None]:
    """The router's own choice, and every token replayed onto experts 0 and 1 (both on shard 0 of any
    expert axis of size <= 4: all rows to one shard, the dropless worst case)."""
    skewed = np.broadcast_to(np.asarray([0, 1], np.int32), (B, T, len(CONFIG.sparse_layers), 2)).copy()
    return {"router": None, "skewed": skewed}


def _loss_fn(graphdef, projection):
    def loss(params, ids, routing):
        model = nnx.merge(graphdef, params)
        hidden, _, extra = model.forward_hidden(ids, routing_btlk=routing, record_routing=True)
        logits = model.logits(hidden)
        return jnp.sum(logits * projection), (logits, extra.experts_btlk)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def _flat(grads) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(grads)}


def _diffs(a, b) -> tuple[float, float]:
    """Largest differences of the logits and of each gradient, relative to the reference's largest entry."""
    logits = float(np.abs(a[0] - b[0]).max() / np.abs(b[0]).max())
    ga, gb = _flat(a[1]), _flat(b[1])
    grads = max(float(np.abs(ga[k] - gb[k]).max() / max(np.abs(gb[k]).max(), 1e-30)) for k in gb)
    return logits, grads


def main() -> None:
    assert len(jax.devices()) == 8, jax.devices()
    ids = jnp.asarray(np.random.default_rng(0).integers(0, CONFIG.vocab_size, (B, T)))
    projection = jnp.asarray(np.random.default_rng(1).normal(size=(B, T, CONFIG.vocab_size)), jnp.float32)
    out = {}
    for routing_name, routing in _routings().items():
        routing = None if routing is None else jnp.asarray(routing)
        reference = None
        for dispatch in ("gather", "all_to_all"):
            config = dataclasses.replace(CONFIG, expert_dispatch=dispatch)
            graphdef, params = nnx.split(create_model(config, nnx.Rngs(0)), nnx.Param)
            step = _loss_fn(graphdef, projection)
            if reference is None:  # one device: no mesh, every dispatch runs as the plain compute
                (_, (logits, _)), grads = step(params, ids, routing)
                reference = (np.asarray(logits), grads)
            for mesh_name, (data, fsdp, expert, tensor) in MESHES.items():
                mesh = mesh_lib.make_mesh(data, fsdp, tensor, expert=expert)
                with jax.set_mesh(mesh):
                    batch = jax.device_put(ids, mesh_lib.batch_sharding(mesh))
                    (_, (logits, record)), grads = step(mesh_lib.shard_state(params, mesh), batch, routing)
                    lowered = step.lower(mesh_lib.shard_state(params, mesh), batch, routing).as_text()
                result = (np.asarray(logits), jax.device_get(grads))
                shards = np.unique(np.asarray(record) // (config.num_experts // expert))
                entry = {"shards_receiving": shards.tolist(), "experts_recorded": np.unique(record).tolist()}
                entry["all_to_all_ops"] = lowered.count("all_to_all")
                entry["logits_vs_one_device"], entry["grads_vs_one_device"] = _diffs(result, reference)
                gather = out.get(f"{routing_name}/{mesh_name}/gather", {}).get("_result")
                if gather is not None:
                    entry["logits_vs_gather"], entry["grads_vs_gather"] = _diffs(result, gather)
                out[f"{routing_name}/{mesh_name}/{dispatch}"] = {**entry, "_result": result}
    print(json.dumps({name: {k: v for k, v in entry.items() if k != "_result"} for name, entry in out.items()}))


if __name__ == "__main__":
    main()
