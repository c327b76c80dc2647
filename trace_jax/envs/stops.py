"""Stop strings for tokenizers that split or merge them: the id sequences the engine stops on, and the
text rule that says where a turn's action ends.

A real tokenizer (Qwen's byte-level BPE) has no single id for ``</search>``: the policy may write it as
``</`` ``search`` ``>``, or end it inside a token that carries more text (``>\\n\\n``, ``>.``), or start
it inside a token that carries text before it (``a</``). The decode engine stops on id sequences only, so
:func:`stop_id_sequences` lists every *completing* token of the vocabulary: a token whose decoded text
finishes a stop string, either whole (``"x</answer>"``) or as its tail (``"er>"``, ``">\\n"``), each
preceded by the canonical ids of the part of the stop string before it. :func:`first_stop_end` is the
matching rule on text decoded from the sampled ids, which is what the environment judges; it does not
depend on how the ids spelled the stop string. :class:`TextStops` applies it to the ids: the rollout
runner ends a turn whose spelling the id table missed at the id that completed the stop string, keeping
a prefix of the sampled ids (nothing the policy wrote is ever re-tokenized).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

_MAX_VERDICTS = 1 << 16  # id windows whose verdict is remembered (least recently used dropped first)


def first_stop_end(text: str, stops: Sequence[str]) -> int | None:
    """Index just past the earliest completed stop string in ``text`` (None when none is complete).

    Among stop strings completed at the same place the earliest-ending one wins, so the action is read
    from ``text[:end]`` whatever follows inside the same token.
    """
    ends = [i + len(s) for s in stops if (i := text.find(s)) >= 0]
    return min(ends) if ends else None


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def _completing_tokens(tokenizer: Any, stops: Sequence[str]) -> dict[int, str]:
    """Every id whose decoded text holds the last character of some stop string, with that text: the only
    ids that can complete a stop string, however the ones before them spelled it."""
    finals = {s[-1] for s in stops}
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    # Byte-level and sentencepiece pieces keep printable ASCII as itself: a cheap filter before decoding.
    candidates = [i for i, piece in enumerate(pieces) if piece and any(c in piece for c in finals)]
    texts = tokenizer.batch_decode([[i] for i in candidates], skip_special_tokens=False)
    return {i: text for i, text in zip(candidates, texts, strict=True) if any(c in text for c in finals)}


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
    found: set[tuple[int, ...]] = set()
    for token_id, text in _completing_tokens(tokenizer, stops).items():
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


class TextStops:
    """Where a turn ends by the text rule: :func:`first_stop_end` on the text decoded from its ids.

    The engine stops on the id spellings of :func:`stop_id_sequences`; a spelling that table misses (a tag
    written in unusual pieces, ``</sea`` ``rch>``, or longer than ``max_stop_len`` ids) runs on until EOS or
    the turn limit. The rollout runner asks :meth:`cut` after each ``generate`` call and ends such a turn at
    the id that completed the stop string. The kept ids are a prefix of the sampled ids, never re-encoded:
    a stop string that ends inside a token (``">."``) keeps that whole token, and the environment reads the
    action from the text up to the stop string's end.

    Args:
      tokenizer: a HF tokenizer (``decode``, ``batch_decode``, ``convert_ids_to_tokens``, ``len``).
      stops: the stop strings.
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str]):
        if not stops or any(not s for s in stops):
            raise ValueError(f"stop strings must be non-empty, got {list(stops)}")
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        completing = np.zeros(len(tokenizer), bool)
        completing[list(_completing_tokens(tokenizer, stops))] = True
        self._completing = completing  # bool [vocab]: ids that can complete a stop string
        self._span = max(len(s.encode()) for s in self.stops)  # most ids one stop string can span
        # Turns repeat the same few spellings (the canonical tag most of all): remember each id window's verdict.
        self._remembered_completes = functools.lru_cache(maxsize=_MAX_VERDICTS)(self._completes)

    def cut(self, ids: Sequence[int] | np.ndarray, checked: int = 0) -> int | None:
        """The number of leading ``ids`` whose decoded text first holds a complete stop string (the id that
        completes it is the last kept); None when no prefix of ``ids`` holds one.

        ``checked``: how many leading ids are already known to hold no complete stop string (the previous
        call's length): only ids after them that can complete a stop string are tried, each by decoding the
        few ids a stop string can span (every id decodes to at least one byte), so a call costs a handful of
        short decodes, not a decode of the whole turn. Ids past the tokenizer's vocabulary (a padded
        embedding) complete nothing.
        """
        ids = np.asarray(ids, np.int64).reshape(-1)
        positions = np.flatnonzero((ids >= 0) & (ids < len(self._completing)))
        positions = positions[self._completing[ids[positions]] & (positions >= checked)]
        for p in positions.tolist():
            if self._remembered_completes(tuple(ids[max(p + 1 - self._span, 0) : p + 1].tolist())):
                return p + 1
        return None

    def _completes(self, window: tuple[int, ...]) -> bool:
        """Whether ``window``'s decoded text holds a complete stop string."""
        return first_stop_end(self.tokenizer.decode(list(window), skip_special_tokens=False), self.stops) is not None
