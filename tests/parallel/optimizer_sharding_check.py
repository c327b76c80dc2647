"""Run by test_optimizer_sharding.py in a fresh interpreter with 8 fake CPU devices (XLA_FLAGS set by the caller).

On a (fsdp=4, tensor=2) mesh: every optimizer-state leaf that mirrors a parameter has exactly that parameter's
sharding after ``init_state``, after one ``update`` step and after a checkpoint restore, and the per-device optimizer
bytes stay within 2.1x the per-device parameter bytes (Adam: two moments). Prints one JSON line.
"""

import collections
import json
import tempfile

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from tests.helpers import abstract_like
from tests.rl.test_trainer import CONFIG, _batch
from trace_jax.checkpoint.state import StateCheckpointer
from trace_jax.models import Qwen
from trace_jax.optim import make_optimizer
from trace_jax.parallel.mesh import create_sharded, make_mesh
from trace_jax.rl.losses import LossConfig
from trace_jax.rl.trainer import RLTrainer, TrainState, UpdateConfig


def per_device_bytes(tree) -> int:
    """The most bytes any one device holds of the tree's arrays."""
    held: collections.Counter = collections.Counter()
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] += shard.data.nbytes
    return max(held.values())


def up_proj_spec(tree) -> str:
    """PartitionSpec of the (first) MLP up-projection in a params-shaped tree."""
    for path, variable in nnx.to_flat_state(tree):
        if path[-1] == "up_proj":
            return str(variable.get_value().sharding.spec)
    raise KeyError("no up_proj")


def mismatches(optimizer, state, replicated) -> list[str]:
    """Moments whose sharding differs from their parameter's, and other leaves not replicated on the mesh."""
    bad = []

    def check(kind, leaf, want):
        if leaf.sharding != want:
            bad.append(f"{kind}: {leaf.sharding} != {want}")
        return leaf

    optax.tree_map_params(
        optimizer,
        lambda leaf, want: check("moment", leaf, want),
        state.opt_state,
        jax.tree.map(lambda x: x.sharding, state.params),
        transform_non_params=lambda leaf: check("other", leaf, replicated),
    )
    return bad


def main():
    assert len(jax.devices()) == 8, jax.devices()
    mesh = make_mesh(fsdp=4, tensor=2)
    replicated = NamedSharding(mesh, PartitionSpec())
    graphdef, params = nnx.split(create_sharded(lambda: Qwen(CONFIG, rngs=nnx.Rngs(0)), mesh), nnx.Param)
    optimizer = make_optimizer(learning_rate=1e-3, weight_decay=0.1, schedule="constant")
    update = UpdateConfig(ppo_epochs=1, mini_batches=1)  # one optimizer step
    trainer = RLTrainer(
        graphdef, optimizer, LossConfig(kl_coef=0.05), mesh=mesh, reference_params=params, update=update
    )
    state = trainer.init_state(params, jax.random.key(0))
    mu = optax.tree_utils.tree_get(state.opt_state, "mu")  # Adam's first moment, a params-shaped tree
    report = {
        "after_init": mismatches(optimizer, state, replicated),
        "up_proj_spec": up_proj_spec(state.params),
        "up_proj_mu_spec": up_proj_spec(mu),
        "ratio": per_device_bytes(state.opt_state) / per_device_bytes(state.params),
        "reference_like_params": all(
            a.sharding == b.sharding
            for a, b in zip(jax.tree.leaves(trainer.reference_params), jax.tree.leaves(state.params), strict=True)
        ),
    }
    before = jax.tree.map(jnp.copy, state.opt_state)
    state, metrics = trainer.update(state, _batch(n_trees=4))
    report["update_applied"] = metrics["update_applied"]
    report["moments_moved"] = any(
        bool(jnp.any(a != b)) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.opt_state), strict=True)
    )
    report["after_step"] = mismatches(optimizer, state, replicated)
    with tempfile.TemporaryDirectory() as directory:
        checkpointer = StateCheckpointer(directory)
        checkpointer.save(1, state._asdict())
        restored = checkpointer.restore_latest(target=abstract_like(state._asdict())).state
        checkpointer.close()
    report["after_restore"] = mismatches(optimizer, TrainState(**restored), replicated)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
