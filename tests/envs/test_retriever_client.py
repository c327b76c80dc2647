"""HttpRetriever against broken stub servers on 127.0.0.1: every broken reply is a counted failure, every
call ends by its deadline, and the ReAct episode goes on with a failure observation."""

import json
import socket
import threading
import time

import numpy as np
import pytest

from trace_jax.data.synthetic import SyntheticWorld, WorldConfig
from trace_jax.data.tokenizer import train_world_tokenizer
from trace_jax.envs import react
from trace_jax.envs.retrieval.client import HttpRetriever, parse_reply
from trace_jax.envs.retrieval.retriever import RetrievalError

GOOD_DOC = {"id": "0", "title": "Zorvak", "text": "Zorvak is a film."}


def http_reply(body: bytes, status: str = "200 OK", length: int | None = None) -> bytes:
    length = len(body) if length is None else length
    return f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n".encode() + body


def json_reply(payload) -> bytes:
    return http_reply(json.dumps(payload).encode())


class StubServer:
    """Accepts connections on 127.0.0.1, reads each request, then runs ``respond(conn, stop)``.

    Every connection thread ends when ``stop`` is set (``close``) or the client goes away.
    """

    def __init__(self, respond):
        self.respond = respond
        self.requests = 0
        self.stop = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn):
        with conn:
            conn.settimeout(2)
            try:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(4096)
                head, _, body = data.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                while len(body) < length:
                    body += conn.recv(4096)
                self.requests += 1
                self.respond(conn, self.stop)
            except OSError:
                pass

    def close(self):
        self.stop.set()
        self.thread.join()
        self.sock.close()


def send(reply: bytes):
    return lambda conn, stop: conn.sendall(reply)


def trickle(conn, stop):
    """A valid header, then the body one byte every 50 ms: each read succeeds, the whole takes 10 s."""
    conn.sendall(http_reply(b"", length=200))
    for _ in range(200):
        if stop.wait(0.05):
            return
        conn.sendall(b" ")


def stall(conn, stop):
    stop.wait(10)


BROKEN_REPLIES = {
    "truncated body": (send(http_reply(b'{"result": [[', length=1000)), "connection"),
    "garbage status line": (send(b"garbage\r\n\r\n"), "connection"),
    "over 100 headers": (send(b"HTTP/1.1 200 OK\r\n" + b"X-A: b\r\n" * 101 + b"\r\n"), "connection"),
    "deeply nested JSON": (send(http_reply(b"[" * 200_000 + b"]" * 200_000)), "bad_reply"),
    "invalid JSON": (send(http_reply(b"not json")), "bad_reply"),
    "invalid UTF-8": (send(http_reply(b'{"result": "\xff"}')), "bad_reply"),
    "HTTP 500": (send(http_reply(b"oops", status="500 Internal Server Error")), "http_500"),
    "result not a list": (send(json_reply({"result": "abc"})), "bad_reply"),
    "wrong number of lists": (send(json_reply({"result": []})), "bad_reply"),
    "document not an object": (send(json_reply({"result": [[{"document": 5, "score": 1}]]})), "bad_reply"),
    "document without text": (send(json_reply({"result": [[{"document": {"id": "1"}, "score": 1}]]})), "bad_reply"),
    "score not a number": (send(json_reply({"result": [[{"document": GOOD_DOC, "score": "x"}]]})), "bad_reply"),
    "connection closed at once": (lambda conn, stop: None, "connection"),
}


@pytest.mark.parametrize("name", list(BROKEN_REPLIES))
def test_each_broken_reply_is_a_counted_failure_after_bounded_retries(name):
    respond, kind = BROKEN_REPLIES[name]
    server = StubServer(respond)
    try:
        client = HttpRetriever(server.url, timeout_s=3, max_attempts=2, backoff_s=0.01)
        start = time.monotonic()
        with pytest.raises(RetrievalError, match="failed 2 times"):
            client.search(["Zorvak"], 1)
        assert time.monotonic() - start < 3
        assert server.requests == 2 and client.attempts == 2 and client.failures == 1
        assert client.failure_kinds == {kind: 2}
    finally:
        server.close()


def test_a_client_error_status_is_not_retried():
    server = StubServer(send(http_reply(b'{"error": "bad topk"}', status="400 Bad Request")))
    try:
        client = HttpRetriever(server.url, timeout_s=3, max_attempts=3, backoff_s=0.01)
        with pytest.raises(RetrievalError, match="HTTP 400"):
            client.search(["Zorvak"], 1)
        assert server.requests == 1 and client.failures == 1 and client.failure_kinds == {"http_400": 1}
    finally:
        server.close()


def test_an_oversized_reply_is_refused_without_reading_it():
    server = StubServer(send(http_reply(b"x" * 10, length=10**12)))
    try:
        client = HttpRetriever(server.url, timeout_s=3, max_attempts=1, max_response_bytes=1000)
        with pytest.raises(RetrievalError, match="1000000000000 bytes"):
            client.search(["Zorvak"], 1)
        assert client.failure_kinds == {"too_large": 1}
    finally:
        server.close()


@pytest.mark.parametrize("respond", [trickle, stall], ids=["trickling", "stalled"])
def test_a_slow_server_costs_at_most_the_deadline_per_call(respond):
    server = StubServer(respond)
    try:
        client = HttpRetriever(server.url, timeout_s=0.6, max_attempts=3, backoff_s=0.01)
        for _ in range(2):
            start = time.monotonic()
            with pytest.raises(RetrievalError, match=r"deadline 0\.6s"):
                client.search(["Zorvak"], 1)
            elapsed = time.monotonic() - start
            assert 0.55 < elapsed < 0.6 + 0.6, elapsed  # not the 10 s the trickle lasts
        assert client.failures == 2 and set(client.failure_kinds) == {"timeout"}
    finally:
        server.close()


def test_a_good_reply_in_either_format_is_parsed_and_cut_to_topk():
    scored = {
        "result": [[{"document": {"id": "7", "contents": '"Quilon"\nA city.'}, "score": 2.5}, {"document": GOOD_DOC}]]
    }
    ((first, second),) = parse_reply(scored, num_queries=1, topk=5)
    assert (first.id, first.title, first.text, first.score) == ("7", "Quilon", "A city.", 2.5)
    assert (second.title, second.score) == ("Zorvak", 0.0)
    assert [len(r) for r in parse_reply({"result": [[GOOD_DOC] * 4]}, 1, topk=2)] == [2]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    world = SyntheticWorld(WorldConfig(scale=1, questions_per_hop=5, ood_questions=5))
    return train_world_tokenizer(world, tmp_path_factory.mktemp("tok"), vocab_size=400)


@pytest.mark.parametrize("name", ["truncated body", "over 100 headers", "deeply nested JSON", "trickling"])
def test_the_episode_goes_on_after_a_broken_reply(tokenizer, name):
    server = StubServer(trickle if name == "trickling" else BROKEN_REPLIES[name][0])
    try:
        client = HttpRetriever(server.url, timeout_s=0.5, max_attempts=2, backoff_s=0.01)
        env = react.ReActEnv(tokenizer, client)
        task = {"question": "Who directed Zorvak?", "golden_answers": ["Belmo Trask"]}
        ids = np.asarray(env.encode("<search> Zorvak</search>"), np.int32)
        result = env.step(task, 1, ids)
        assert not result.done and result.info["retrieval_failed"]
        assert "Search failed" in tokenizer.decode(result.observation_ids.tolist())
        assert env.retrieval_failures == 1 and client.failures == 1
        answer = np.asarray(env.encode("<answer> Belmo Trask</answer>"), np.int32)
        assert env.step(task, 2, answer).reward == 1.0
    finally:
        server.close()
