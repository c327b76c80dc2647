"""The retrieval benchmark runs end to end with tiny counts and reports what it promises."""

import json

from trace_jax.bench import retrieval


def test_retrieval_bench_runs_with_tiny_counts(tmp_path):
    out = tmp_path / "retrieval.json"
    argv = ["--docs", "60", "--clients", "2", "--requests-per-client", "5", "--large-queries", "300"]
    results = retrieval.main([*argv, "--out", str(out)])
    assert json.loads(out.read_text()) == results
    assert results["docs"] == 60
    concurrent = results["concurrent"]
    assert concurrent["ok"] == concurrent["requests"] == 10 and concurrent["failures"] == 0
    assert concurrent["requests_per_s"] > 0 and 0 < concurrent["p50_ms"] <= concurrent["p99_ms"]
    behind = results["behind_large"]
    assert behind["large_failures"] == 0 and behind["small_failures"] == 0 and behind["large_request_s"] > 0
    assert behind["idle"]["count"] == 50 and isinstance(behind["target_met"], bool)
