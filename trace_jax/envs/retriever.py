"""Retrievers for the search tool: in-process BM25 and a client for a Search-R1 retrieval server.

Both answer ``search(queries, topk) -> [[Passage, ...], ...]`` (one ranked list per query). A retriever
that cannot answer raises :class:`RetrievalError`; the environment turns that into an observation saying
the search failed, so a run survives a retrieval server going down (and counts the failures).

The HTTP protocol is Search-R1's: ``POST /retrieve`` with ``{"queries": [...], "topk": k,
"return_scores": bool}`` answered by ``{"result": [[{"document": doc, "score": s}, ...], ...]}`` (or bare
``doc`` entries without scores), where ``doc`` has ``id`` and ``contents`` = ``'"Title"\\ntext'``. The
server here also sends ``title`` and ``text``. Serve a corpus with::

    python -m trace_jax.envs.retriever serve --corpus corpus.jsonl --port 8000
"""

from __future__ import annotations

import argparse
import dataclasses
import http.server
import json
import logging
import pathlib
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any, Protocol

import bm25s

log = logging.getLogger(__name__)


class RetrievalError(RuntimeError):
    """The retriever could not answer (server down, bad response); the caller decides what to show."""


@dataclasses.dataclass(frozen=True)
class Passage:
    id: str
    title: str
    text: str
    score: float = 0.0


class Retriever(Protocol):
    def search(self, queries: Sequence[str], topk: int) -> list[list[Passage]]:
        """Top-``topk`` passages per query, best first. Raises :class:`RetrievalError` when it cannot answer."""
        ...


# ------------------------------------------------------------------------------------------- corpora
def _passage_from_doc(doc: dict[str, Any], score: float = 0.0) -> Passage:
    """Accepts our rows (``title``, ``text``) and Search-R1 rows (``contents`` = '"Title"\\ntext')."""
    if "text" in doc:
        return Passage(str(doc.get("id", "")), str(doc.get("title", "")), str(doc["text"]), float(score))
    contents = str(doc["contents"])
    title, _, text = contents.partition("\n")
    return Passage(str(doc.get("id", "")), title.strip().strip('"'), text, float(score))


def load_corpus(path: str | pathlib.Path) -> list[Passage]:
    """Reads a jsonl corpus: one object per line with ``id``, ``title``, ``text`` (or Search-R1's ``contents``)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"corpus file {path} does not exist; pass a jsonl file with id/title/text rows")
    passages = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                passages.append(_passage_from_doc(json.loads(line)))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{line_no}: not a corpus row with id/title/text ({e!r})") from e
    if not passages:
        raise ValueError(f"corpus file {path} has no passages")
    return passages


def _doc_json(p: Passage) -> dict[str, Any]:
    return {"id": p.id, "title": p.title, "text": p.text, "contents": f'"{p.title}"\n{p.text}'}


# ---------------------------------------------------------------------------------------------- BM25
class BM25Retriever:
    """BM25 (bm25s, Lucene variant, English stop words) over title + text of each passage.

    Args:
      passages: the corpus, in id order; ``search`` returns these objects with their scores.
    """

    _CORPUS_FILE = "passages.jsonl"

    def __init__(self, passages: Sequence[Passage], *, k1: float = 1.5, b: float = 0.75, index: Any = None):
        if not passages:
            raise ValueError("BM25Retriever needs at least one passage")
        self.passages = list(passages)
        if index is None:
            index = bm25s.BM25(k1=k1, b=b)
            index.index(self._tokenize([f"{p.title} {p.text}" for p in self.passages]), show_progress=False)
        self.index = index

    @staticmethod
    def _tokenize(texts: list[str]) -> list[list[str]]:
        return bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)

    @classmethod
    def from_jsonl(cls, path: str | pathlib.Path, **kwargs) -> BM25Retriever:
        return cls(load_corpus(path), **kwargs)

    @classmethod
    def from_rows(cls, rows: Sequence[dict[str, Any]], **kwargs) -> BM25Retriever:
        return cls([_passage_from_doc(r) for r in rows], **kwargs)

    def save(self, directory: str | pathlib.Path) -> pathlib.Path:
        """Writes the index and the passages under ``directory`` (reload with :meth:`load`)."""
        out = pathlib.Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        self.index.save(str(out), show_progress=False)
        with (out / self._CORPUS_FILE).open("w", encoding="utf-8") as f:
            for p in self.passages:
                f.write(json.dumps(_doc_json(p), ensure_ascii=False) + "\n")
        return out

    @classmethod
    def load(cls, directory: str | pathlib.Path) -> BM25Retriever:
        directory = pathlib.Path(directory)
        if not (directory / cls._CORPUS_FILE).is_file():
            raise FileNotFoundError(f"{directory} holds no saved BM25 index; build one with BM25Retriever.save")
        index = bm25s.BM25.load(str(directory), show_progress=False)
        return cls(load_corpus(directory / cls._CORPUS_FILE), index=index)

    def search(self, queries: Sequence[str], topk: int) -> list[list[Passage]]:
        k = min(int(topk), len(self.passages))
        out: list[list[Passage]] = [[] for _ in queries]
        # bm25s cannot rank a query with no token it knows; those get no passages.
        known = self.index.vocab_dict
        tokens = [[t for t in words if t in known] for words in self._tokenize(list(queries))]
        nonempty = [i for i, words in enumerate(tokens) if words and k > 0]
        if not nonempty:
            return out
        query_tokens = [tokens[i] for i in nonempty]
        doc_ids, scores = self.index.retrieve(query_tokens, k=k, show_progress=False)
        for row, i in enumerate(nonempty):
            out[i] = [
                dataclasses.replace(self.passages[int(d)], score=float(s))
                for d, s in zip(doc_ids[row], scores[row], strict=True)
                if s > 0
            ]
        return out


# ---------------------------------------------------------------------------------------------- HTTP
class HttpRetriever:
    """Client for a Search-R1 retrieval server.

    Args:
      url: server base url (``http://127.0.0.1:8000``) or the full ``.../retrieve`` endpoint.
      timeout_s: per-request timeout.
      max_attempts: tries per call (>= 1); between tries it sleeps ``backoff_s * 2**attempt``.
    Attributes:
      failures: calls that ended in :class:`RetrievalError` after every attempt.
    """

    def __init__(self, url: str, *, timeout_s: float = 5.0, max_attempts: int = 3, backoff_s: float = 0.2):
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        url = url.rstrip("/")
        self.url = url if url.endswith("/retrieve") else url + "/retrieve"
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.failures = 0
        self.attempts = 0

    def _post(self, payload: dict[str, Any]) -> Any:
        request = urllib.request.Request(
            self.url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            return json.loads(response.read())

    def search(self, queries: Sequence[str], topk: int) -> list[list[Passage]]:
        payload = {"queries": list(queries), "topk": int(topk), "return_scores": True}
        last_error: Exception | None = None
        for attempt in range(self.max_attempts):
            self.attempts += 1
            try:
                result = self._post(payload)["result"]
                if len(result) != len(queries):
                    raise ValueError(f"{len(result)} result lists for {len(queries)} queries")
                return [[self._parse(entry) for entry in ranked] for ranked in result]
            except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError) as e:
                last_error = e
                log.warning("retrieval attempt %d/%d at %s failed: %r", attempt + 1, self.max_attempts, self.url, e)
                if attempt + 1 < self.max_attempts:
                    time.sleep(self.backoff_s * 2**attempt)
        self.failures += 1
        raise RetrievalError(f"retrieval server {self.url} failed {self.max_attempts} times: {last_error!r}")

    @staticmethod
    def _parse(entry: dict[str, Any]) -> Passage:
        if "document" in entry:
            return _passage_from_doc(entry["document"], entry.get("score", 0.0))
        return _passage_from_doc(entry)


# -------------------------------------------------------------------------------------------- server
def make_server(retriever: Retriever, host: str = "127.0.0.1", port: int = 0) -> http.server.ThreadingHTTPServer:
    """An HTTP server answering Search-R1 ``POST /retrieve`` from ``retriever`` (port 0 picks a free one).

    Call ``serve_forever()`` (in a thread if needed) and ``shutdown(); server_close()`` to stop it.
    """
    lock = threading.Lock()  # bm25s retrieval is not documented as thread-safe

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            if self.path.rstrip("/") != "/retrieve":
                self.send_error(404, "only POST /retrieve is served")
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                queries = [str(q) for q in body["queries"]]
                topk = int(body.get("topk") or 3)
            except (ValueError, KeyError, TypeError) as e:
                self.send_error(400, f"expected JSON with queries (list of str) and topk: {e!r}")
                return
            with lock:
                ranked = retriever.search(queries, topk)
            scores = bool(body.get("return_scores", False))
            result = [
                [{"document": _doc_json(p), "score": p.score} if scores else _doc_json(p) for p in passages]
                for passages in ranked
            ]
            data = json.dumps({"result": result}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format, *args):  # keep request logs out of stderr unless debugging
            log.debug("%s " + format, self.address_string(), *args)

    return http.server.ThreadingHTTPServer((host, port), Handler)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trace_jax.envs.retriever")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a BM25 index over Search-R1's POST /retrieve")
    source = serve.add_mutually_exclusive_group(required=True)
    source.add_argument("--corpus", help="jsonl corpus (id, title, text)")
    source.add_argument("--index", help="directory written by BM25Retriever.save")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    retriever = BM25Retriever.from_jsonl(args.corpus) if args.corpus else BM25Retriever.load(args.index)
    server = make_server(retriever, args.host, args.port)
    # The line tests and launch scripts wait for; flushed so a pipe sees it at once.
    print(f"serving {len(retriever.passages)} passages on http://{args.host}:{server.server_port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
