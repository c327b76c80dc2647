"""The synthetic multi-hop world: deterministic, disjoint splits, findable facts, varied difficulty."""

import collections
import dataclasses
import filecmp
import pathlib

import pytest

from trace_jax.config_utils import from_config
from trace_jax.configs import load_config_file
from trace_jax.data.synthetic import KINDS, RELATIONS, SyntheticWorld, WorldConfig
from trace_jax.envs.retrieval.retriever import BM25Retriever
from trace_jax.job.sft import SFTConfig
from trace_jax.models import num_params

SMALL = WorldConfig(scale=2, questions_per_hop=60, ood_questions=30)


@pytest.fixture(scope="module", params=[None, 7], ids=["original", "relabeled"])
def world(request):
    return SyntheticWorld(dataclasses.replace(SMALL, relabel_seed=request.param))


def test_same_seed_gives_a_byte_identical_world(tmp_path):
    a = SyntheticWorld(SMALL).save(tmp_path / "a")
    b = SyntheticWorld(SMALL).save(tmp_path / "b")
    c = SyntheticWorld(WorldConfig(**{**SMALL.__dict__, "seed": 1})).save(tmp_path / "c")
    names = ["corpus.jsonl", "train.jsonl", "test.jsonl", "ood.jsonl", "config.json"]
    assert all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)
    assert not filecmp.cmp(a / "corpus.jsonl", c / "corpus.jsonl", shallow=False)


def test_splits_are_disjoint_and_ood_has_more_hops(world):
    questions = {s: {q["question"] for q in world.questions(s)} for s in ("train", "test", "ood")}
    assert all(questions.values())
    assert not questions["train"] & questions["test"]
    assert not (questions["train"] | questions["test"]) & questions["ood"]
    in_dist = {q["hops"] for s in ("train", "test") for q in world.questions(s)}
    assert in_dist == set(range(1, SMALL.max_hops + 1))
    assert {q["hops"] for q in world.questions("ood")} == {SMALL.ood_hops}
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        world.questions("dev")


def test_every_hop_of_every_gold_trace_is_found_by_bm25(world):
    bm25 = BM25Retriever.from_rows(world.corpus)
    rows = [q for s in ("train", "test", "ood") for q in world.questions(s)]
    for q in rows:
        chain = q["chain"]
        assert q["golden_answers"] == [chain[-1]]
        assert len(q["gold_turns"]) == q["hops"] + 1
        results = bm25.search(chain[:-1], topk=3)
        for hop, passages in enumerate(results):
            entity = world.entities[chain[hop]]
            (relation,) = [r for r, obj in entity.facts.items() if obj == chain[hop + 1]][:1] or [None]
            assert relation is not None, f"{chain[hop]} has no fact leading to {chain[hop + 1]}"
            own = [p for p in passages if p.title == chain[hop]]
            assert own, f"hop {hop} of {q['id']}: no passage for {chain[hop]} in the top 3"
            assert f"{RELATIONS[relation][2]} {chain[hop + 1]}" in own[0].text


def test_difficulty_varies_across_entities_and_questions(world):
    mentions = collections.Counter()
    for doc in world.corpus:
        if "rumour" in doc["text"]:
            mentions.update(n for n in world.entities if f" {n} met" in doc["text"])
    per_entity = collections.Counter(mentions[n] for n in world.entities)
    assert per_entity[0] and per_entity[1] and per_entity[2]  # 0, 1 and 2 distractors all occur
    assert {q["hops"] for q in world.questions("train")} == {1, 2, 3}
    assert len({e.type for e in world.entities.values()}) == 5


def test_bad_configs_are_rejected():
    with pytest.raises(ValueError, match="max_hops"):
        WorldConfig(max_hops=4, ood_hops=4)
    with pytest.raises(ValueError, match="distractor_probs"):
        WorldConfig(distractor_probs=(0.5, 0.5, 0.5))
    with pytest.raises(ValueError, match="distractor_style"):
        WorldConfig(distractor_style="gossip")
    with pytest.raises(ValueError, match="hop_weights needs 3"):
        WorldConfig(hop_weights=(1.0, 1.0))
    with pytest.raises(ValueError, match="buried_entity_fraction"):
        WorldConfig(buried_questions=10)


def test_a_relabeled_world_keeps_the_structure_and_changes_the_facts():
    original = SyntheticWorld(SMALL)
    practice = SyntheticWorld(dataclasses.replace(SMALL, relabel_seed=7))
    by_type = lambda w: {t: sorted(n for n, e in w.entities.items() if e.type == t) for t in ("film", "person")}
    assert by_type(original) == by_type(practice)  # the same names (and so the same tokens)...
    for split in ("train", "test", "ood"):
        a, b = original.questions(split), practice.questions(split)
        assert [q["relations"] for q in a] == [q["relations"] for q in b]
    changed = [
        a["golden_answers"] != b["golden_answers"]
        for a, b in zip(original.questions("train"), practice.questions("train"), strict=True)
    ]
    assert sum(changed) > 0.8 * len(changed)  # ...telling different facts: memory does not help, reading does
    assert original.corpus[0]["text"] != practice.corpus[0]["text"]


# ------------------------------------------------------------------------------ realistic-difficulty options
REALISTIC = WorldConfig(
    scale=2,
    max_hops=5,
    ood_hops=6,
    questions_per_hop=40,
    ood_questions=20,
    hop_weights=(4.0, 3.0, 2.0, 1.0, 0.0),
    distractor_probs=(0.0, 0.2, 0.3, 0.5),
    distractor_style="lookalike",
    buried_questions=40,
    buried_entity_fraction=0.15,
    trivial_questions=30,
)


@pytest.fixture(scope="module")
def realistic():
    return SyntheticWorld(REALISTIC)


def _pool(world):
    return [q for s in ("train", "test") for q in world.questions(s)]


def test_default_world_has_only_chain_questions(world):
    assert {q["kind"] for s in ("train", "test", "ood") for q in world.questions(s)} == {"chain"}
    assert world.buried == []


def test_a_split_can_be_read_for_some_kinds_only(realistic):
    train = realistic.questions("train")
    assert any(q["kind"] == "buried" for q in train)
    assert realistic.questions("train:chain,trivial") == [q for q in train if q["kind"] != "buried"]
    assert {q["kind"] for q in realistic.questions("test:buried")} == {"buried"}
    with pytest.raises(ValueError, match="unknown question kind"):
        realistic.questions("train:chain,easy")
    with pytest.raises(ValueError, match="unknown split"):
        realistic.questions("warm:chain")


def test_realistic_world_has_every_kind_in_the_requested_amounts(realistic):
    pool = _pool(realistic)
    kinds = collections.Counter(q["kind"] for q in pool)
    assert set(kinds) == set(KINDS)
    # "at most" counts (duplicate chains are dropped); the small world still fills most of them
    assert 0.8 * 30 <= kinds["trivial"] <= 30
    assert 0.8 * 40 <= kinds["buried"] <= 40
    chain_hops = collections.Counter(q["hops"] for q in pool if q["kind"] == "chain")
    assert 5 not in chain_hops  # weight 0
    assert chain_hops[1] > chain_hops[3] > chain_hops[4] > 0  # weights 4 > 2 > 1
    assert sum(chain_hops.values()) <= 40 * 5
    assert {q["hops"] for q in realistic.questions("ood")} == {6}


def test_trivial_questions_state_their_answer_and_need_no_search(realistic):
    trivial = [q for q in _pool(realistic) if q["kind"] == "trivial"]
    for q in trivial:
        assert q["hops"] == 0 and len(q["gold_turns"]) == 1
        assert q["question"].endswith(f"? Hint: {q['golden_answers'][0]}.")  # the answer is the last word
        assert q["gold_turns"] == [f"<answer> {q['golden_answers'][0]}</answer>"]  # one copy of the answer


def test_lookalike_distractors_are_dense_and_name_a_wrong_candidate(realistic):
    distractors = [d for d in realistic.corpus if d["id"].startswith("d")]
    per_entity = collections.Counter()
    for d in distractors:
        assert ": rumour about " in d["text"] and " is " in d["text"]
        per_entity[d["text"].split("rumour about ")[1].split(": its")[0]] += 1
    assert per_entity and set(per_entity) <= set(realistic.entities)
    assert max(per_entity.values()) == 3  # distractor_probs has 4 entries: up to 3 per entity
    assert len(distractors) > 1.5 * len(realistic.entities)  # expected 2.3 per entity


def test_buried_questions_hide_their_first_lookup_and_chain_questions_stay_findable(realistic):
    bm25 = BM25Retriever.from_rows(realistic.corpus)
    buried = set(realistic.buried)
    assert buried
    own_found = lambda name, passages: any(p.title == name and p.id.startswith("e") for p in passages)
    for q in _pool(realistic):
        if q["kind"] == "trivial":
            continue
        results = bm25.search(q["chain"][:-1], topk=3)
        if q["kind"] == "buried":
            assert q["chain"][0] in buried
            assert not own_found(q["chain"][0], results[0]), f"{q['id']}: the buried passage is in the top 3"
        else:
            assert not buried.intersection(q["chain"][:-1])
            assert all(own_found(q["chain"][h], r) for h, r in enumerate(results)), q["id"]


def test_realistic_world_is_a_pure_function_of_its_seed(tmp_path):
    a = SyntheticWorld(REALISTIC).save(tmp_path / "a")
    b = SyntheticWorld(REALISTIC).save(tmp_path / "b")
    c = SyntheticWorld(dataclasses.replace(REALISTIC, seed=1)).save(tmp_path / "c")
    for name in ("corpus.jsonl", "train.jsonl", "test.jsonl", "ood.jsonl"):
        assert filecmp.cmp(a / name, b / name, shallow=False)
        assert not filecmp.cmp(a / name, c / name, shallow=False)


def test_realistic_preset_selects_the_world_and_the_tiny_policy():
    path = pathlib.Path(__file__).resolve().parents[2] / "configs" / "realistic.py"
    config = load_config_file(f"{path}:uniform")
    world = from_config(WorldConfig, config.world)
    assert config.allocation.policy == "uniform"
    assert world.buried_questions and world.trivial_questions and world.distractor_style == "lookalike"
    assert len(world.hop_weights) == world.max_hops == 5 and config.react.max_turns == 6
    assert config.sft.split == "train:chain,trivial"  # the warm start never sees a buried question's answer
    size = num_params(from_config(SFTConfig, config.sft).model_config(config.tokenizer.vocab_size))
    # The default tiny policy; configs/realistic_large.py has the few-million-parameter one.
    assert size == num_params(SFTConfig().model_config(config.tokenizer.vocab_size))


def test_large_realistic_preset_is_the_realistic_run_with_a_few_million_parameter_policy():
    configs = pathlib.Path(__file__).resolve().parents[2] / "configs"
    small = load_config_file(f"{configs / 'realistic.py'}:trace_select3")
    large = load_config_file(f"{configs / 'realistic_large.py'}:trace_select3")
    vocab = large.tokenizer.vocab_size
    assert num_params(from_config(SFTConfig, large.sft).model_config(vocab)) > 3_000_000
    assert num_params(from_config(SFTConfig, small.sft).model_config(vocab)) < 200_000
    # Only the policy and its warm-start length differ: same world, tokenizer, ReAct, allocation and RL settings.
    for section in ("world", "tokenizer", "react", "allocation", "rl", "engine"):
        assert large[section].to_dict() == small[section].to_dict(), section
    assert large.sft.split == small.sft.split and large.sft.max_steps > small.sft.max_steps
