"""Search-R1 splits for training: per-process shards, a resumable position, every row for evaluation, the rows'
chat prompts."""

import json

import pytest

from tests import search_r1_fixtures as fixtures
from trace_jax.data.search_r1 import SearchR1Data, SearchR1DataConfig


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("search_r1")
    train, test, _ = fixtures.world(num_people=30)
    (root / "files").mkdir()
    pq.write_table(pa.Table.from_pylist(train), root / "files" / "train.parquet")
    (root / "files" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in test))
    return SearchR1Data(SearchR1DataConfig(dir=str(root / "files")), root / "tfds"), train, test


def test_questions_are_every_row_with_golds_and_source(data):
    reader, _, test = data
    rows = reader.questions("test")
    assert sorted(r["question"] for r in rows) == sorted(r["question"] for r in test)
    assert {r["data_source"] for r in rows} == {"nq", "hotpotqa"}
    assert all(r["golden_answers"] for r in reader.questions("train"))  # parquet reward_model golds were read
    with pytest.raises(ValueError, match="split 'dev' is not in"):
        reader.questions("dev")


def test_rows_keep_their_chat_prompt_and_rows_without_one_have_none(data):
    """Catches a reader that drops the parquet's ``prompt`` column (the policy would read a paraphrase)."""
    reader, train, _ = data
    by_id = {r["id"]: r for r in train}
    rows = reader.questions("train")
    assert rows and all(r["prompt"] == by_id[r["id"]]["prompt"] for r in rows)
    assert rows[0]["prompt"][0]["role"] == "system"  # premise: more than the question, in order
    assert not any("prompt" in r for r in reader.questions("test"))  # rendered from question by the env


def test_a_row_without_question_takes_it_from_extra_info_else_from_its_prompt(tmp_path):
    """Catches rows without ``question`` counted as malformed (verl-style parquets have only ``prompt``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    messages = fixtures.prompt_messages("Where was Kalo born?")
    rows = [
        {"id": "a", "prompt": messages, "extra_info": {"question": "Where was Kalo born?"}},
        {"id": "b", "prompt": messages, "extra_info": {"index": 1}},
    ]
    rows = [dict(r, data_source="nq", reward_model={"ground_truth": {"target": ["Brink"]}}) for r in rows]
    (tmp_path / "files").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "files" / "train.parquet")
    reader = SearchR1Data(SearchR1DataConfig(dir=str(tmp_path / "files")), tmp_path / "tfds")
    got = {r["id"]: r for r in reader.questions("train")}
    assert set(got) == {"a", "b"}  # premise: neither row was skipped
    assert got["a"]["question"] == "Where was Kalo born?"
    assert got["b"]["question"] == messages[-1]["content"]  # the last user message
    assert got["a"]["prompt"] == got["b"]["prompt"] == messages


def test_a_file_with_neither_question_nor_prompt_is_a_clear_error_naming_the_columns(tmp_path):
    (tmp_path / "files").mkdir()
    row = {"query": "Where?", "golden_answers": ["Here"], "data_source": "nq"}
    (tmp_path / "files" / "train.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"neither a 'question' nor a 'prompt' column .*'query'"):
        SearchR1Data(SearchR1DataConfig(dir=str(tmp_path / "files")), tmp_path / "tfds")


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


def test_question_files_and_the_prepared_cache_in_a_bucket(tmp_path):
    """``data.dir`` (a parquet and a jsonl split) and the prepared TFDS cache both ``gs://`` (an emulated bucket):
    the same rows as from local files; one process (``publish``) keeps the prepared files in the bucket, marked
    complete, and a process that does not publish writes nothing there; a later reader copies the bucket's prepared
    files down instead of preparing again. Catches a reader that assumes a local path (``pathlib`` / ``open`` on
    ``data.dir``: no question file found), several writers of one cache, and a cache that is never reused."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq
    from etils import epath

    from tests.gcs_emulator import gcs_emulator
    from trace_jax import paths
    from trace_jax.data.tfds_builders import PUBLISHED

    train, test, _ = fixtures.world(num_people=30)
    local = tmp_path / "files"
    local.mkdir()
    pq.write_table(pa.Table.from_pylist(train), local / "train.parquet")
    (local / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in test))
    expected = SearchR1Data(SearchR1DataConfig(dir=str(local)), tmp_path / "tfds")
    with gcs_emulator("bucket") as gcs:
        paths.copy_tree(local, gcs.gs("data"))
        config = SearchR1DataConfig(dir=gcs.gs("data"))
        other = SearchR1Data(config, gcs.gs("other"), publish=False)
        assert not epath.Path(gcs.gs("other")).exists()  # not the writer: nothing written to the bucket
        reader = SearchR1Data(config, gcs.gs("tfds"))
        for split in ("train", "test"):
            assert reader.questions(split) == other.questions(split) == expected.questions(split)
        published = [name for _, _, names in epath.Path(gcs.gs("tfds")).walk() for name in names if name == PUBLISHED]
        assert len(published) == 1
        # A later run on another host: no local copy, and other question files at data.dir.
        shutil.rmtree(paths.process_local_dir(gcs.gs("tfds"), "tfds"))
        epath.Path(gcs.gs("data", "test.jsonl")).write_text(json.dumps(test[0]) + "\n")
        again = SearchR1Data(config, gcs.gs("tfds"), publish=False)
        assert again.questions("test") == expected.questions("test")  # the bucket's prepared rows, not re-prepared
