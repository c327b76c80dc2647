"""Search-R1 splits for training: per-process shards, a resumable position, every row for evaluation."""

import json

import pytest

from tests import search_r1_fixtures as fixtures
from trace_jax.data.search_r1 import SearchR1Data, SearchR1DataConfig


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("search_r1")
    train, dev, _ = fixtures.world(num_people=30)
    (root / "files").mkdir()
    pq.write_table(pa.Table.from_pylist(train), root / "files" / "train.parquet")
    (root / "files" / "dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in dev))
    return SearchR1Data(SearchR1DataConfig(dir=str(root / "files")), root / "tfds"), train, dev


def test_questions_are_every_row_with_golds_and_source(data):
    reader, _, dev = data
    rows = reader.questions("dev")
    assert sorted(r["question"] for r in rows) == sorted(r["question"] for r in dev)
    assert {r["data_source"] for r in rows} == {"nq", "hotpotqa"}
    assert all(r["golden_answers"] for r in reader.questions("train"))  # parquet reward_model golds were read
    with pytest.raises(ValueError, match="split 'test' is not in"):
        reader.questions("test")


def test_processes_read_disjoint_shards_that_cover_the_split(data):
    reader, train, _ = data
    n = len(train)
    shards = [reader.stream("train", n // 2, seed=1, process_index=i, process_count=2).next_batch() for i in range(2)]
    ids = [{r["id"] for r in shard} for shard in shards]
    assert not ids[0] & ids[1] and len(ids[0] | ids[1]) == 2 * (n // 2)


def test_a_restored_position_continues_with_the_same_batches(data):
    reader, _, _ = data
    stream = reader.stream("train", 8, seed=3)
    for _ in range(3):
        stream.next_batch()
    state = json.loads(json.dumps(stream.state_dict()))  # what a checkpoint's metadata holds
    expected = [stream.next_batch() for _ in range(20)]  # across an epoch boundary
    resumed = reader.stream("train", 8, seed=3)
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(20)] == expected


def test_an_empty_data_dir_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"set --config\.data\.dir"):
        SearchR1Data(SearchR1DataConfig(), tmp_path)
