"""The synthetic multi-hop world: deterministic, disjoint splits, findable facts, varied difficulty."""

import collections
import dataclasses
import filecmp

import pytest

from trace_jax.data.synthetic import RELATIONS, SyntheticWorld, WorldConfig
from trace_jax.envs.retriever import BM25Retriever

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
