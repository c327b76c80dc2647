"""TFDS builders (array_record, no TensorFlow) and grain iterators that resume where they stopped."""

import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trace_jax.data import tfds_builders as B
from trace_jax.data.synthetic import SyntheticWorld, WorldConfig

SMALL = WorldConfig(scale=2, questions_per_hop=30, ood_questions=10)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    config = B.SyntheticConfig(name="small", world=SMALL)
    return B.prepare(B.SyntheticMultihop, tmp_path_factory.mktemp("tfds"), config=config)


def test_synthetic_builder_holds_the_world_without_tensorflow(synthetic):
    world = SyntheticWorld(SMALL)
    for split in ("train", "test", "ood"):
        rows = [B.decode_row(r) for r in synthetic.as_data_source(split=split)]
        expected = {q["id"]: q for q in world.questions(split)}
        assert {r["id"] for r in rows} == set(expected)
        row = rows[0]
        want = expected[row["id"]]
        assert row["question"] == want["question"] and row["golden_answers"] == want["golden_answers"]
        assert row["gold_turns"] == want["gold_turns"] and row["hops"] == want["hops"]
    assert "tensorflow" not in sys.modules


def test_grain_iterator_state_restores_the_same_next_element(synthetic):
    iterator = B.make_iterator(synthetic, "train", seed=3)
    for _ in range(7):
        next(iterator)
    state = json.loads(json.dumps(iterator.get_state()))  # a checkpoint stores it as JSON
    expected = [next(iterator)["id"] for _ in range(3)]
    resumed = B.make_iterator(synthetic, "train", seed=3)
    resumed.set_state(state)
    assert [next(resumed)["id"] for _ in range(3)] == expected
    # Endless by default, each epoch a permutation of the split.
    ordered = B.make_iterator(synthetic, "test", seed=1)
    size = len(synthetic.as_data_source(split="test"))
    ids = [next(ordered)["id"] for _ in range(2 * size)]
    assert sorted(ids[:size]) == sorted(ids[size:]) and len(set(ids[:size])) == size


def write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))


GOOD = [
    {"id": "h1", "question": "Who?", "golden_answers": ["Ann", "Anne"], "data_source": "hotpotqa"},
    {"id": "m1", "question": "Where?", "golden_answers": "Rome", "data_source": "musique"},
    {"id": "n1", "question": "When?", "golden_answers": ["1999"], "data_source": "nq"},
]
BAD = [
    "{not json",
    {"question": "", "golden_answers": ["x"], "data_source": "nq"},
    {"question": "No answers", "golden_answers": [], "data_source": "nq"},
    {"question": "No source", "golden_answers": ["x"]},
    {"question": "Wrong type", "golden_answers": [3], "data_source": "nq"},
    ["a", "list"],
]


def test_search_r1_files_skip_count_and_report_malformed_rows(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [GOOD[0], BAD[0], GOOD[1], *BAD[1:], GOOD[2]])
    report = B.read_search_r1_file(tmp_path / "train.jsonl", B.MULTIHOP_SOURCES)
    assert [r["id"] for r in report.rows] == ["h1", "m1"]
    assert report.rows[1]["golden_answers"] == ["Rome"]
    assert report.malformed == len(BAD) and report.filtered == 1
    assert len(report.examples) == B.MAX_REPORTED
    assert report.examples[0].startswith("train.jsonl:2:") and "not JSON" in report.examples[0]
    assert report.examples[1].startswith("train.jsonl:4:") and "question" in report.examples[1]


def test_search_r1_builder_reads_jsonl_and_parquet_from_the_manual_dir(tmp_path):
    manual = tmp_path / "manual"
    manual.mkdir()
    write_jsonl(manual / "train.jsonl", [*GOOD, BAD[0]])
    # Search-R1's own parquet keeps the answers under reward_model.ground_truth.target.
    rows = [{"question": "Q?", "data_source": "bamboogle", "reward_model": {"ground_truth": {"target": ["A"]}}}]
    pq.write_table(pa.Table.from_pylist(rows), manual / "test.parquet")
    builder = B.prepare(B.SearchR1Local, tmp_path / "data", config="multihop", manual_dir=str(manual))
    train = sorted(B.decode_row(r)["id"] for r in builder.as_data_source(split="train"))
    assert train == ["h1", "m1"]
    (test,) = [B.decode_row(r) for r in builder.as_data_source(split="test")]
    assert test["golden_answers"] == ["A"] and test["data_source"] == "bamboogle"
    assert builder.reports["train"].malformed == 1


def test_missing_files_and_files_without_valid_rows_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="reads a manual directory"):
        B.prepare(B.SearchR1Local, tmp_path / "d0", config="all", manual_dir=str(tmp_path / "nowhere"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not a split")
    with pytest.raises(FileNotFoundError, match=r"no question file in .*other"):
        B.prepare(B.SearchR1Local, tmp_path / "d1", config="all", manual_dir=str(tmp_path / "other"))
    write_jsonl(tmp_path / "train.jsonl", BAD)
    with pytest.raises(ValueError, match=r"has no valid row \(malformed: 6"):
        B.read_search_r1_file(tmp_path / "train.jsonl")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        B.read_search_r1_file(tmp_path / "dev.jsonl")
