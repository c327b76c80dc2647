"""Stop strings for tokenizers that split or merge them: the id sequences the engine stops on, and the
text rule that says where a turn's action ends.

A real tokenizer (Qwen's byte-level BPE) has no single id for ``</search>``: the policy may write it as
``</`` ``search`` ``>``, or end it inside a token that carries more text (``>\\n\\n``, ``>.``), or start
it inside a token that carries text before it (``a</``). The decode engine stops on id sequences only, so
:func:`stop_id_sequences` lists every *completing* token of the vocabulary: a token whose decoded text
finishes a stop string, either whole (``"x</answer>"``) or as its tail (``"er>"``, ``">\\n"``), each
preceded by the canonical ids of the part of the stop string before it. :func:`first_stop_end` is the
matching rule on text decoded from the sampled ids, which is what the environment judges; it does not
depend on how the ids spelled the stop string, so a spelling the id table misses still ends the action
at the right place (the turn then ends by EOS or its token limit, and its sampled ids are kept as they
are: nothing the policy wrote is ever re-tokenized).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def first_stop_end(text: str, stops: Sequence[str]) -> int | None:
    """Index just past the earliest completed stop string in ``text`` (None when none is complete).

    Among stop strings completed at the same place the earliest-ending one wins, so the action is read
    from ``text[:end]`` whatever follows inside the same token.
    """
    ends = [i + len(s) for s in stops if (i := text.find(s)) >= 0]
    return min(ends) if ends else None


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def stop_id_sequences(tokenizer: Any, stops: Sequence[str], max_len: int = 8) -> list[list[int]]:
    """Id sequences whose last id completes one of ``stops`` (see the module docstring), canonical first.

    Args:
      tokenizer: a HF tokenizer (``encode``, ``batch_decode``, ``convert_ids_to_tokens``, ``len``).
      stops: the stop strings (non-empty).
      max_len: the longest sequence kept (the engine's ``max_stop_len``); longer spellings are left to the
        text rule.
    Returns:
      Distinct lists of ids: first each stop string's own encoding, then one sequence per completing token
      ``t`` and stop string ``s`` (``t``'s text holds all of ``s``: ``[t]``; ``t``'s text up to a place
      where it completes ``s`` is a tail of ``s``: the ids of the rest of ``s`` then ``t``), sorted.
    """
    if not stops or any(not s for s in stops):
        raise ValueError(f"stop strings must be non-empty, got {list(stops)}")
    canonical = [tuple(_encode(tokenizer, s)) for s in stops]
    finals = {s[-1] for s in stops}
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    # Byte-level and sentencepiece pieces keep printable ASCII as itself: a cheap filter before decoding.
    candidates = [i for i, piece in enumerate(pieces) if piece and any(c in piece for c in finals)]
    texts = tokenizer.batch_decode([[i] for i in candidates], skip_special_tokens=False)
    found: set[tuple[int, ...]] = set()
    for token_id, text in zip(candidates, texts, strict=True):
        for stop in stops:
            for j, char in enumerate(text):
                if char != stop[-1]:
                    continue
                head = text[: j + 1]
                if head.endswith(stop):
                    found.add((token_id,))
                elif stop.endswith(head):
                    found.add((*_encode(tokenizer, stop[: len(stop) - len(head)]), token_id))
    ordered = list(dict.fromkeys(canonical)) + sorted(found - set(canonical))
    return [list(seq) for seq in ordered if 0 < len(seq) <= max_len]
