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
