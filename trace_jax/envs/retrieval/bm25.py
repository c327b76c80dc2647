"""In-process BM25 retrieval (bm25s, Lucene variant, English stop words) over title + text of each passage.

``bm25s`` is imported inside the functions that use it, never at module import: importing it runs a JAX
op (it probes ``jax.lax.top_k``), which would initialise a JAX backend before ``jax.distributed.initialize``
and pin a process that only serves retrieval to the default accelerator. Scores come from bm25s
(``BM25.get_scores``); the top-k selection is ours, in numpy, in ``jax.lax.top_k``'s order (ties to the
earlier passage), so search runs no JAX op either and ranks exactly as bm25s' default backend did.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from etils import epath

from trace_jax import paths
from trace_jax.envs.retrieval.base import Passage, doc_json, load_corpus, passages_from_rows


def _bm25s():
    import bm25s  # lazy: its import runs a JAX op, see the module docstring

    return bm25s


class BM25Retriever:
    """BM25 over a fixed corpus; ``search`` returns the corpus' passages with their scores.

    Args:
      passages: the corpus, in id order.
      k1, b: BM25 parameters.
      index: a prebuilt ``bm25s.BM25`` over exactly these passages (used by :meth:`load`).
    ``search`` only reads the index; the server calls it from a single batching thread.
    """

    _CORPUS_FILE = "passages.jsonl"

    def __init__(self, passages: Sequence[Passage], *, k1: float = 1.5, b: float = 0.75, index: Any = None):
        if not passages:
            raise ValueError("BM25Retriever needs at least one passage")
        self.passages = list(passages)
        if index is None:
            tokens = self._tokenize([f"{p.title} {p.text}" for p in self.passages])
            if not any(tokens):
                raise ValueError(
                    f"none of the {len(self.passages)} passages has a word BM25 can index (not a stop word)"
                )
            index = _bm25s().BM25(k1=k1, b=b)
            index.index(tokens, show_progress=False)
        self.index = index

    @staticmethod
    def _tokenize(texts: list[str]) -> list[list[str]]:
        return _bm25s().tokenize(texts, stopwords="en", return_ids=False, show_progress=False)

    @classmethod
    def from_jsonl(cls, path: str | os.PathLike, **kwargs) -> BM25Retriever:
        """BM25 over a jsonl corpus (local or ``gs://``) in the title/text or Search-R1 format."""
        return cls(load_corpus(path), **kwargs)

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping[str, Any]], **kwargs) -> BM25Retriever:
        return cls(passages_from_rows(rows), **kwargs)

    @classmethod
    def from_path(cls, path: str | os.PathLike, **kwargs) -> BM25Retriever:
        """A jsonl corpus file, or a directory written by :meth:`save`; either local or ``gs://``."""
        return cls.load(path) if paths.as_path(path).is_dir() else cls.from_jsonl(path, **kwargs)

    def save(self, directory: str | os.PathLike) -> epath.Path:
        """Writes the index and the passages under ``directory`` (reload with :meth:`load`). bm25s writes only
        local files: for a ``gs://`` directory they are written to a temporary folder, then copied up."""
        if paths.is_url(directory):
            with tempfile.TemporaryDirectory() as local:
                self.save(local)
                paths.copy_tree(local, directory)
            return paths.as_path(directory)
        out = paths.as_path(directory)
        out.mkdir(parents=True, exist_ok=True)
        self.index.save(str(out), show_progress=False)
        with (out / self._CORPUS_FILE).open("w", encoding="utf-8") as f:
            for p in self.passages:
                f.write(json.dumps(doc_json(p), ensure_ascii=False) + "\n")
        return out

    @classmethod
    def load(cls, directory: str | os.PathLike) -> BM25Retriever:
        """The index :meth:`save` wrote in ``directory``. bm25s reads only local files: a ``gs://`` directory is
        copied whole into a process-local folder first (``paths.process_local_dir``), so each host holds a copy
        of the index and its passages while it loads them."""
        directory = paths.as_path(directory)
        if not (directory / cls._CORPUS_FILE).is_file():
            raise FileNotFoundError(f"{directory} holds no saved BM25 index; build one with BM25Retriever.save")
        if paths.is_url(directory):
            local = paths.process_local_dir(directory, "bm25")
            paths.copy_tree(directory, local)
            directory = local
        index = _bm25s().BM25.load(str(directory), show_progress=False)
        return cls(load_corpus(directory / cls._CORPUS_FILE), index=index)

    def search(self, queries: Sequence[str], topk: int) -> list[list[Passage]]:
        """Top-``topk`` passages with a positive score per query (fewer when fewer match), best first;
        equal scores rank the earlier passage first."""
        k = min(int(topk), len(self.passages))
        out: list[list[Passage]] = [[] for _ in queries]
        if not out or k < 1:
            return out
        known = self.index.vocab_dict
        for i, words in enumerate(self._tokenize(list(queries))):
            words = [t for t in words if t in known]
            if not words:  # no word of the corpus: nothing matches
                continue
            doc_ids, scores = top_k(self.index.get_scores(words), k)
            out[i] = [
                dataclasses.replace(self.passages[int(d)], score=float(s))
                for d, s in zip(doc_ids, scores, strict=True)
                if s > 0
            ]
        return out


def top_k(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices and values of the ``k`` largest of ``scores [N]``, best first, ties to the lower index.

    The order of ``jax.lax.top_k`` (which bm25s used by default), in O(N) numpy: no accelerator, and the
    same passages as before for the same corpus.
    """
    kth = np.partition(scores, scores.shape[0] - k)[scores.shape[0] - k]
    above = np.flatnonzero(scores > kth)
    tied = np.flatnonzero(scores == kth)[: k - above.shape[0]]
    top = np.concatenate([above, tied])
    top = top[np.lexsort((top, -scores[top]))]
    return top, scores[top]
