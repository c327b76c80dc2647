"""Retrieval for the search tool: BM25 in process, or an HTTP client of a Search-R1-style server.

    from trace_jax.envs.retrieval import RetrieverConfig, build_retriever

``retriever`` picks a retriever from a config; ``bm25`` indexes a corpus in process; ``client`` and ``server``
are the two ends of the HTTP protocol; ``base`` holds what they share; ``__main__`` is the command that serves one
(``python -m trace_jax.envs.retrieval serve``).
"""

from trace_jax.envs.retrieval.retriever import RetrieverConfig, build_retriever

__all__ = ["RetrieverConfig", "build_retriever"]
