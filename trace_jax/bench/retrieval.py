"""Retrieval server benchmark: throughput and latency on 127.0.0.1, and small requests behind a large one.

``python -m trace_jax.bench.retrieval [--docs 2000] [--clients 8] [--requests-per-client 200]
[--large-queries 10000] [--out bench_results/retrieval.json]`` prints JSON (also written to ``--out``).

The server is a real ``python -m trace_jax.envs.retrieval serve`` subprocess (default limits) over the
first ``--docs`` passages of a synthetic world; the clients are :class:`HttpRetriever` threads in this
process, each request one question of the world, top-3.

* ``concurrent``: ``--clients`` threads each send ``--requests-per-client`` requests back to back;
  requests/s over the wall time, p50/p99 latency, failures.
* ``behind_large``: one client sends a ``--large-queries``-query request; meanwhile another sends 1-query
  requests one after the other until the large one is answered. Latency of those small requests (target:
  p99 under 100 ms) and the time of the large one. ``idle`` is the same small request with nothing else
  running, for reference.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import pathlib
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

from trace_jax.bench.report import emit
from trace_jax.data.synthetic import SyntheticWorld, WorldConfig
from trace_jax.envs.retrieval.retriever import HttpRetriever

TOPK = 3
SMALL_P99_TARGET_MS = 100.0


def _corpus_and_queries(num_docs: int) -> tuple[list[dict[str, str]], list[str]]:
    """The first ``num_docs`` passages of a synthetic world large enough, and its questions as queries."""
    world = SyntheticWorld(WorldConfig(scale=max(1, math.ceil(num_docs / 40))))
    queries = [q["question"] for split in ("train", "test", "ood") for q in world.questions(split)]
    return world.corpus[:num_docs], queries


def _latency_stats(latencies_s: list[float]) -> dict[str, float]:
    ms = 1000 * np.asarray(latencies_s)
    if ms.size == 0:
        return {"count": 0}
    return {
        "count": int(ms.size),
        "p50_ms": round(float(np.percentile(ms, 50)), 2),
        "p99_ms": round(float(np.percentile(ms, 99)), 2),
        "max_ms": round(float(ms.max()), 2),
    }


def _start_server(corpus_path: pathlib.Path, server_args: list[str]) -> tuple[subprocess.Popen, str]:
    command = [
        sys.executable,
        "-m",
        "trace_jax.envs.retrieval",
        "serve",
        "--corpus",
        str(corpus_path),
        "--port",
        "0",
    ]
    command += server_args
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = server.stdout.readline()
    match = re.search(r"http://\S+", line)
    if match is None:
        server.kill()
        raise RuntimeError(f"the retrieval server did not start: {line!r}")
    return server, match.group(0)


def _timed_search(client: HttpRetriever, queries: list[str], latencies: list[float]) -> None:
    start = time.perf_counter()
    client.search(queries, TOPK)
    latencies.append(time.perf_counter() - start)


def concurrent_load(url: str, queries: list[str], clients: int, requests_per_client: int) -> dict[str, Any]:
    client = HttpRetriever(url, timeout_s=30)
    latencies: list[float] = []
    errors: list[str] = []

    def run(worker: int) -> None:
        for i in range(requests_per_client):
            try:
                _timed_search(client, [queries[(worker * requests_per_client + i) % len(queries)]], latencies)
            except Exception as e:  # a failed request is counted, not fatal to the benchmark
                errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(w,)) for w in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return {
        "clients": clients,
        "requests": clients * requests_per_client,
        "ok": len(latencies),
        "failures": client.failures,
        "requests_per_s": round(len(latencies) / wall, 1),
        **_latency_stats(latencies),
    }


def _large_request(url: str, queries: list[str], sending: Any, results: Any) -> None:
    """Runs in its own process, so decoding the large reply does not take the GIL from the small client."""
    client = HttpRetriever(url, timeout_s=600, max_attempts=1)
    sending.set()
    start = time.perf_counter()
    try:
        client.search(queries, TOPK)
    finally:
        results.put({"large_request_s": round(time.perf_counter() - start, 3), "large_failures": client.failures})


def behind_large(url: str, queries: list[str], large_queries: int) -> dict[str, Any]:
    small_client = HttpRetriever(url, timeout_s=30)
    idle: list[float] = []
    for i in range(50):
        _timed_search(small_client, [queries[i % len(queries)]], idle)

    context = multiprocessing.get_context("spawn")
    large_results = context.Queue()
    large = [queries[i % len(queries)] for i in range(large_queries)]
    sending = context.Event()
    process = context.Process(target=_large_request, args=(url, large, sending, large_results))
    process.start()
    # Small requests start once the large one is on its way (its body takes a few ms to send) and stop
    # when it is answered.
    small: list[float] = []
    sending.wait(timeout=120)
    time.sleep(0.05)
    i = 0
    while process.is_alive() and large_results.empty():
        _timed_search(small_client, [queries[i % len(queries)]], small)
        i += 1
    large_result = large_results.get(timeout=600)
    process.join(timeout=60)
    during = _latency_stats(small[:-1])  # the last one may have finished after the large request
    return {
        "large_queries": large_queries,
        **large_result,
        "small_during_large": during,
        "small_failures": small_client.failures,
        "idle": _latency_stats(idle),
        "target_small_p99_ms": SMALL_P99_TARGET_MS,
        "target_met": bool(during.get("count")) and during["p99_ms"] < SMALL_P99_TARGET_MS,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests-per-client", type=int, default=200)
    parser.add_argument("--large-queries", type=int, default=10_000)
    parser.add_argument("--server-args", default="", help='extra serve flags, e.g. "--batch-queries 32"')
    parser.add_argument("--out", default="bench_results/retrieval.json")
    args = parser.parse_args(argv)

    corpus, queries = _corpus_and_queries(args.docs)
    with tempfile.TemporaryDirectory() as tmp:
        corpus_path = pathlib.Path(tmp) / "corpus.jsonl"
        corpus_path.write_text("".join(json.dumps(row) + "\n" for row in corpus))
        server, url = _start_server(corpus_path, args.server_args.split())
        try:
            results = {
                "docs": len(corpus),
                "server_args": args.server_args,
                "topk": TOPK,
                "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                "concurrent": concurrent_load(url, queries, args.clients, args.requests_per_client),
                "behind_large": behind_large(url, queries, args.large_queries),
            }
        finally:
            server.terminate()
            server.wait(timeout=30)
    return emit(results, args.out)


if __name__ == "__main__":
    main()
