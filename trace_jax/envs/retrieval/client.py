"""Client for a Search-R1 retrieval server, with one deadline per call and every failure counted.

Protocol (Search-R1's): ``POST /retrieve`` with ``{"queries": [...], "topk": k, "return_scores": true}``
answered by ``{"result": [[{"document": doc, "score": s}, ...], ...]}`` (or bare ``doc`` entries without
scores), where ``doc`` has ``id`` and ``contents`` = ``'"Title"\\ntext'`` (or ``title`` and ``text``).

A call never takes longer than its deadline: connect, send and every read of the reply are bounded by
the time left (a server trickling one byte per second is cut off at the deadline, not at a per-read
timeout). Retries with exponential backoff happen inside the same deadline. Whatever goes wrong (refused
or reset connection, timeout, HTTP error status, truncated or malformed reply, wrong JSON shape) ends in
:class:`RetrievalError`, counted in ``failures``, never in another exception.
"""

from __future__ import annotations

import collections
import http.client
import io
import json
import logging
import socket
import threading
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any

from trace_jax.envs.retrieval.base import DeadlineReader, Passage, RetrievalError, passage_from_doc

log = logging.getLogger(__name__)

# Statuses worth another try: the server may recover (overload, restart); other 4xx mean our request is bad.
_RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class _Failure(Exception):
    """One failed attempt: ``kind`` names it for the counters, ``retry`` says whether another try may help."""

    def __init__(self, kind: str, message: str, retry: bool = True):
        super().__init__(message)
        self.kind = kind
        self.retry = retry


class _DeadlineSocket:
    """The socket ``http.client`` sees: sends and reads are bounded by the call's deadline."""

    def __init__(self, sock: socket.socket, deadline: float):
        self._sock = sock
        self._deadline = deadline

    def sendall(self, data: bytes) -> None:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the deadline passed while sending the request")
        self._sock.settimeout(remaining)  # since Python 3.5 the timeout bounds the whole sendall
        self._sock.sendall(data)

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> io.BufferedReader:
        if mode != "rb":
            raise ValueError(f"only binary reads are supported, got mode {mode!r}")
        return io.BufferedReader(DeadlineReader(self._sock, self._deadline))

    def close(self) -> None:
        pass  # http.client closes this while the reply may still be read; the connection's owner closes it


class _DeadlineConnection(http.client.HTTPConnection):
    def __init__(self, host: str, port: int, deadline: float):
        super().__init__(host, port)
        self._deadline = deadline
        self._socket: socket.socket | None = None

    def connect(self) -> None:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the deadline passed before connecting")
        sock = socket.create_connection((self.host, self.port), timeout=remaining)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._socket = sock
        self.sock = _DeadlineSocket(sock, self._deadline)

    def close_socket(self) -> None:
        """Closes the connection and its socket (``close`` alone leaves the socket to the reply)."""
        self.close()
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def parse_reply(reply: Any, num_queries: int, topk: int) -> list[list[Passage]]:
    """Passages from a decoded Search-R1 reply; ``ValueError`` naming the problem for any other shape."""
    result = reply.get("result") if isinstance(reply, dict) else None
    if not isinstance(result, list):
        raise ValueError('the reply is not an object with a "result" list')
    if len(result) != num_queries:
        raise ValueError(f"{len(result)} result lists for {num_queries} queries")
    ranked = []
    for entries in result:
        if not isinstance(entries, list):
            raise ValueError("a result entry is not a list of documents")
        passages = []
        for entry in entries[:topk]:
            if not isinstance(entry, dict):
                raise ValueError("a result entry holds something other than documents")
            doc, score = (entry["document"], entry.get("score", 0.0)) if "document" in entry else (entry, 0.0)
            if not isinstance(doc, dict) or isinstance(score, bool) or not isinstance(score, int | float):
                raise ValueError("a document is not an object with a numeric score")
            try:
                passages.append(passage_from_doc(doc, score))
            except (KeyError, TypeError, OverflowError) as e:
                raise ValueError(f"a document has no text or contents ({e!r})") from e
        ranked.append(passages)
    return ranked


class HttpRetriever:
    """Client for a Search-R1 retrieval server (``http://`` only).

    Args:
      url: server base url (``http://127.0.0.1:8000``) or the full ``.../retrieve`` endpoint.
      timeout_s: the deadline of one ``search`` call, all attempts, backoff and reads included.
      max_attempts: tries per call (>= 1); between tries it sleeps ``backoff_s * 2**attempt`` (cut to the
        deadline). Refused/reset connections, timeouts, 408/429/5xx and malformed replies are retried;
        other 4xx statuses (the request itself is wrong) and oversized replies are not.
      max_response_bytes: a longer reply is a failure (it is never read into memory whole).
    Attributes:
      failures: calls that ended in :class:`RetrievalError`.
      attempts: tries made over all calls.
      failure_kinds: failed tries by kind ("timeout", "connection", "http_500", "bad_reply", ...).
    Safe to call from several threads.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 10.0,
        max_attempts: int = 3,
        backoff_s: float = 0.2,
        max_response_bytes: int = 64 << 20,
    ):
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        if not timeout_s > 0 or backoff_s < 0:
            raise ValueError(f"need timeout_s > 0 and backoff_s >= 0, got {timeout_s} and {backoff_s}")
        parts = urllib.parse.urlsplit(url.rstrip("/"))
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"retrieval url {url!r} must look like http://host:port[/retrieve]")
        self.host, self.port = parts.hostname, parts.port or 80
        self.path = parts.path if parts.path.endswith("/retrieve") else parts.path + "/retrieve"
        self.url = f"http://{parts.netloc}{self.path}"
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.max_response_bytes = max_response_bytes
        self.failures = 0
        self.attempts = 0
        self.failure_kinds: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def search(self, queries: Sequence[str], topk: int) -> list[list[Passage]]:
        queries = [str(q) for q in queries]
        body = json.dumps({"queries": queries, "topk": int(topk), "return_scores": True}).encode()
        start = time.monotonic()
        deadline = start + self.timeout_s
        last: _Failure | None = None
        tries = 0
        for attempt in range(self.max_attempts):
            if time.monotonic() >= deadline:
                break
            tries += 1
            try:
                return parse_reply(self._post(body, deadline), len(queries), int(topk))
            except ValueError as e:  # the reply decoded but has the wrong shape
                last = _Failure("bad_reply", str(e))
            except _Failure as e:
                last = e
            finally:
                with self._lock:
                    self.attempts += 1
            with self._lock:
                self.failure_kinds[last.kind] += 1
            log.warning("retrieval attempt %d/%d at %s failed: %s", attempt + 1, self.max_attempts, self.url, last)
            if not last.retry:
                break
            pause = min(self.backoff_s * 2**attempt, deadline - time.monotonic())
            if attempt + 1 < self.max_attempts and pause > 0:
                time.sleep(pause)
        with self._lock:
            self.failures += 1
        elapsed = time.monotonic() - start
        raise RetrievalError(
            f"retrieval server {self.url} failed {tries} times in {elapsed:.2f}s (deadline {self.timeout_s}s): {last}"
        )

    def _post(self, body: bytes, deadline: float) -> Any:
        """One try: the decoded JSON reply. Every transport or decode error becomes a :class:`_Failure`."""
        connection = _DeadlineConnection(self.host, self.port, deadline)
        try:
            connection.request("POST", self.path, body, {"Content-Type": "application/json", "Connection": "close"})
            response = connection.getresponse()
            length = response.getheader("Content-Length")
            if length is not None and length.isdigit() and int(length) > self.max_response_bytes:
                raise _Failure("too_large", f"the reply has {length} bytes (> {self.max_response_bytes})", retry=False)
            # With a Content-Length, read() raises IncompleteRead on a short body; read(n) would not.
            data = response.read() if response.length is not None else response.read(self.max_response_bytes + 1)
            if len(data) > self.max_response_bytes:
                raise _Failure("too_large", f"the reply is longer than {self.max_response_bytes} bytes", retry=False)
            if response.status != 200:
                detail = data[:300].decode("ascii", "replace")
                raise _Failure(
                    f"http_{response.status}",
                    f"HTTP {response.status}: {detail}",
                    retry=response.status in _RETRY_STATUSES,
                )
            return json.loads(data)
        except TimeoutError as e:
            raise _Failure("timeout", f"no complete reply within the deadline ({e})") from e
        except (http.client.HTTPException, OSError) as e:
            raise _Failure("connection", repr(e)) from e
        except (ValueError, RecursionError) as e:  # undecodable bytes, invalid or too deeply nested JSON
            raise _Failure("bad_reply", f"the reply is not valid JSON ({type(e).__name__})") from e
        finally:
            connection.close_socket()
