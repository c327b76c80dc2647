"""Run by test_trainer.py in a fresh interpreter with 8 fake CPU devices (XLA_FLAGS set by the caller).

Checks that three ``update`` calls (one optimizer step each, its gradient accumulated over two micro-batches of
four rows) on a 2×2×2 (data, fsdp, tensor) mesh give the params of the same steps on one device, that the state
keeps its shardings, and that a checkpoint of the sharded state restores into the same shardings.
Prints SHARDED_OK on success.
"""

import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tests.helpers import abstract_like
from tests.rl.test_trainer import CONFIG, _batch, _trainer
from trace_jax.checkpoint.state import StateCheckpointer
from trace_jax.models import Qwen
from trace_jax.parallel.mesh import create_sharded, make_mesh
from trace_jax.rl.losses import LossConfig
from trace_jax.rl.trainer import UpdateConfig

# Four rows a micro-batch: one per batch shard of both meshes (data 2 x fsdp 2; 2 slices x fsdp 2 or fsdp 4).
MICRO_ROWS = 4


def run(mesh, batch, steps=3):
    factory = lambda: Qwen(CONFIG, rngs=nnx.Rngs(0))
    model = factory() if mesh is None else create_sharded(factory, mesh)
    graphdef, params = nnx.split(model, nnx.Param)
    loss = LossConfig(kl_coef=0.05, entropy_coef=0.01, dual_clip=3.0)
    reference = jax.tree.map(jnp.copy, params)
    # Adam's early steps are ~lr·sign(g): where a gradient is at float32 noise level the sign depends on the
    # reduction order, which sharding changes. A larger eps makes the update proportional to g there.
    # The sharded run also uses the chunked LM head, so it is checked against the plain one as well.
    chunk = 64 if mesh is None else 8
    update = UpdateConfig(ppo_epochs=1, mini_batches=1, micro_rows=MICRO_ROWS)
    trainer = _trainer(
        graphdef, eps=1e-4, mesh=mesh, loss=loss, reference_params=reference, logprob_chunk=chunk, update=update
    )
    state = trainer.init_state(params, jax.random.key(0))
    for _ in range(steps):
        state, metrics = trainer.update(state, batch)
        assert metrics["update_applied"] == 1.0 and metrics["micro_batches"] == 2, metrics
    return state, metrics


def main():
    assert len(jax.devices()) == 8, jax.devices()
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    batch = _batch(n_trees=10)
    assert MICRO_ROWS < (batch.lengths > 0).sum() <= 2 * MICRO_ROWS, "premise: two micro-batches a step"
    single, single_metrics = run(None, batch)
    sharded, sharded_metrics = run(mesh, batch)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(single.params), jax.tree.leaves(sharded.params), strict=True
    ):
        # Tolerance: 1% of one step's size (lr = 1e-3); float32 reduction order differs between layouts.
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5, err_msg=str(path))
    for name in ("loss", "grad_norm", "pg_loss", "kl_ref", "entropy"):
        assert abs(single_metrics[name] - sharded_metrics[name]) <= 1e-4 * (1 + abs(single_metrics[name])), name
    initial = nnx.split(Qwen(CONFIG, rngs=nnx.Rngs(0)), nnx.Param)[1]
    moved = max(
        float(np.abs(np.asarray(a) - np.asarray(b)).max())
        for a, b in zip(jax.tree.leaves(initial), jax.tree.leaves(sharded.params), strict=True)
    )
    assert moved > 2e-4, moved  # the steps really changed the params (far beyond the tolerance)
    specs = {str(x.sharding.spec) for x in jax.tree.leaves(sharded.params)}
    assert any("tensor" in s for s in specs) and any("fsdp" in s for s in specs), specs
    assert all(x.sharding.mesh == mesh for x in jax.tree.leaves(sharded.opt_state) if hasattr(x, "sharding"))

    with tempfile.TemporaryDirectory() as directory:
        ckpt = StateCheckpointer(directory)
        ckpt.save(2, sharded._asdict())
        target = abstract_like(sharded._asdict())
        restored = ckpt.restore_latest(target=target).state
        for a, b in zip(jax.tree.leaves(restored["params"]), jax.tree.leaves(sharded.params), strict=True):
            assert a.sharding == b.sharding, (a.sharding, b.sharding)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    print("SHARDED_OK")


if __name__ == "__main__":
    main()
