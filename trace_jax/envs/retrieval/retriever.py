"""Retrieval for the search tool, chosen by config: BM25 over a corpus, or HTTP to a Search-R1 server.

Every retriever answers ``search(queries, topk) -> [[Passage, ...], ...]`` and raises
:class:`RetrievalError` when it cannot answer (see ``base``). A run picks one with a
:class:`RetrieverConfig` and :func:`build_retriever`:

* ``kind="bm25"``: in-process BM25 (``bm25.py``) over ``corpus`` (a jsonl file in the title/text or the
  Search-R1 format, or a directory written by ``BM25Retriever.save``), or over the rows the caller passes
  (the synthetic world's corpus) when ``corpus`` is empty.
* ``kind="http"``: the client of a Search-R1 server at ``url`` (``client.py``), one deadline
  per call, retries inside it, every failure counted.

Serve a corpus (``server.py`` says what the server guarantees)::

    python -m trace_jax.envs.retrieval serve --corpus corpus.jsonl --port 8000
    python -m trace_jax.data.synthetic corpus --world runs/x/config.json --out world.jsonl  # a run's world

This module imports no JAX and runs no JAX op (``bm25s`` is imported when a BM25 index is built).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from trace_jax.config_utils import documented
from trace_jax.envs.retrieval.base import (
    Passage,
    RetrievalError,
    Retriever,
    doc_json,
    load_corpus,
    passage_from_doc,
    passages_from_rows,
)
from trace_jax.envs.retrieval.bm25 import BM25Retriever
from trace_jax.envs.retrieval.client import HttpRetriever
from trace_jax.envs.retrieval.server import RetrievalServer, ServerLimits, make_server
from trace_jax.registry import Registry

__all__ = [
    "RETRIEVERS",
    "BM25Retriever",
    "HttpRetriever",
    "Passage",
    "RetrievalError",
    "RetrievalServer",
    "Retriever",
    "RetrieverConfig",
    "ServerLimits",
    "build_retriever",
    "doc_json",
    "load_corpus",
    "make_server",
    "passage_from_doc",
    "passages_from_rows",
]


@dataclasses.dataclass(frozen=True)
class RetrieverConfig:
    """Which retriever a run uses (the number of passages per search is ``ReActConfig.topk``)."""

    kind: str = documented("bm25", 'a name in ``RETRIEVERS``: "bm25" or "http".')
    corpus: str = documented(
        "",
        "bm25 only: a jsonl corpus file or a saved index directory (local or ``gs://``, read by every host); empty = "
        "the rows the caller passes.",
    )
    url: str = documented(
        "",
        "http only: ``http://host:port`` of a Search-R1 server (``/retrieve`` is appended when missing).",
    )
    timeout_s: float = documented(
        10.0,
        "http only: the deadline of one search call, every attempt and backoff included.",
    )
    max_attempts: int = documented(3, "http only: tries per call and the base of the exponential backoff between them.")
    backoff_s: float = documented(
        0.2,
        "http only: tries per call and the base of the exponential backoff between them.",
    )
    k1: float = documented(1.5, "bm25 only: BM25 parameters when an index is built.")
    b: float = documented(0.75, "bm25 only: BM25 parameters when an index is built.")

    def __post_init__(self):
        RETRIEVERS[self.kind]  # an unknown kind is an error listing the known ones
        if self.kind == "http" and not self.url:
            raise ValueError('RetrieverConfig(kind="http") needs url="http://host:port" of a retrieval server')
        if not self.timeout_s > 0 or self.max_attempts < 1 or self.backoff_s < 0:
            raise ValueError(f"need timeout_s > 0, max_attempts >= 1 and backoff_s >= 0 in {self}")


Rows = Sequence[Mapping[str, Any]]
RETRIEVERS: Registry[Callable[[RetrieverConfig, Rows | None], Retriever]] = Registry("retriever kind")


@RETRIEVERS.register("bm25")
def _bm25(config: RetrieverConfig, rows: Rows | None) -> Retriever:
    if config.corpus:
        return BM25Retriever.from_path(config.corpus, k1=config.k1, b=config.b)
    if rows is None:
        raise ValueError('RetrieverConfig(kind="bm25") needs corpus= (a jsonl file or a saved index directory)')
    return BM25Retriever.from_rows(rows, k1=config.k1, b=config.b)


@RETRIEVERS.register("http")
def _http(config: RetrieverConfig, rows: Rows | None) -> Retriever:
    del rows  # the server holds the corpus
    return HttpRetriever(
        config.url, timeout_s=config.timeout_s, max_attempts=config.max_attempts, backoff_s=config.backoff_s
    )


def build_retriever(config: RetrieverConfig, rows: Rows | None = None) -> Retriever:
    """The retriever ``config`` names; ``rows`` (``{"id", "title", "text"}`` or Search-R1 ``contents``
    rows) is the corpus of a bm25 retriever whose config names no corpus file."""
    return RETRIEVERS[config.kind](config, rows)
