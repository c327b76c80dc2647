"""Data: the synthetic multi-hop world, Search-R1 question files through TFDS + grain, and tokenizers.

from trace_jax.data import SyntheticWorld, WorldConfig
"""

from trace_jax.data.prompts import PromptStream
from trace_jax.data.search_r1 import SearchR1Data, SearchR1DataConfig
from trace_jax.data.synthetic import SyntheticWorld, WorldConfig
from trace_jax.data.tokenizer import load_tokenizer, train_world_tokenizer

__all__ = [
    "PromptStream",
    "SearchR1Data",
    "SearchR1DataConfig",
    "SyntheticWorld",
    "WorldConfig",
    "load_tokenizer",
    "train_world_tokenizer",
]
