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


def test_a_bucket_run_directory_keeps_its_url_through_the_main_job_s_writers(tmp_path, monkeypatch):
    """What ``trace_jax.train`` does with ``--workdir=gs://...``: run checks, config, logs mirrored from a local
    folder, an orbax checkpoint, the summary, the finished-run check, and a resume on a fresh host."""
    import jax.numpy as jnp

    from trace_jax.checkpoint.state import StateCheckpointer
    from trace_jax.configs import RLConfig, RunConfig
    from trace_jax.job import build, rundir
    from trace_jax.job.metrics import MetricWriter, read_jsonl
    from trace_jax.job.train import _write_json

    monkeypatch.chdir(tmp_path)
    config = RunConfig(rl=RLConfig(steps=1), seed=0)
    with fake_gcs(tmp_path / "gcs") as bucket_root:
        workdir = paths.as_path("gs://bucket/run")
        rundir.check_usable(workdir)
        rundir.check_same_run(workdir, config)
        build.save_run_config(config, workdir)
        logs = paths.LocalMirror(workdir, tmp_path / "host_a")
        assert logs.mirrored and str(logs.remote) == "gs://bucket/run"
        writer = MetricWriter(logs.local)
        writer.write(0, {"eval/em": 0.25})
        writer.write(1, {"eval/em": 0.5})
        writer.close()
        logs.push()
        checkpointer = StateCheckpointer(workdir / rundir.CHECKPOINTS)
        checkpointer.save(1, {"params": {"w": jnp.arange(3.0)}}, force=True)
        checkpointer.close()
        assert rundir.checkpoint_steps(workdir) == [1]
        _write_json(workdir / rundir.SUMMARY_FILE, {"steps": 1})
        assert rundir.finished_summary(workdir, config) == {"steps": 1}
        # A resume on another host: its mirror starts empty and pulls the logs down first.
        fresh = paths.LocalMirror(workdir, tmp_path / "host_b")
        fresh.pull((rundir.LOG_FILE, "metrics.jsonl", "tensorboard"))
        MetricWriter(fresh.local, resume_step=0).close()
        fresh.push()
        restored = StateCheckpointer(workdir / rundir.CHECKPOINTS).restore_latest()
    run = bucket_root / "bucket" / "run"
    assert restored.step == 1 and restored.state["params"]["w"].tolist() == [0.0, 1.0, 2.0]
    assert (run / "config.json").is_file() and (run / "summary.json").is_file()
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [0]  # the resume dropped step 1
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert (run / "checkpoints" / "1").is_dir()
    assert not (tmp_path / "gs:").exists() and not list(tmp_path.glob("**/gs:"))


def test_a_local_run_directory_is_its_own_mirror(tmp_path):
    logs = paths.LocalMirror(tmp_path / "run")
    assert not logs.mirrored and logs.local == paths.as_path(tmp_path / "run")
    logs.pull(("metrics.jsonl",))
    logs.push()  # nothing to copy
