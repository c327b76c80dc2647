"""Rewards: SQuAD normalisation, EM / F1 against several golds, the last <answer> block counts."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_jax.envs import rewards

texts = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
words = st.text(alphabet="abcdefgh XYZ.,!-'", max_size=30)
tagless = st.text(alphabet="abcxyz <>/!.", max_size=30).filter(lambda s: "answer>" not in s)


def test_normalisation_follows_squad():
    assert rewards.normalize_answer("  The  Eiffel-Tower! ") == "eiffeltower"
    assert rewards.normalize_answer("An apple, a day") == "apple day"
    assert rewards.normalize_answer("theatre") == "theatre"  # articles only as whole words


@given(texts)
def test_normalisation_is_idempotent(text):
    once = rewards.normalize_answer(text)
    assert rewards.normalize_answer(once) == once


@given(words, st.lists(words, max_size=3))
def test_a_prediction_equal_to_one_gold_scores_one(pred, others):
    assert rewards.exact_match(pred, [*others, pred]) == 1.0
    assert rewards.f1_score(pred, [*others, pred]) == pytest.approx(1.0)


@given(words, st.lists(words, min_size=1, max_size=3), words)
def test_more_golds_never_lower_the_score(pred, golds, extra):
    for metric in (rewards.exact_match, rewards.f1_score):
        assert metric(pred, [*golds, extra]) >= metric(pred, golds)


@given(words, words)
def test_f1_is_symmetric_bounded_and_at_least_em(a, b):
    f1 = rewards.f1_score(a, b)
    assert 0.0 <= f1 <= 1.0
    assert f1 == pytest.approx(rewards.f1_score(b, a))
    assert f1 >= rewards.exact_match(a, b)


def test_f1_gives_partial_credit():
    assert rewards.f1_score("Paris France", ["paris"]) == pytest.approx(2 / 3)
    assert rewards.exact_match("Paris France", ["paris"]) == 0.0
    assert rewards.f1_score("", ["paris"]) == 0.0


@given(st.lists(tagless, min_size=1, max_size=4), tagless)
def test_the_last_complete_answer_block_counts(answers, tail):
    text = "".join(f"<think>x</think><answer>{a}</answer>" for a in answers) + tail
    assert rewards.extract_answer(text) == answers[-1].strip()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("no tags at all", None),
        ("<answer>unclosed", None),
        ("<answer>first</answer> then <answer>unclosed", "first"),
        ("</answer><answer>ok</answer>", "ok"),
        ("<answer> spaced \n</answer>", "spaced"),
        ("<answer></answer>", ""),
        ("<answer>a <answer>b</answer>", "a <answer>b"),  # nesting is not a format; the text is kept
    ],
)
def test_adversarial_answer_blocks(text, expected):
    assert rewards.extract_answer(text) == expected


def _answer_reward(text, golds, metric="em"):
    """The reward of a generated text as the ReAct env scores an answer: ``metric`` on its last ``<answer>``
    block, 0.0 when there is none."""
    answer = rewards.extract_answer(text)
    return 0.0 if answer is None else rewards.get_metric(metric)(answer, golds)


@settings(max_examples=50)
@given(texts)
def test_answer_reward_never_raises_and_is_binary_for_em(text):
    assert _answer_reward(text, ["paris", "lyon"], metric="em") in (0.0, 1.0)


def test_answer_reward_uses_the_named_metric():
    text = "<think>hmm</think><answer>The Paris city</answer>"
    assert _answer_reward(text, ["paris"], "em") == 0.0
    assert _answer_reward(text, ["paris"], "f1") == pytest.approx(2 / 3)
    assert _answer_reward("<answer>the PARIS.</answer>", "paris") == 1.0
    with pytest.raises(ValueError, match="unknown answer metric 'bleu'"):
        _answer_reward(text, ["paris"], "bleu")
