"""The packed-vs-per-path benchmark runs its whole code path on a tiny model and a few trees."""

import json

from trace_jax.bench import update


def test_tree_packing_bench_reports_both_layouts_and_the_same_objective(tmp_path):
    out = tmp_path / "tree_packing.json"
    argv = ["--trees", "default", "--prompts", "3", "--warmup", "0", "--steps", "1", "--tiny-model"]
    results = update.main([*argv, "--out", str(out)])
    assert json.loads(out.read_text()) == results
    packed, per_path = results["layouts"]["packed"], results["layouts"]["per_path"]
    assert results["trees"]["count"] == 3 and results["trees"]["path_tokens"] > results["trees"]["unique_tokens"]
    # Per-path rows process every path token; packed rows each unique token once plus repeated context.
    assert per_path["tokens"] == results["trees"]["path_tokens"]
    assert results["trees"]["unique_tokens"] <= packed["tokens"] < per_path["tokens"]
    assert packed["trained_tokens"] == per_path["trained_tokens"] > 0  # every sampled token trained once
    assert results["ratios"]["tokens"] == packed["tokens"] / per_path["tokens"]
    # Same params, same trees: the packed objective is the per-path one.
    assert results["first_loss_relative_difference"] < 1e-4
    assert set(results["targets_met"]) == {"tokens", "padded_tokens", "step_time"}
    assert all(len(layout["step_seconds"]) == 1 for layout in results["layouts"].values())
