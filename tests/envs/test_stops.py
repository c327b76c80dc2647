"""Stop tags on a Qwen-like tokenizer (tags are not atomic): the id spellings the engine stops on and the
text rule the environment reads turns by."""

import numpy as np
import pytest

from tests import search_r1_fixtures as fixtures
from trace_jax.envs import react
from trace_jax.envs.retriever import BM25Retriever
from trace_jax.envs.stops import first_stop_end, stop_id_sequences


@pytest.fixture(scope="module")
def tokenizer():
    train, _, corpus = fixtures.world(num_people=40)
    return fixtures.train_tokenizer(fixtures._tokenizer_texts(train, corpus))


def ends_on_a_stop(ids, stops):
    return any(len(ids) >= len(s) and list(ids[-len(s) :]) == s for s in stops)


def test_every_spelling_that_completes_a_tag_is_a_stop_sequence(tokenizer):
    stops = stop_id_sequences(tokenizer, react.STOP_TAGS)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)
    assert stops[:2] == [encode("</search>"), encode("</answer>")]
    assert len(encode("</search>")) > 1  # premise: the tag is several ids
    merged = encode("<answer> Quilon</answer>.\n")
    assert tokenizer.convert_ids_to_tokens(merged[-2:])[0].startswith(">")  # premise: ">" merged with "."
    for text in ("<search> Who</search>\n\n", "<answer> Quilon</answer>.\n", "x</search>"):
        ids = encode(text)
        end = next(n for n in range(1, len(ids) + 1) if first_stop_end(tokenizer.decode(ids[:n]), react.STOP_TAGS))
        assert ends_on_a_stop(ids[:end], stops), tokenizer.convert_ids_to_tokens(ids[:end])
    for sequence in stops:  # and nothing that does not complete one
        assert first_stop_end(tokenizer.decode(sequence), react.STOP_TAGS) is not None


def test_first_stop_end_reads_up_to_the_earliest_tag():
    assert first_stop_end("<search> a</search>\n\n", react.STOP_TAGS) == len("<search> a</search>")
    assert first_stop_end("<answer> b</answer>. <search>", react.STOP_TAGS) == len("<answer> b</answer>")
    assert first_stop_end("<search> a</sea", react.STOP_TAGS) is None


def test_a_tag_merged_with_what_follows_is_judged_as_the_action(tokenizer):
    rows = [{"id": "0", "title": "Quilon", "text": "Quilon is a city in Norvia."}]
    env = react.ReActEnv(tokenizer, BM25Retriever.from_rows(rows), react.ReActConfig(stop_variants=True))
    task = {"question": "Where?", "golden_answers": ["Quilon"]}
    ids = np.asarray(tokenizer.encode("<answer> Quilon</answer>.\n", add_special_tokens=False), np.int32)
    assert env.step(task, 1, ids).reward == 1.0
    search = np.asarray(tokenizer.encode("<search> Quilon</search>\n", add_special_tokens=False), np.int32)
    result = env.step(task, 1, search)
    assert not result.done and result.info["query"] == "Quilon"
    assert "Quilon is a city" in tokenizer.decode(result.observation_ids.tolist())


def test_chat_template_wraps_the_instruction_as_a_user_turn(tokenizer):
    env = react.ReActEnv(
        tokenizer,
        BM25Retriever.from_rows([{"id": "0", "title": "Quilon", "text": "Quilon is a city."}]),
        react.ReActConfig(chat_template=True),
    )
    text = env.prompt_text({"question": "Where was Kalomir born?"})
    assert text.startswith("<|im_start|>user\nAnswer the question.") and text.endswith("<|im_start|>assistant\n")
    assert "Question: Where was Kalomir born?" in text
