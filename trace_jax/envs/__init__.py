"""Agent environments: the ReAct search protocol, retrieval and rewards.

    from trace_jax.envs import ReActConfig, ReActEnv, RetrieverConfig, build_retriever

``react`` judges turns; ``retrieval`` (a package) picks a retriever from a config (BM25 in process, or a client of
a Search-R1 server) and serves one; ``stops`` finds stop tags in any tokenization; ``rewards`` scores answers (EM, F1).
"""

from trace_jax.envs.base import AgentEnv, TurnResult
from trace_jax.envs.react import ReActConfig, ReActEnv
from trace_jax.envs.retrieval import RetrieverConfig, build_retriever
from trace_jax.envs.rewards import exact_match, f1_score

__all__ = [
    "AgentEnv",
    "ReActConfig",
    "ReActEnv",
    "RetrieverConfig",
    "TurnResult",
    "build_retriever",
    "exact_match",
    "f1_score",
]
