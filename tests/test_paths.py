import pathlib

import pytest
from etils import epath

from tests.fake_gcs import fake_gcs
from trace_jax import paths


def test_a_bucket_url_stays_a_url_and_local_paths_become_absolute(tmp_path, monkeypatch):
    assert str(pathlib.Path("gs://bucket/run")) == "gs:/bucket/run"  # the bug this module exists for
    url = paths.as_path("gs://bucket/run")
    assert isinstance(url, epath.Path) and paths.is_url(url)
    assert str(url / "checkpoints" / "3") == "gs://bucket/run/checkpoints/3"
    assert str(paths.as_path(url)) == "gs://bucket/run"
    monkeypatch.chdir(tmp_path)
    assert str(paths.as_path("runs/x")) == str(tmp_path / "runs" / "x")
    assert str(paths.as_path(pathlib.Path("runs/x"))) == str(tmp_path / "runs" / "x")


@pytest.mark.parametrize(
    "bad,message", [(pathlib.Path("gs://bucket/run"), "collapsed"), ("ftp://host/run", "unsupported URL scheme")]
)
def test_paths_that_would_land_in_the_wrong_place_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        paths.as_path(bad)


def test_files_written_under_a_bucket_url_reach_the_bucket_not_a_local_gs_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = tmp_path / "tokenizer"
    (local / "sub").mkdir(parents=True)
    (local / "tokenizer.json").write_text("{}")
    (local / "sub" / "merges.txt").write_text("a b")
    with fake_gcs(tmp_path / "gcs") as bucket_root:
        workdir = paths.as_path("gs://bucket/run")
        paths.append_text(workdir / "metrics.jsonl", '{"step": 1}\n')
        paths.append_text(workdir / "metrics.jsonl", '{"step": 2}\n')
        paths.copy_tree(local, workdir / "tokenizer")
        (workdir / "summary.json").write_text("{}")
        assert sorted(p.name for p in workdir.iterdir()) == ["metrics.jsonl", "summary.json", "tokenizer"]
        paths.copy_tree(workdir / "tokenizer", tmp_path / "back")  # and from the bucket to a local folder
    assert (tmp_path / "back" / "sub" / "merges.txt").read_text() == "a b"
    assert (tmp_path / "back" / "tokenizer.json").read_text() == "{}"
    run = bucket_root / "bucket" / "run"
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert (run / "tokenizer" / "sub" / "merges.txt").read_text() == "a b"
    assert not (tmp_path / "gs:").exists()


def test_append_text_appends_locally(tmp_path):
    path = tmp_path / "logs" / "m.jsonl"
    paths.append_text(path, "a\n")
    paths.append_text(str(path), "b\n")
    assert path.read_text() == "a\nb\n"
