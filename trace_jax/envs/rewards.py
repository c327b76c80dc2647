"""Terminal rewards for question answering: exact match and token F1 after SQuAD normalisation.

The reward of a trajectory is computed on the text of its *last* complete ``<answer> … </answer>`` block
(the Search-R1 convention: a model may revise its answer; only the final one counts). A prediction is
compared with every gold answer and the best score is kept. Metrics are registered by name so a config
can pick ``"em"`` (binary, the paper's reward) or ``"f1"`` (graded).
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Callable, Sequence

from trace_jax.registry import Registry

ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)
_ANSWER_BLOCK = re.compile(re.escape(ANSWER_OPEN) + r"(.*?)" + re.escape(ANSWER_CLOSE), re.DOTALL)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower-case, drop punctuation, drop articles, collapse whitespace.

    The order is SQuAD's (punctuation is removed before articles, so "the-end" becomes "theend").
    """
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def extract_answer(text: str) -> str | None:
    """The content of the last complete ``<answer>…</answer>`` block, stripped; None when there is none.

    Blocks are matched non-greedily from the left, so in ``<answer>a</answer> x <answer>b</answer>`` the
    answer is ``b``; an unclosed trailing ``<answer>`` does not count.
    """
    blocks = _ANSWER_BLOCK.findall(text)
    return blocks[-1].strip() if blocks else None


def _as_golds(golds: str | Sequence[str]) -> list[str]:
    return [golds] if isinstance(golds, str) else list(golds)


def exact_match(prediction: str, golds: str | Sequence[str]) -> float:
    """1.0 when the normalised prediction equals any normalised gold answer, else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in _as_golds(golds)))


def _f1_one(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    if not pred_tokens or not gold_tokens:
        # SQuAD convention: two empty answers agree; one empty answer scores 0.
        return float(pred_tokens == gold_tokens)
    common = collections.Counter(pred_tokens) & collections.Counter(gold_tokens)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(pred_tokens)
    recall = overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, golds: str | Sequence[str]) -> float:
    """Best bag-of-tokens F1 between the normalised prediction and any normalised gold, in [0, 1]."""
    pred = normalize_answer(prediction).split()
    return max((_f1_one(pred, normalize_answer(g).split()) for g in _as_golds(golds)), default=0.0)


METRICS: Registry[Callable[[str, str | Sequence[str]], float]] = Registry(
    "answer metric", {"em": exact_match, "f1": f1_score}
)


def get_metric(name: str) -> Callable[[str, str | Sequence[str]], float]:
    """The answer metric registered under ``name``; a clear error for an unknown name."""
    return METRICS[name]
