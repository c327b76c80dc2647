"""Stop tags on a Qwen-like tokenizer (tags are not atomic): the id spellings the engine stops on and the
text rule the environment reads turns by."""

import numpy as np
import pytest

from tests import search_r1_fixtures as fixtures
from trace_jax.envs import react
from trace_jax.envs.retrieval.retriever import BM25Retriever
from trace_jax.envs.stops import TextStops, first_stop_end, stop_id_sequences
from trace_jax.rollout.backend import ContinuationRequest
from trace_jax.rollout.engine.engine import EngineConfig
from trace_jax.rollout.engine.mock import MockEngine
from trace_jax.rollout.runner import RolloutRunner, RunnerConfig
from trace_jax.rollout.tree import RolloutTree


@pytest.fixture(scope="module")
def tokenizer():
    train, _, corpus = fixtures.world(num_people=40)
    return fixtures.train_tokenizer(fixtures._tokenizer_texts(train, corpus))


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


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


def unusual_spellings(tokenizer):
    """(ids, kept) pairs: a stop tag spelled in ids the engine's table misses, with text after it; ``kept`` is
    how many leading ids hold the tag (the cut)."""
    search = encode(tokenizer, "<search> Quilon")
    tail = encode(tokenizer, " Marrow Brink")
    pieces = [encode(tokenizer, "</sea"), encode(tokenizer, "rch>")]  # "</" "s" "e" "a" + "r" "ch" ">"
    split = search + pieces[0] + pieces[1]
    spaced = encode(tokenizer, "<search> Quilon </search>.")  # " </" merges into one id, ">." into another
    return [(split + tail, len(split)), (spaced + tail, len(spaced))]


def test_text_stops_cut_a_turn_at_the_id_completing_a_tag_the_id_table_misses(tokenizer):
    table = stop_id_sequences(tokenizer, react.STOP_TAGS)
    text_stops = TextStops(tokenizer, react.STOP_TAGS)
    for ids, kept in unusual_spellings(tokenizer):
        assert not any(ends_on_a_stop(ids[:n], table) for n in range(1, len(ids) + 1))  # premise: missed
        assert text_stops.cut(ids) == kept, tokenizer.convert_ids_to_tokens(ids)
        assert text_stops.cut(ids, checked=kept - 1) == kept  # read incrementally, call by call
        assert text_stops.cut(ids[: kept - 1]) is None
    ids, kept = unusual_spellings(tokenizer)[1]
    assert tokenizer.decode(ids[:kept]).endswith("</search>.")  # a tag ending inside a token keeps the token
    assert text_stops.cut([len(tokenizer) + 5, *ids]) == kept + 1  # padded-vocabulary ids complete nothing


def scripted(turns, filler):
    """A mock policy writing ``turns[i]`` as its i-th turn, then ``filler``; records each turn's history."""
    starts = []

    def policy(history, turn, seed):
        if not turn:
            starts.append(np.asarray(history).tolist())
        script = turns[min(len(starts), len(turns)) - 1]
        return script[len(turn)] if len(turn) < len(script) else filler

    return policy, starts


@pytest.mark.parametrize("overlap_env", [True, False])
def test_runner_ends_a_turn_at_a_stop_tag_spelled_unusually_and_goes_on_token_in_token_out(tokenizer, overlap_env):
    rows = [{"id": "0", "title": "Quilon", "text": "Quilon is a city in Norvia."}]
    env = react.ReActEnv(tokenizer, BM25Retriever.from_rows(rows), react.ReActConfig(max_turns=3, stop_variants=True))
    (first, kept), _ = unusual_spellings(tokenizer)
    answer = encode(tokenizer, "<answer> Norvia</answer>")
    policy, starts = scripted([first, answer], encode(tokenizer, "x")[0])
    engine = MockEngine(EngineConfig(max_slots=2, max_len=512, steps_per_call=16, max_turn_tokens=24), policy)
    runner = RolloutRunner(engine, None, env, RunnerConfig(overlap_env=overlap_env, warmup=False))
    task = {"question": "Where is Quilon?", "golden_answers": ["Norvia"]}
    tree = RolloutTree(env.prompt_ids(task), task)
    runner.continue_anchors([ContinuationRequest(tree, 0, 1)])
    (leaf,) = tree.leaves()
    turn1, turn2 = (tree[i] for i in tree.path(leaf) if i != 0)
    assert turn1.token_ids.tolist() == first[:kept]  # cut at the id completing "</search>", not at the limit
    assert turn1.info["action"] == "search" and turn1.info["stop_reason"] == "stop_sequence"
    assert len(turn1.observation_ids) > 0
    # The next turn's history is exactly the kept sampled ids and the observation ids (the cache was rebuilt).
    assert starts[1] == env.prompt_ids(task).tolist() + first[:kept] + turn1.observation_ids.tolist()
    assert turn2.token_ids.tolist() == answer and turn2.reward == 1.0
