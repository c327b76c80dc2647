"""Smoke test of ``python -m trace_jax.bench.allocation`` (tiny settings): it writes JSON and the tables."""

import json

from trace_jax.bench import allocation


def test_bench_writes_json_and_markdown(tmp_path):
    out = tmp_path / "allocation.json"
    argv = ["--seeds", "2", "--batch", "8", "--warmup", "1", "--steps", "1", "--no-worlds", "--no-overhead"]
    argv += ["--no-predictors", "--policy", "uniform", "--policy", "trace", "--out", str(out)]
    results = allocation.main(argv)
    saved = json.loads(out.read_text())
    assert set(saved["policies"]) == {"uniform", "trace"}
    assert set(saved["ablation"]) == {"uniform+uniform", "uniform+active", "active+uniform", "active+active"}
    assert saved["ablation"]["active+active"] == saved["policies"]["trace"]  # the same cell is not re-run
    assert "| trace |" in results["markdown"] and "| active | uniform |" in results["markdown"]
    assert 0.0 <= saved["policies"]["trace"]["effective_ratio"]["mean"] <= 1.0
