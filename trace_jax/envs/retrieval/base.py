"""What every retriever shares: the passage type, the ``Retriever`` protocol, its error and corpus files.

A retriever answers ``search(queries, topk) -> [[Passage, ...], ...]`` (one ranked list per query, best
first). One that cannot answer raises :class:`RetrievalError`; the environment turns that into an
observation saying the search failed, so a run survives a retrieval server going down.

Corpus files are jsonl with one passage per line, in either of two formats:

* title/text: ``{"id": "7", "title": "Quilon", "text": "Quilon is a city."}``
* Search-R1: ``{"id": "7", "contents": "\\"Quilon\\"\\nQuilon is a city."}`` (title on the first line,
  optionally quoted).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from trace_jax import paths


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


def passage_from_doc(doc: Mapping[str, Any], score: float = 0.0) -> Passage:
    """A passage from a title/text row or a Search-R1 ``contents`` row (``KeyError``/``TypeError`` otherwise)."""
    if "text" in doc:
        return Passage(str(doc.get("id", "")), str(doc.get("title", "")), str(doc["text"]), float(score))
    contents = doc["contents"]
    if not isinstance(contents, str):
        raise TypeError(f"contents must be a string, got {type(contents).__name__}")
    title, _, text = contents.partition("\n")
    return Passage(str(doc.get("id", "")), title.strip().strip('"'), text, float(score))


def doc_json(p: Passage) -> dict[str, Any]:
    """The document a server sends for ``p``: both formats' fields, so either kind of client can read it."""
    return {"id": p.id, "title": p.title, "text": p.text, "contents": f'"{p.title}"\n{p.text}'}


def load_corpus(path: str | os.PathLike) -> list[Passage]:
    """Reads a jsonl corpus, local or ``gs://``, in the title/text or the Search-R1 format (see the module
    docstring)."""
    path = paths.as_path(path)
    if not path.is_file():
        raise FileNotFoundError(f"corpus file {path} does not exist; pass a jsonl file with id/title/text rows")
    passages = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                passages.append(passage_from_doc(json.loads(line)))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(
                    f"{path}:{line_no}: not a corpus row with title/text or Search-R1 contents ({e!r})"
                ) from e
    if not passages:
        raise ValueError(f"corpus file {path} has no passages")
    return passages


def passages_from_rows(rows: Sequence[Mapping[str, Any]]) -> list[Passage]:
    """Passages from in-memory rows (e.g. ``SyntheticWorld.corpus``), in either format."""
    return [passage_from_doc(r) for r in rows]


class DeadlineReader(io.RawIOBase):
    """Raw reads from a socket, each with a timeout of the time left before ``deadline`` (``time.monotonic``).

    Wrap it in ``io.BufferedReader``: then no sequence of reads, however slowly the peer trickles bytes,
    outlives the deadline (``TimeoutError``). Both ends of the HTTP protocol read through it.
    """

    def __init__(self, sock: socket.socket, deadline: float):
        super().__init__()
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the deadline passed while reading")
        self._sock.settimeout(remaining)
        return self._sock.recv_into(buffer)
