"""The retrieval server under malformed requests, abuse and load on 127.0.0.1: every bad input is a JSON
400/411/413, slow clients are cut off, connections are bounded, and the server keeps serving.

All servers here run in process on a free port with small limits; every test ends in a few seconds.
"""

import contextlib
import http.client
import json
import logging
import re
import socket
import threading
import time

import pytest

from trace_jax.envs.retrieval.retriever import BM25Retriever, HttpRetriever, Passage
from trace_jax.envs.retrieval.server import FairBatcher, ServerLimits, make_server

ROWS = [
    {"id": "0", "title": "Zorvak", "text": "Zorvak is a film: director Belmo Trask; studio Kelda."},
    {"id": "1", "title": "Belmo Trask", "text": "Belmo Trask is a person: birthplace Quilon."},
    {"id": "2", "title": "Kelda", "text": "Kelda is a company: headquarters Quilon."},
    {"id": "3", "title": "Quilon", "text": "Quilon is a city: country Vema."},
]
LIMITS = ServerLimits(
    max_queries=20,
    max_topk=3,
    max_results=30,
    max_query_chars=50,
    max_body_bytes=500_000,
    request_timeout_s=0.5,
    workers=2,
    pending_connections=2,
)


@contextlib.contextmanager
def serving(retriever=None, limits=LIMITS):
    server = make_server(retriever or BM25Retriever.from_rows(ROWS), port=0, limits=limits)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture(scope="module")
def server():
    with serving() as s:
        yield s


def post(server, body, headers=None, path="/retrieve", method="POST"):
    """(status, decoded JSON reply) of one request."""
    connection = http.client.HTTPConnection("127.0.0.1", server.server_port, timeout=5)
    try:
        body = body if isinstance(body, bytes) else json.dumps(body).encode()
        connection.request(method, path, body, headers or {})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def raw(server, data: bytes, wait_s: float = 5) -> bytes:
    """Sends raw bytes and returns everything the server answers before closing."""
    with socket.create_connection(("127.0.0.1", server.server_port), timeout=wait_s) as sock:
        sock.sendall(data)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


def status_and_error(reply: bytes) -> tuple[int, str]:
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.isascii()
    return int(head.split()[1]), json.loads(body)["error"]


def assert_still_serving(server):
    status, reply = post(server, {"queries": ["Belmo Trask"], "topk": 1})
    assert status == 200 and reply["result"][0][0]["title"] == "Belmo Trask"


MALFORMED = {
    "queries a string": ({"queries": "castle"}, 400, "list of strings"),
    "queries an object": ({"queries": {"castle": 1}}, 400, "list of strings"),
    "queries missing": ({"topk": 1}, 400, "list of strings"),
    "a null query": ({"queries": [None]}, 400, r'"queries"\[0\] is a null'),
    "a numeric query": ({"queries": ["a", 3]}, 400, r'"queries"\[1\] is a number'),
    "topk 0": ({"queries": ["a"], "topk": 0}, 400, r"in \[1, 3\]"),
    "topk above the cap": ({"queries": ["a"], "topk": 10**9}, 400, r"in \[1, 3\]"),
    "topk infinite": (b'{"queries": ["a"], "topk": 1e999}', 400, "must be an integer"),
    "topk non-ASCII text": ({"queries": ["a"], "topk": "\u4e2d"}, 400, "must be an integer"),
    "topk a float": ({"queries": ["a"], "topk": 2.0}, 400, "must be an integer"),
    "topk a boolean": ({"queries": ["a"], "topk": True}, 400, "must be an integer"),
    "return_scores a string": ({"queries": ["a"], "return_scores": "yes"}, 400, "true or false"),
    "not an object": ([1, 2], 400, "JSON object"),
    "invalid JSON": (b"{not json", 400, "not valid UTF-8 JSON"),
    "invalid UTF-8": (b'{"queries": ["\xff"]}', 400, "not valid UTF-8 JSON"),
    "200k nested brackets": (b"[" * 200_000 + b"]" * 200_000, 400, "not valid UTF-8 JSON"),
    "too many queries": ({"queries": ["a"] * 21}, 413, "limit is 20"),
    "a too long query": ({"queries": ["a" * 51]}, 413, "limit is 50"),
    "too many results": ({"queries": ["a"] * 11, "topk": 3}, 413, "exceeds 30 results"),
    "too large a body": ({"queries": ["a" * 40] * 12_000}, 413, "larger than 500000 bytes"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_each_malformed_request_gets_a_json_error_and_the_server_keeps_serving(server, name):
    body, expected_status, message = MALFORMED[name]
    status, reply = post(server, body)
    assert status == expected_status
    assert set(reply) == {"error"} and reply["error"].isascii()
    assert re.search(message, reply["error"]), reply["error"]
    assert_still_serving(server)


@pytest.mark.parametrize(
    ("request_bytes", "expected_status"),
    [
        (b"POST /retrieve HTTP/1.1\r\nContent-Length: 1e30\r\n\r\n{}", 400),
        (b"POST /retrieve HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n{}", 413),
        (b"POST /retrieve HTTP/1.1\r\nContent-Length: -1\r\n\r\n{}", 400),
        (b"POST /retrieve HTTP/1.1\r\n\r\n{}", 411),
        (b"POST /retrieve HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 411),
        (b"POST /retrieve HTTP/1.1\r\n" + b"X-A: b\r\n" * 101 + b"\r\n", 431),
        (b"POST /retrieve HTTP/9.9 \xe4\xb8\xad\r\n\r\n", 400),
        (b"\xff\xfe garbage\r\n\r\n", 400),
        (b"BREW /retrieve HTTP/1.1\r\n\r\n", 501),
        (b"GET /retrieve HTTP/1.1\r\n\r\n", 405),
        (b"POST /other HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}", 404),
    ],
)
def test_broken_http_gets_a_json_error_with_an_ascii_status_line(server, request_bytes, expected_status):
    status, error = status_and_error(raw(server, request_bytes))
    assert status == expected_status and error.isascii()
    assert_still_serving(server)


def test_a_body_shorter_than_its_content_length_is_cut_off_at_the_request_deadline(server):
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.server_port), timeout=5) as stuck:
        stuck.sendall(b'POST /retrieve HTTP/1.1\r\nContent-Length: 100\r\n\r\n{"queries":')
        assert_still_serving(server)  # the other worker answers meanwhile
        reply = b""
        while chunk := stuck.recv(65536):
            reply += chunk
    assert status_and_error(reply)[0] == 408
    assert time.monotonic() - start < LIMITS.request_timeout_s + 0.5


def test_a_client_trickling_its_request_is_cut_off_at_the_request_deadline(server):
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.server_port), timeout=5) as slow:
        try:
            for byte in b"POST /retrieve HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}":
                slow.sendall(bytes([byte]))
                time.sleep(0.05)  # every byte well inside a per-read timeout, the whole far beyond 0.5 s
        except OSError:
            pass  # the server closed the connection
        slow.settimeout(2)
        with contextlib.suppress(OSError):
            slow.recv(65536)
    assert time.monotonic() - start < 2.5 + 0.5
    assert_still_serving(server)


def test_idle_connections_hold_bounded_workers_and_the_rest_get_503():
    limits = ServerLimits(request_timeout_s=0.5, workers=2, pending_connections=2)
    with serving(limits=limits) as server:
        idle = [socket.create_connection(("127.0.0.1", server.server_port), timeout=0.2) for _ in range(8)]
        try:
            replies = []
            for sock in idle:
                with contextlib.suppress(TimeoutError):
                    replies.append(sock.recv(65536))
        finally:
            for sock in idle:
                sock.close()
        # At most 2 held by workers and 2 queued; the others were told at once that the server is busy.
        rejected = [r for r in replies if r.startswith(b"HTTP/1.0 503 ")]
        assert len(rejected) >= 4 and "busy" in status_and_error(rejected[0])[1]
        # The idle ones are dropped at the request deadline (or on their close); the server serves again.
        deadline = time.monotonic() + 3
        while True:
            try:
                assert_still_serving(server)
                break
            except (AssertionError, OSError, ValueError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        assert threading.active_count() < 50  # a thread per worker, not per connection


def test_a_failing_retriever_is_a_500_and_the_server_keeps_serving():
    class Flaky:
        calls = 0

        def search(self, queries, topk):
            Flaky.calls += 1
            if Flaky.calls == 1:
                raise RuntimeError("index corrupted")
            return [[Passage("1", "Zorvak", "A film.", 1.0)] for _ in queries]

    with serving(Flaky()) as server:
        status, reply = post(server, {"queries": ["x"]})
        assert status == 500 and "RuntimeError" in reply["error"]
        status, reply = post(server, {"queries": ["x", "y"], "return_scores": True})
        assert status == 200 and [r[0]["document"]["title"] for r in reply["result"]] == ["Zorvak", "Zorvak"]


def test_one_access_log_line_per_request(server, caplog):
    with caplog.at_level(logging.INFO, logger="trace_jax.envs.retrieval.server"):
        post(server, {"queries": ["Kelda", "Quilon"], "topk": 2})
        post(server, {"queries": "Kelda"})
    lines = [r.getMessage() for r in caplog.records if r.name == "trace_jax.envs.retrieval.server"]
    assert len(lines) == 2
    assert " POST /retrieve 200 queries=2 ms=" in lines[0] and " POST /retrieve 400 queries=0 ms=" in lines[1]


def test_concurrent_clients_all_get_the_in_process_answers():
    queries = [[r["title"]] for r in ROWS] + [["Trask Quilon"], ["Vema"]]
    local = BM25Retriever.from_rows(ROWS)
    expected = {q[0]: [p.id for p in local.search(q, 2)[0]] for q in queries}
    errors = []
    with serving(limits=ServerLimits(workers=4)) as server:
        client = HttpRetriever(f"http://127.0.0.1:{server.server_port}", timeout_s=10)

        def hammer(worker):
            for i in range(20):
                q = queries[(worker + i) % len(queries)]
                if [p.id for p in client.search(q, 2)[0]] != expected[q[0]]:
                    errors.append(q)

        threads = [threading.Thread(target=hammer, args=(w,)) for w in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    assert not errors and client.failures == 0 and client.attempts == 160


class RecordingRetriever:
    """Answers each query with one passage holding it; records the batches and sleeps a little per batch."""

    def __init__(self):
        self.batches = []
        self.started = threading.Event()

    def search(self, queries, topk):
        self.batches.append(list(queries))
        self.started.set()
        time.sleep(0.005)
        return [[Passage(q, q, q, float(k)) for k in range(topk)] for q in queries]


def test_a_small_request_is_answered_within_two_batches_of_a_large_one():
    retriever = RecordingRetriever()
    batcher = FairBatcher(retriever, batch_queries=8, slice_queries=4)
    try:
        large = [f"large {i}" for i in range(400)]
        answers = {}
        thread = threading.Thread(target=lambda: answers.setdefault("large", batcher.search(large, 2)))
        thread.start()
        assert retriever.started.wait(5)
        small = batcher.search(["small", "small 2"], 1)
        assert "large" not in answers  # the large request is still being served
        batches_until_small = next(i for i, b in enumerate(retriever.batches) if "small" in b) + 1
        assert batches_until_small <= 3
        thread.join(timeout=10)
        assert [[p.text for p in ps] for ps in small] == [["small"], ["small 2"]]
        assert [ps[0].text for ps in answers["large"]] == large and all(len(ps) == 2 for ps in answers["large"])
        assert all(len(b) <= 8 for b in retriever.batches)
    finally:
        batcher.close()
