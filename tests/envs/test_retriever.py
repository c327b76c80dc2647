"""Retrievers: BM25 in process, the Search-R1 HTTP protocol against a real served index, failures."""

import json
import re
import subprocess
import sys
import threading
import time

import pytest

from trace_jax.envs import retriever as R

ROWS = [
    {"id": "0", "title": "Zorvak", "text": "Zorvak is a film: director Belmo Trask; studio Kelda."},
    {"id": "1", "title": "Belmo Trask", "text": "Belmo Trask is a person: birthplace Quilon."},
    {"id": "2", "title": "Pim Trask", "text": "Pim Trask is a person: birthplace Doru."},
    {"id": "3", "title": "Kelda", "text": "Kelda is a company: headquarters Quilon; founder Pim Trask."},
    {"id": "4", "title": "Quilon", "text": "Quilon is a city: country Vema."},
]


@pytest.fixture
def corpus_file(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def titles(ranked):
    return [[p.title for p in passages] for passages in ranked]


def test_bm25_ranks_the_named_entity_first_and_skips_empty_queries(corpus_file):
    bm25 = R.BM25Retriever.from_jsonl(corpus_file)
    ranked = bm25.search(["Belmo Trask", "", "the of a", "Quilon"], topk=2)
    assert titles(ranked)[0][0] == "Belmo Trask" and len(ranked[0]) == 2
    assert ranked[1] == [] and ranked[2] == []
    assert titles(ranked)[3][0] == "Quilon"
    assert ranked[0][0].score > ranked[0][1].score > 0
    assert len(bm25.search(["Trask"], topk=50)[0]) == 4  # only the passages that mention it


def test_bm25_index_survives_save_and_load(corpus_file, tmp_path):
    bm25 = R.BM25Retriever.from_jsonl(corpus_file)
    loaded = R.BM25Retriever.load(bm25.save(tmp_path / "index"))
    queries = ["Pim Trask", "Kelda Quilon", "Zorvak"]
    assert loaded.search(queries, 3) == bm25.search(queries, 3)


def test_corpus_errors_name_the_file_and_line(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl"):
        R.load_corpus(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        R.load_corpus(bad)
    with pytest.raises(FileNotFoundError, match="no saved BM25 index"):
        R.BM25Retriever.load(tmp_path)


def test_search_r1_contents_rows_are_read(tmp_path):
    path = tmp_path / "wiki.jsonl"
    path.write_text(json.dumps({"id": "7", "contents": '"Quilon"\nQuilon is a city.'}) + "\n")
    (passage,) = R.load_corpus(path)
    assert (passage.id, passage.title, passage.text) == ("7", "Quilon", "Quilon is a city.")


def test_served_index_returns_the_same_passages_as_in_process(corpus_file):
    server = subprocess.Popen(
        [sys.executable, "-m", "trace_jax.envs.retriever", "serve", "--corpus", str(corpus_file), "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = server.stdout.readline()
        url = re.search(r"http://\S+", line).group(0)
        client = R.HttpRetriever(url, timeout_s=5)
        queries = ["Belmo Trask", "Kelda", "", "Quilon Vema"]
        served = client.search(queries, topk=3)
        local = R.BM25Retriever.from_jsonl(corpus_file).search(queries, topk=3)
        assert [[(p.id, p.title, p.text) for p in ps] for ps in served] == [
            [(p.id, p.title, p.text) for p in ps] for ps in local
        ]
        served_scores = [p.score for ps in served for p in ps]
        assert served_scores == pytest.approx([p.score for ps in local for p in ps])
        assert client.failures == 0
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_stopped_server_gives_bounded_retries_then_a_counted_failure(corpus_file):
    server = R.make_server(R.BM25Retriever.from_jsonl(corpus_file), port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    client = R.HttpRetriever(f"http://127.0.0.1:{server.server_port}", timeout_s=1, max_attempts=3, backoff_s=0.01)
    assert titles(client.search(["Zorvak"], 1)) == [["Zorvak"]]
    server.shutdown()
    server.server_close()
    thread.join()

    start = time.monotonic()
    for _ in range(2):
        with pytest.raises(R.RetrievalError, match="failed 3 times"):
            client.search(["Zorvak"], 1)
    assert time.monotonic() - start < 5
    assert client.failures == 2
    assert client.attempts == 1 + 2 * 3
