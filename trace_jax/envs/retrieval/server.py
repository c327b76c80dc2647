"""A Search-R1 retrieval server over any :class:`Retriever`, safe to expose to a cluster's clients.

``POST /retrieve`` with ``{"queries": [str, ...], "topk": int, "return_scores": bool}`` (``topk`` and
``return_scores`` optional) answers ``{"result": [[{"document": doc, "score": s}, ...], ...]}`` (bare ``doc``
entries without ``return_scores``), ``doc`` = ``{"id", "title", "text", "contents"}``.

What it guarantees (each bound is a field of :class:`ServerLimits`):

* Every malformed request gets a JSON ``{"error": "..."}`` (ASCII) with 400 (bad JSON, wrong types, topk out
  of ``[1, max_topk]``), 411 (no Content-Length), 413 (body, query count, query length or
  queries x topk over their caps), 404/405 (other paths or methods), and the server keeps serving.
* Reading one request (request line, headers, body) is bounded by ``request_timeout_s`` in total, so a
  slow or stalled client costs a worker at most that long; a body shorter than its Content-Length is a
  400 once the client closes, or a 408 at the deadline.
* Connections are served by ``workers`` threads; up to ``pending_connections`` more wait in a queue and
  the rest get 503 at once; the listen backlog is ``backlog``.
* Searches go through one :class:`FairBatcher` thread: queries of all pending requests are cut into
  round-robin slices and searched in batches of at most ``batch_queries``, so a 1-query request waits at
  most about two batches behind a 10,000-query one instead of behind all of it.
* One access-log line per request at INFO: client, method, path, status, queries, milliseconds.
"""

from __future__ import annotations

import collections
import dataclasses
import http
import http.server
import io
import json
import logging
import queue
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from trace_jax.envs.retrieval.base import DeadlineReader, Passage, Retriever, doc_json

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """Bounds of the retrieval server (see the module docstring for what each protects).

    max_queries: queries per request (413 above). max_topk: largest topk (400 above); default_topk is
    used when a request sends none. max_results: queries x topk per request (413 above), which caps the
    reply size. max_query_chars: characters per query (413 above). max_body_bytes: request body (413).
    request_timeout_s: time to read one whole request. workers: threads serving connections.
    pending_connections: accepted connections waiting for a worker (503 beyond). backlog: listen backlog.
    batch_queries: queries per search batch. slice_queries: queries one request adds per round-robin pass.
    """

    max_queries: int = 16384
    max_topk: int = 100
    default_topk: int = 3
    max_results: int = 200_000
    max_query_chars: int = 4096
    max_body_bytes: int = 8 << 20
    request_timeout_s: float = 10.0
    workers: int = 16
    pending_connections: int = 64
    backlog: int = 128
    batch_queries: int = 32
    slice_queries: int = 8

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if not getattr(self, field.name) > 0:
                raise ValueError(f"ServerLimits.{field.name} must be > 0, got {getattr(self, field.name)}")
        if not 1 <= self.default_topk <= self.max_topk:
            raise ValueError(f"ServerLimits.default_topk must be in [1, max_topk={self.max_topk}]")


class BadRequest(Exception):
    """A request the server refuses: ``status`` (4xx) and an ASCII ``message`` for the JSON error body."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(frozen=True)
class SearchRequest:
    queries: list[str]
    topk: int
    return_scores: bool


def parse_request(body: bytes, limits: ServerLimits) -> SearchRequest:
    """The validated request in ``body``; :class:`BadRequest` (400 or 413) naming the first problem."""
    try:
        request = json.loads(body)
    except (ValueError, RecursionError) as e:  # undecodable bytes, invalid or too deeply nested JSON
        raise BadRequest(400, f"the body is not valid UTF-8 JSON ({type(e).__name__})") from None
    if not isinstance(request, dict):
        raise BadRequest(400, 'the body must be a JSON object with "queries" (a list of strings)')
    queries = request.get("queries")
    if not isinstance(queries, list):
        raise BadRequest(400, '"queries" must be a list of strings')
    if len(queries) > limits.max_queries:
        raise BadRequest(413, f"{len(queries)} queries in one request; the limit is {limits.max_queries}")
    for i, q in enumerate(queries):
        if not isinstance(q, str):
            raise BadRequest(400, f'"queries"[{i}] is a {_json_type(q)}, not a string')
        if len(q) > limits.max_query_chars:
            raise BadRequest(413, f'"queries"[{i}] has {len(q)} characters; the limit is {limits.max_query_chars}')
    topk = request.get("topk")
    if topk is None:
        topk = limits.default_topk
    if isinstance(topk, bool) or not isinstance(topk, int):
        raise BadRequest(400, f'"topk" must be an integer, got a {_json_type(topk)}')
    if not 1 <= topk <= limits.max_topk:
        raise BadRequest(400, f'"topk" must be in [1, {limits.max_topk}], got {topk}')
    if len(queries) * topk > limits.max_results:
        raise BadRequest(413, f"{len(queries)} queries x topk {topk} exceeds {limits.max_results} results")
    return_scores = request.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise BadRequest(400, f'"return_scores" must be true or false, got a {_json_type(return_scores)}')
    return SearchRequest(queries, topk, return_scores)


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "list", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def encode_result(ranked: Sequence[Sequence[Passage]], return_scores: bool) -> bytes:
    """The JSON reply, encoded one ranked list at a time so other threads get the GIL in between."""
    rows = []
    for passages in ranked:
        entries = [{"document": doc_json(p), "score": p.score} if return_scores else doc_json(p) for p in passages]
        rows.append(json.dumps(entries))
    return ('{"result": [' + ", ".join(rows) + "]}").encode()


# ---------------------------------------------------------------------------------------- batching
class _Job:
    def __init__(self, queries: list[str], topk: int):
        self.queries = queries
        self.topk = topk
        self.results: list[list[Passage]] = [[] for _ in queries]
        self.taken = 0  # queries handed to a batch so far
        self.finished = 0  # queries answered so far
        self.error: BaseException | None = None
        self.done = threading.Event()


class FairBatcher:
    """Runs every search of a server on one thread, in batches shared fairly between requests.

    Each batch takes up to ``slice_queries`` queries from every pending request with the same topk, pass
    after pass, until it holds ``batch_queries``; the request heading the queue rotates after each batch,
    so requests with another topk get their turn. A small request therefore waits for at most the batch in
    flight plus its own, whatever else is queued. The retriever is only ever called from this thread.
    """

    def __init__(self, retriever: Retriever, batch_queries: int = 32, slice_queries: int = 8):
        self.retriever = retriever
        self.batch_queries = batch_queries
        self.slice_queries = slice_queries
        self.batches = 0
        self._jobs: collections.deque[_Job] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="retrieval-batcher", daemon=True)
        self._thread.start()

    def search(self, queries: list[str], topk: int) -> list[list[Passage]]:
        """Blocks until every query is answered; re-raises what the retriever raised."""
        if not queries:
            return []
        job = _Job(queries, topk)
        with self._cond:
            if self._closed:
                raise RuntimeError("the retrieval server is shutting down")
            self._jobs.append(job)
            self._cond.notify()
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.results

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def _take(self) -> list[tuple[_Job, int, int]]:
        """The next batch as (job, start, stop) slices; call with the lock held and a job queued."""
        topk = self._jobs[0].topk
        budget = self.batch_queries
        batch = []
        while budget > 0:
            added = False
            for job in self._jobs:
                if job.topk != topk or job.taken == len(job.queries) or budget == 0:
                    continue
                n = min(self.slice_queries, budget, len(job.queries) - job.taken)
                batch.append((job, job.taken, job.taken + n))
                job.taken += n
                budget -= n
                added = True
            if not added:
                break
        # Jobs fully handed out leave the queue; the head rotates so the next batch starts elsewhere.
        for job in [j for j in self._jobs if j.taken == len(j.queries)]:
            self._jobs.remove(job)
        if self._jobs and self._jobs[0].topk == topk:
            self._jobs.rotate(-1)
        return batch

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if self._closed:
                    for job in self._jobs:
                        job.error = RuntimeError("the retrieval server is shutting down")
                        job.done.set()
                    return
                batch = self._take()
            queries = [q for job, start, stop in batch for q in job.queries[start:stop]]
            try:
                ranked = self.retriever.search(queries, batch[0][0].topk)
                if len(ranked) != len(queries):
                    raise RuntimeError(f"the retriever answered {len(ranked)} lists for {len(queries)} queries")
            except Exception as e:  # handed to the waiting requests, which answer 500
                log.exception("retrieval of a batch of %d queries failed", len(queries))
                self._fail([job for job, _, _ in batch], e)
                continue
            self.batches += 1
            offset = 0
            for job, start, stop in batch:
                job.results[start:stop] = ranked[offset : offset + stop - start]
                offset += stop - start
                job.finished += stop - start
                if job.finished == len(job.queries):
                    job.done.set()

    def _fail(self, jobs: list[_Job], error: Exception) -> None:
        with self._cond:
            for job in jobs:
                if job in self._jobs:
                    self._jobs.remove(job)
        for job in jobs:
            job.error = error
            job.done.set()


# ------------------------------------------------------------------------------------------ server
def _error_body(message: str) -> bytes:
    return json.dumps({"error": message}, ensure_ascii=True).encode()


class _Handler(http.server.BaseHTTPRequestHandler):
    """One connection, one request (HTTP/1.0: the connection closes after the reply)."""

    server: RetrievalServer
    server_version = "trace-jax-retrieval"

    def setup(self) -> None:
        super().setup()
        self._deadline = time.monotonic() + self.server.limits.request_timeout_s
        self.rfile.close()
        self.rfile = io.BufferedReader(DeadlineReader(self.connection, self._deadline))
        self._start = time.monotonic()
        self._num_queries = 0

    # -- every reply goes through _reply, which writes the access-log line
    def _reply(self, status: int, body: bytes, extra_headers: Sequence[tuple[str, str]] = ()) -> None:
        # Logged before sending, so the line exists once the client has its reply (ms: time to answer).
        log.info(
            "%s %s %s %d queries=%d ms=%.1f",
            self.client_address[0],
            self.command or "-",
            (getattr(self, "path", None) or "-")[:100].encode("ascii", "backslashreplace").decode(),
            status,
            self._num_queries,
            1000 * (time.monotonic() - self._start),
        )
        self.connection.settimeout(self.server.limits.request_timeout_s)  # a client that never reads
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for key, value in extra_headers:
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The base class' errors (bad request line, too many headers, unknown method) as JSON too."""
        self.close_connection = True
        self.request_version = "HTTP/1.0"  # a status line and headers even when the request line was garbage
        reason = message or http.HTTPStatus(code).phrase
        self._reply(code, _error_body(reason.encode("ascii", "backslashreplace").decode()))

    def log_request(self, code: Any = "-", size: Any = "-") -> None:
        pass  # _reply logs every request once, with its query count and time

    def log_message(self, format: str, *args: Any) -> None:
        log.info("%s %s", self.client_address[0], format % args)

    def do_GET(self) -> None:
        self._reply(405, _error_body("only POST /retrieve is served"), [("Allow", "POST")])

    do_HEAD = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_GET

    def do_POST(self) -> None:
        self._start = time.monotonic()
        limits = self.server.limits
        try:
            if self.path.rstrip("/") != "/retrieve":
                raise BadRequest(404, "only POST /retrieve is served")
            request = parse_request(self._read_body(limits), limits)
        except BadRequest as e:
            self.close_connection = True
            self._reply(e.status, _error_body(str(e)))
            self._discard_unread()
            return
        except TimeoutError:
            self.close_connection = True
            self._reply(408, _error_body(f"the request was not read within {limits.request_timeout_s}s"))
            return
        self._num_queries = len(request.queries)
        try:
            ranked = self.server.batcher.search(request.queries, request.topk)
        except Exception as e:  # the retriever's failure is the client's 500, not a crash
            self._reply(500, _error_body(f"retrieval failed: {type(e).__name__}"))
            return
        self._reply(200, encode_result(ranked, request.return_scores))

    def _discard_unread(self) -> None:
        """Briefly reads what the client is still sending: closing a socket with unread data resets the
        connection, and the client could lose the error reply before reading it."""
        try:
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(0.2)
            for _ in range(16):
                if not self.connection.recv(1 << 16):
                    break
        except OSError:
            pass

    def _read_body(self, limits: ServerLimits) -> bytes:
        if self.headers.get("Transfer-Encoding"):
            raise BadRequest(411, "send the body with a Content-Length (no Transfer-Encoding)")
        length = self.headers.get("Content-Length")
        if length is None:
            raise BadRequest(411, "a Content-Length header is required")
        length = length.strip()
        if not length.isascii() or not length.isdigit():
            raise BadRequest(400, "Content-Length must be a non-negative decimal integer")
        if len(length) > 12 or int(length) > limits.max_body_bytes:
            raise BadRequest(413, f"the body is larger than {limits.max_body_bytes} bytes")
        body = self.rfile.read(int(length))
        if len(body) < int(length):
            raise BadRequest(400, f"the body ended after {len(body)} of {length} bytes")
        return body


class RetrievalServer(socketserver.TCPServer):
    """The server :func:`make_server` returns: ``serve_forever()``; ``shutdown(); server_close()`` to stop."""

    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], retriever: Retriever, limits: ServerLimits = ServerLimits()):
        self.limits = limits
        self.request_queue_size = limits.backlog  # read by server_activate's listen()
        super().__init__(address, _Handler)
        self.batcher = FairBatcher(retriever, limits.batch_queries, limits.slice_queries)
        self._pending: queue.Queue = queue.Queue(maxsize=limits.pending_connections)
        self._workers = [
            threading.Thread(target=self._work, name=f"retrieval-worker-{i}", daemon=True)
            for i in range(limits.workers)
        ]
        for worker in self._workers:
            worker.start()

    @property
    def server_port(self) -> int:
        return self.server_address[1]

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        try:
            self._pending.put_nowait((request, client_address))
        except queue.Full:
            self._reject(request, client_address)

    def _reject(self, request: socket.socket, client_address: Any) -> None:
        body = _error_body("the server is busy; retry later")
        head = f"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        try:
            request.settimeout(0.1)
            request.sendall(head.encode() + b"Retry-After: 1\r\n\r\n" + body)
        except OSError:
            pass
        log.info("%s - - 503 queries=0 ms=0.0 (no free worker)", client_address[0])
        self.shutdown_request(request)

    def _work(self) -> None:
        while True:
            item = self._pending.get()
            if item is None:
                return
            request, client_address = item
            try:
                self.finish_request(request, client_address)
            except Exception:  # one connection's failure must not end the worker
                self.handle_error(request, client_address)
            finally:
                self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """One line per broken connection (client gone mid-reply...); the traceback only at DEBUG."""
        error = sys.exc_info()[1]
        log.warning("connection from %s failed: %r", client_address[0], error, exc_info=log.isEnabledFor(logging.DEBUG))

    def server_close(self) -> None:
        super().server_close()
        for _ in self._workers:
            self._pending.put(None)
        self.batcher.close()
        for worker in self._workers:
            worker.join(timeout=1)


def make_server(
    retriever: Retriever, host: str = "127.0.0.1", port: int = 0, limits: ServerLimits = ServerLimits()
) -> RetrievalServer:
    """A server answering Search-R1 ``POST /retrieve`` from ``retriever`` (port 0 picks a free one).

    Call ``serve_forever()`` (in a thread if needed) and ``shutdown(); server_close()`` to stop it.
    """
    return RetrievalServer((host, port), retriever, limits)
