"""The warm-start cache: keyed by what the warm start depends on only, trained once, then reused by every run."""

import pathlib

import jax
import numpy as np

from trace_jax.configs import load_config_file, validate
from trace_jax.job import build, warm_start

ROOT = pathlib.Path(__file__).resolve().parents[2]


def fingerprint(config):
    """The warm-start key of a config file's ConfigDict (typed first, as the job does)."""
    return warm_start.fingerprint(validate.validate(config))


def tiny_config(cache_dir):
    config = load_config_file(str(ROOT / "configs" / "default.py"))
    config.world.scale = 1
    config.world.questions_per_hop = 8
    config.world.ood_questions = 4
    config.tokenizer.vocab_size = 400
    config.sft.max_steps = 3
    config.sft.batch_size = 4
    config.sft.practice_worlds = 0
    config.warm_start.cache_dir = str(cache_dir)
    return config


def test_the_key_changes_with_what_the_warm_start_depends_on_only(tmp_path):
    config = tiny_config(tmp_path)
    key = fingerprint(config)
    for section, field, value in [
        ("rl", "steps", 99),
        ("allocation", "policy", "uniform"),
        ("optim", "learning_rate", 1.0),
        ("warm_start", "cache_dir", "/elsewhere"),
    ]:
        changed = tiny_config(tmp_path)
        changed[section][field] = value
        assert fingerprint(changed) == key, section
    changed = tiny_config(tmp_path)
    changed.seed = 5  # the RL run's seed; the warm start has its own (sft.seed)
    assert fingerprint(changed) == key
    for section, field, value in [
        ("sft", "max_steps", 4),
        ("sft", "seed", 1),
        ("world", "seed", 3),
        ("tokenizer", "vocab_size", 401),
        ("react", "max_turns", 2),
    ]:
        changed = tiny_config(tmp_path)
        changed[section][field] = value
        assert fingerprint(changed) != key, section


def test_the_key_changes_with_the_code_that_trains_the_warm_start_not_with_its_comments(tmp_path, monkeypatch):
    """Catches a key that hashes configs only (a user who edits the SFT loop, the world or the model would be
    served the warm start the old code trained) and one that hashes raw text (a comment would retrain)."""
    package = ROOT / "trace_jax"
    copy = tmp_path / "trace_jax"
    for name in warm_start.CODE:
        source = package / name
        target = copy / name
        if source.is_dir():
            target.mkdir(parents=True)
            for module in source.glob("*.py"):
                (target / module.name).write_text(module.read_text())
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(source.read_text())
    (copy / "job").mkdir(exist_ok=True)
    # The digest reads the modules next to its own file: point it at the copy.
    monkeypatch.setattr(warm_start, "__file__", str(copy / "job" / "warm_start.py"))

    def key():
        warm_start.code_digest.cache_clear()
        return fingerprint(tiny_config(tmp_path))

    original = key()
    assert len(warm_start._code_files()) >= 9  # the premise: every listed module is read (the copy is complete)
    sft = copy / "job" / "sft.py"
    text = sft.read_text()
    sft.write_text("# a comment\n" + text.replace('"""', '"""Reworded. ', 1) + "\n\n# another\n")
    assert key() == original  # comments and docstrings keep the key
    for name in ("job/sft.py", "models/qwen.py", "data/synthetic.py"):
        module = copy / name
        before = module.read_text()
        module.write_text(before + "\n_EDITED = 1\n")
        assert key() != original, name  # any other edit moves it
        module.write_text(before)
    warm_start.code_digest.cache_clear()


def test_a_warm_start_is_trained_once_and_reused_by_the_next_run(tmp_path):
    config = tiny_config(tmp_path)
    bars = []

    def progress(total, description):
        bars.append((total, description))
        from trace_jax.job.cli import _NoBar

        return _NoBar()

    first = build.build_warm_start(validate.validate(config), progress=progress)
    assert first.trained and first.sft.steps == 3 and first.sft.reproducible
    assert bars == [(3, "warm start (SFT)")]
    assert first.entry.directory.parent == tmp_path and first.entry.info()["steps"] == 3
    assert (first.entry.directory / "tokenizer" / "tokenizer.json").is_file()

    ablation = tiny_config(tmp_path)
    ablation.allocation.policy = "uniform"  # another run of the same recipe: the same starting model
    again = build.build_warm_start(validate.validate(ablation), progress=progress)
    assert not again.trained and again.entry == first.entry and len(bars) == 1
    for a, b in zip(jax.tree.leaves(first.sft.params), jax.tree.leaves(again.sft.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert again.world.tokenizer.get_vocab() == first.world.tokenizer.get_vocab()


def _objects(gcs, prefix):
    """``{name: generation}`` of the bucket's objects under ``prefix``, asked of the emulator itself (GCS
    generations grow with each write, so they order the writes)."""
    import json
    import urllib.parse
    import urllib.request

    query = urllib.parse.urlencode({"prefix": prefix})
    with urllib.request.urlopen(f"{gcs.url}/storage/v1/b/{gcs.bucket}/o?{query}", timeout=10) as reply:
        return {item["name"]: int(item["generation"]) for item in json.load(reply).get("items", [])}


def test_a_warm_start_in_a_bucket_is_published_by_process_0_alone_and_downloaded_by_the_others(tmp_path, monkeypatch):
    """``warm_start.cache_dir`` in an emulated bucket, the job's processes played in turn (their index and barrier
    replaced; the other process's host has a fresh local folder). Process 0 trains, uploads the tokenizer before the
    barrier after which the others read it, and writes ``warm_start.json`` after every other object of the entry;
    process 1 downloads the tokenizer (complete entry or not), trains none, restores the same policy and writes
    nothing. Mutants caught: the marker written before the rest of the entry, every process uploading, a process
    that trains its own tokenizer instead of downloading process 0's."""
    import shutil

    from etils import epath

    from tests.gcs_emulator import gcs_emulator
    from trace_jax import paths

    at_barrier = {}

    def play(index):
        class Process:
            is_main = index == 0

            def barrier(self, name):
                at_barrier[index] = _objects(gcs, "warm_start/")

        monkeypatch.setattr(build, "Processes", Process)

    with gcs_emulator("bucket") as gcs:
        config = validate.validate(tiny_config(gcs.gs("warm_start")))
        play(0)
        first = build.build_warm_start(config)
        key, prefix = first.entry.key, f"warm_start/{first.entry.key}/"
        assert first.trained and first.entry.in_bucket and first.entry.info()["steps"] == 3
        assert not list(tmp_path.glob("**/gs:")), "the bucket URL became a local folder"
        entry = _objects(gcs, prefix)
        marker, tokenizer = prefix + warm_start.INFO_FILE, prefix + "tokenizer/tokenizer.json"
        assert tokenizer in at_barrier[0] and marker not in at_barrier[0], "the tokenizer is published, incomplete"
        assert any(name.startswith(prefix + "sft/") for name in entry), "the SFT checkpoint is in the bucket"
        assert entry[marker] > max(generation for name, generation in entry.items() if name != marker)

        def trains_no_tokenizer(*args, **kwargs):
            raise AssertionError("process 1 trained a tokenizer instead of downloading process 0's")

        monkeypatch.setattr(build, "train_world_tokenizer", trains_no_tokenizer)
        play(1)
        for complete in (True, False):  # another host later, and within the job (before process 0 finished)
            shutil.rmtree(paths.process_local_dir(gcs.gs("warm_start", key), "warm_start"))
            if not complete:
                epath.Path(gcs.gs(marker)).unlink()
            entry = _objects(gcs, prefix)
            other = build.build_warm_start(config)
            assert _objects(gcs, prefix) == entry, "process 1 wrote to the bucket"
            assert not other.trained and other.entry.key == key
            assert other.world.tokenizer.get_vocab() == first.world.tokenizer.get_vocab()
            for a, b in zip(jax.tree.leaves(first.sft.params), jax.tree.leaves(other.sft.params), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
