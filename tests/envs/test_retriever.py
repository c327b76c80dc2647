"""Retrievers: BM25 in process, the Search-R1 HTTP protocol against a real served index, failures."""

import json
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from trace_jax.data import synthetic
from trace_jax.data.synthetic import SyntheticWorld, WorldConfig
from trace_jax.envs.retrieval import __main__ as serve_command
from trace_jax.envs.retrieval import retriever as R

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


def test_top_k_is_best_first_with_ties_to_the_lower_index():
    from trace_jax.envs.retrieval.bm25 import top_k

    scores = np.asarray([1.0, 3.0, 2.0, 3.0, 2.0, 0.0, 2.0], np.float32)
    for k, expected in [(1, [1]), (2, [1, 3]), (3, [1, 3, 2]), (4, [1, 3, 2, 4]), (7, [1, 3, 2, 4, 6, 0, 5])]:
        ids, values = top_k(scores, k)
        assert ids.tolist() == expected and values.tolist() == scores[expected].tolist()


def test_bm25_ranks_equal_passages_in_corpus_order():
    rows = [{"id": str(i), "title": "Quilon", "text": "Quilon is a city."} for i in range(5)]
    (ranked,) = R.BM25Retriever.from_rows(rows).search(["Quilon"], topk=3)
    assert [p.id for p in ranked] == ["0", "1", "2"]


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
    with pytest.raises(ValueError, match="has a word BM25 can index"):
        R.BM25Retriever.from_rows([{"id": "0", "title": "a", "text": "the of"}])


def test_search_r1_contents_rows_are_read(tmp_path):
    path = tmp_path / "wiki.jsonl"
    path.write_text(json.dumps({"id": "7", "contents": '"Quilon"\nQuilon is a city.'}) + "\n")
    (passage,) = R.load_corpus(path)
    assert (passage.id, passage.title, passage.text) == ("7", "Quilon", "Quilon is a city.")


def test_served_index_returns_the_same_passages_as_in_process(corpus_file):
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trace_jax.envs.retrieval",
            "serve",
            "--corpus",
            str(corpus_file),
            "--port",
            "0",
        ],
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


# ---------------------------------------------------------------------------------- config and registry
def test_config_builds_bm25_over_either_corpus_format_a_saved_index_or_given_rows(corpus_file, tmp_path):
    search_r1 = tmp_path / "search_r1.jsonl"
    search_r1.write_text(
        "".join(json.dumps({"id": r["id"], "contents": f'"{r["title"]}"\n{r["text"]}'}) + "\n" for r in ROWS)
    )
    index = R.BM25Retriever.from_jsonl(corpus_file).save(tmp_path / "index")
    expected = R.BM25Retriever.from_rows(ROWS).search(["Belmo Trask", "Quilon"], 2)
    assert [t[0] for t in titles(expected)] == ["Belmo Trask", "Quilon"]
    for corpus in (str(corpus_file), str(search_r1), str(index)):
        built = R.build_retriever(R.RetrieverConfig(kind="bm25", corpus=corpus))
        assert isinstance(built, R.BM25Retriever)
        assert built.search(["Belmo Trask", "Quilon"], 2) == expected, corpus
    from_rows = R.build_retriever(R.RetrieverConfig(), rows=ROWS)
    assert from_rows.search(["Belmo Trask", "Quilon"], 2) == expected


def test_config_builds_an_http_client_with_its_deadline_and_retries():
    config = R.RetrieverConfig(kind="http", url="http://127.0.0.1:9/", timeout_s=0.5, max_attempts=2, backoff_s=0.01)
    client = R.build_retriever(config, rows=ROWS)
    assert isinstance(client, R.HttpRetriever)
    assert (client.url, client.timeout_s, client.max_attempts, client.backoff_s) == (
        "http://127.0.0.1:9/retrieve",
        0.5,
        2,
        0.01,
    )


def test_config_mistakes_are_one_line_errors():
    with pytest.raises(ValueError, match="unknown retriever kind 'faiss'; choose one of bm25, http"):
        R.RetrieverConfig(kind="faiss")
    with pytest.raises(ValueError, match="needs url="):
        R.RetrieverConfig(kind="http")
    with pytest.raises(ValueError, match="needs corpus="):
        R.build_retriever(R.RetrieverConfig(kind="bm25"))
    with pytest.raises(ValueError, match="must look like http://host:port"):
        R.HttpRetriever("https://example.org")


def test_importing_the_retrievers_runs_no_jax_op():
    """bm25s runs a JAX op when imported; our modules must not import it before a BM25 index is built, so
    ``jax.distributed.initialize`` can still run after ``import trace_jax.envs.retrieval.retriever``."""
    probe = (
        "import sys, jax; from jax._src import xla_bridge as xb\n"
        "import trace_jax.envs, trace_jax.envs.retrieval.retriever, trace_jax.envs.react\n"
        "print(len(xb._backends), 'bm25s' in sys.modules)\n"
        "import bm25s\n"
        "print(len(xb._backends))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 0, out.stderr
    ours, bm25s_import = out.stdout.split("\n")[:2]
    assert ours == "0 False"
    assert int(bm25s_import) > 0  # the premise: importing bm25s itself does initialise a backend


def test_serve_synthetic_world_corpus(tmp_path):
    world = {"scale": 1, "questions_per_hop": 5, "ood_questions": 5}
    first = SyntheticWorld(WorldConfig(**world)).corpus[0]
    corpus = tmp_path / "world.jsonl"
    synthetic.main(["corpus", "--world", json.dumps(world), "--out", str(corpus)])
    server = subprocess.Popen(
        [sys.executable, "-m", "trace_jax.envs.retrieval", "serve", "--corpus", str(corpus), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = server.stdout.readline()
        url = re.search(r"http://\S+", line).group(0)
        (ranked,) = R.HttpRetriever(url, timeout_s=5).search([first["title"]], topk=1)
        assert [(p.id, p.title, p.text) for p in ranked] == [(first["id"], first["title"], first["text"])]
    finally:
        server.terminate()
        server.wait(timeout=10)
    # One access-log line per request at the default level.
    assert re.search(r"POST /retrieve 200 queries=1 ms=\d", server.stderr.read())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--corpus", "missing.jsonl"], r"missing\.jsonl does not exist"),
        (["--corpus", "x.jsonl", "--workers", "0"], "ServerLimits.workers must be > 0"),
    ],
)
def test_serve_mistakes_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        serve_command.main(["serve", *argv])
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize(
    ("world", "message"),
    [("[1]", "JSON object of WorldConfig fields"), ('{"scale": 1, "colour": 2}', "WorldConfig has no field 'colour'")],
)
def test_corpus_command_mistakes_are_one_line_errors(world, message, capsys, tmp_path):
    with pytest.raises(SystemExit):
        synthetic.main(["corpus", "--world", world, "--out", str(tmp_path / "c.jsonl")])
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "c.jsonl").exists()


def test_serve_command_runs_without_a_runpy_warning():
    # `python -m` warns when the package's __init__ already imported the module it runs: the command must be a
    # module nothing imports. -W error turns that RuntimeWarning into a failed start.
    out = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "trace_jax.envs.retrieval", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "--corpus" in out.stdout and "RuntimeWarning" not in out.stderr


def test_a_corpus_file_and_a_saved_index_in_a_bucket_rank_as_the_local_ones(tmp_path):
    """A 20-passage Search-R1 corpus and an index saved from it, both ``gs://`` (an emulated bucket), built through
    the run's config: the same passages as over the local corpus file. Catches a reader that assumes a local path
    (``pathlib.Path(corpus).open()``: file not found) and an index save or load that never reaches the bucket."""
    from etils import epath

    from tests import search_r1_fixtures as fixtures
    from tests.gcs_emulator import gcs_emulator

    _, _, corpus = fixtures.world(num_people=10)
    assert len(corpus) == 20  # premise: 10 people, 10 cities
    local = tmp_path / "corpus.jsonl"
    local.write_text("".join(json.dumps(r) + "\n" for r in corpus))
    reference = R.BM25Retriever.from_jsonl(local)
    queries = [corpus[3]["contents"].split("\n")[1], "Quilon city", "born in Marrow"]
    expected = reference.search(queries, 3)
    assert all(expected)  # premise: every query finds passages
    with gcs_emulator("bucket") as gcs:
        epath.Path(gcs.gs("corpus.jsonl")).write_text(local.read_text())
        from_file = R.build_retriever(R.RetrieverConfig(corpus=gcs.gs("corpus.jsonl")))
        reference.save(gcs.gs("index"))
        assert epath.Path(gcs.gs("index", "passages.jsonl")).is_file()  # written to the bucket
        from_index = R.build_retriever(R.RetrieverConfig(corpus=gcs.gs("index")))
    assert from_file.search(queries, 3) == expected
    assert from_index.search(queries, 3) == expected
