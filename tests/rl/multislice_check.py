"""Run by test_trainer.py in a fresh interpreter with 4 fake CPU devices (XLA_FLAGS set by the caller).

A 2-slice run (2 slices x fsdp 2: per-slice partial gradients, summed once per optimizer step) against the same
steps on a 1-slice mesh (fsdp 4): two ``update`` calls (one optimizer step each, over two micro-batches) give
the same params and metrics. Prints MULTISLICE_OK and the largest differences on success.
"""

import jax
import numpy as np

from tests.rl.sharded_step_check import MICRO_ROWS, run
from tests.rl.test_trainer import _batch
from trace_jax.parallel.mesh import make_mesh


def main():
    assert len(jax.devices()) == 4, jax.devices()
    two = make_mesh(fsdp=2, slices=2)
    assert two.shape["slice"] == 2 and two.shape["fsdp"] == 2, two.shape
    batch = _batch(n_trees=10)
    # A micro-batch's rows split over the 4 batch shards, the first half on slice 0: the first micro-batch's four
    # trained rows put two on each slice, so both slices train.
    assert (batch.lengths > 0).sum() > MICRO_ROWS, "premise: a micro-batch of trained rows only"
    one_slice, one_metrics = run(make_mesh(fsdp=4), batch, steps=2)
    two_slices, two_metrics = run(two, batch, steps=2)
    # The accumulators really were per slice: the gradient went through the slice-stacked path.
    assert all(x.sharding.mesh == two for x in jax.tree.leaves(two_slices.params))
    params_diff = max(
        float(np.abs(np.asarray(a) - np.asarray(b)).max())
        for a, b in zip(jax.tree.leaves(one_slice.params), jax.tree.leaves(two_slices.params), strict=True)
    )
    # Tolerance: 1% of one step's size (lr = 1e-3); float32 reduction order differs between layouts.
    assert params_diff <= 1e-5, params_diff
    metric_diff = {k: abs(one_metrics[k] - two_metrics[k]) for k in ("loss", "grad_norm", "pg_loss", "kl_ref")}
    for name, diff in metric_diff.items():
        assert diff <= 1e-4 * (1 + abs(one_metrics[name])), (name, diff)
    print("MULTISLICE_OK", f"params_max_abs_diff={params_diff:.3g}", metric_diff, one_metrics["loss"])


if __name__ == "__main__":
    main()
