"""Tokenizers: load a HF tokenizer directory, or train a small byte-level BPE for the synthetic world.

The trained tokenizer keeps every ReAct tag (``<think>``, ``</search>``, ...) as one atomic token, so the
stop sequences of the environment are single ids, and has ``<|endoftext|>`` (EOS) and ``<|pad|>``. It is
saved as a HF tokenizer directory that ``transformers.AutoTokenizer.from_pretrained`` loads.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterable, Iterator

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from trace_jax import paths
from trace_jax.data.synthetic import SyntheticWorld
from trace_jax.envs.react import OBSERVATION_CLOSE, OBSERVATION_OPEN, TAGS, TEMPLATES, format_passages
from trace_jax.envs.retrieval.retriever import Passage

EOS = "<|endoftext|>"
PAD = "<|pad|>"


# The files of a HF tokenizer directory (each optional): what is fetched from a bucket, never the weights.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def local_tokenizer_dir(path: str | pathlib.Path) -> pathlib.Path:
    """``path`` itself when local; for a ``gs://`` URL, a process-local temporary copy of its tokenizer files
    (``TOKENIZER_FILES``; transformers reads only local files), one folder per URL, refreshed on each call."""
    if not paths.is_url(path):
        return pathlib.Path(path)
    local = pathlib.Path(paths.process_local_dir(path, "tokenizer"))
    remote = paths.as_path(path)
    for name in TOKENIZER_FILES:
        if (remote / name).is_file():
            (remote / name).copy(local / name, overwrite=True)
    return local


def load_tokenizer(path: str | pathlib.Path) -> PreTrainedTokenizerBase:
    """A HF tokenizer from a directory, local or ``gs://`` (a checkpoint's, or one written by :func:`train_bpe`)."""
    path = local_tokenizer_dir(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{path} is not a HF tokenizer directory (no tokenizer.json / tokenizer_config.json)")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token is None:  # batching needs a pad id; EOS is the usual stand-in (Qwen does this)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def train_bpe(
    texts: Iterable[str], vocab_size: int = 1024, atomic_tokens: Iterable[str] = TAGS, min_frequency: int = 2
) -> PreTrainedTokenizerFast:
    """Trains a byte-level BPE on ``texts`` with ``atomic_tokens`` that are never split or merged.

    Ids: 0 = ``<|pad|>``, 1 = ``<|endoftext|>``, then the 256 byte symbols, merges, and the atomic tokens last.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # Added before training so the trainer never sees the tags' characters as ordinary text.
    tokenizer.add_special_tokens([AddedToken(PAD, special=True), AddedToken(EOS, special=True)])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in atomic_tokens])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[PAD, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=PAD)


def world_texts(world: SyntheticWorld) -> Iterator[str]:
    """Everything a rollout in ``world`` shows the tokenizer: prompts, turns, passages as observations."""
    yield from world.texts()
    for template in TEMPLATES.values():
        yield template.format(question="")
    for doc in world.corpus:
        yield OBSERVATION_OPEN + format_passages([Passage(doc["id"], doc["title"], doc["text"])]) + OBSERVATION_CLOSE


def train_world_tokenizer(
    world: SyntheticWorld, directory: str | pathlib.Path, vocab_size: int = 1024
) -> PreTrainedTokenizerFast:
    """Trains a BPE on ``world`` and saves it as a HF tokenizer directory; returns the reloaded tokenizer."""
    tokenizer = train_bpe(world_texts(world), vocab_size=vocab_size)
    tokenizer.save_pretrained(str(directory))
    return load_tokenizer(directory)
