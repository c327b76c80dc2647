"""A main-job run directory: can it be used, does it hold this run or another one, is the run finished.

These checks run before any work, so a bad ``--workdir`` fails in a second with one line (``WorkdirError``)
instead of after the warm start. A workdir holds one run: rerunning with the same config resumes it, with a
larger ``rl.steps`` extends it; any other change of settings is refused (the logs would mix two runs).
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
from typing import TYPE_CHECKING, Any

from trace_jax import paths
from trace_jax.job.cli import ConfigError, WorkdirError

if TYPE_CHECKING:  # the config dataclasses import JAX
    from trace_jax.configs import RunConfig

CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.json"
CHECKPOINTS = "checkpoints"
LOG_FILE = "train.log"
# Keys a run may change between invocations of one workdir: its length, where the shared warm-start cache
# lives, how the processes find each other and how long a SIGTERM's grace is.
EXTENSIBLE = ("rl.steps", "rl.preemption_grace_s", "warm_start.cache_dir", "distributed.")


def check_usable(workdir: pathlib.Path) -> None:
    """Creates ``workdir`` if needed; raises :class:`WorkdirError` if it is a file or cannot be written."""
    if paths.is_url(workdir):  # a bucket: no local write test; the first write reports a missing permission
        workdir.mkdir(parents=True, exist_ok=True)
        return
    if workdir.exists() and not workdir.is_dir():
        raise WorkdirError(f"--workdir {workdir} is a file, not a directory; pass a directory (created if missing)")
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=workdir, prefix=".write_test"):
            pass
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise WorkdirError(f"--workdir {workdir} cannot be written ({reason}); pass a writable directory") from None
    if not os.access(workdir, os.W_OK | os.X_OK):
        raise WorkdirError(f"--workdir {workdir} cannot be written (permission denied); pass a writable directory")


def checkpoint_steps(workdir: pathlib.Path) -> list[int]:
    """Finished checkpoint steps in ``workdir`` (orbax names a finished step by its number), ascending."""
    directory = workdir / CHECKPOINTS
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(_flat(value, f"{prefix}{key}."))
    return flat


def config_dict(config: RunConfig) -> dict[str, Any]:
    """The config as the JSON ``config.json`` holds (tuples as lists): ``RunConfig.to_dict``."""
    return config.to_dict()


def changed_keys(saved: dict[str, Any], config: RunConfig) -> list[str]:
    """``key: old -> new`` for each setting both configs have and that differs, ignoring the
    :data:`EXTENSIBLE` keys (keys only one side has come from another code version: not a change of run)."""
    old, new = _flat(saved), _flat(config_dict(config))
    changes = []
    for key in sorted(set(old) & set(new)):
        if any(key == e or (e.endswith(".") and key.startswith(e)) for e in EXTENSIBLE):
            continue
        if old[key] != new[key]:
            changes.append(f"{key}: {old[key]!r} -> {new[key]!r}")
    return changes


def read_saved_config(path: pathlib.Path) -> dict[str, Any]:
    """A run's ``config.json``, retired keys mapped to the keys that replace them (``configs.upgrade``): a run
    saved with retired keys resumes and evaluates like any other."""
    from trace_jax.configs import upgrade  # the config dataclasses import JAX

    return upgrade(json.loads(path.read_text()))


def check_same_run(workdir: pathlib.Path, config: RunConfig) -> None:
    """Raises :class:`WorkdirError` when ``workdir`` holds a run whose settings differ from ``config``."""
    path = workdir / CONFIG_FILE
    if not path.is_file():
        return
    try:
        saved = read_saved_config(path)
    except json.JSONDecodeError:
        return  # torn by a kill while it was written: it is rewritten from this config
    changes = changed_keys(saved, config)
    if changes:
        shown = "; ".join(changes[:3]) + (f"; and {len(changes) - 3} more" if len(changes) > 3 else "")
        raise WorkdirError(
            f"{workdir} holds a run with other settings ({shown}); rerun it with its own settings "
            "(a larger rl.steps extends it) or pass another --workdir"
        )


def finished_summary(workdir: pathlib.Path, config: RunConfig) -> dict[str, Any] | None:
    """The summary of a run that already has ``config.rl.steps`` steps, else None (it must run).

    Raises :class:`ConfigError` when the workdir is further along than ``rl.steps`` (a run never shrinks).
    """
    steps = config.rl.steps
    done = max(checkpoint_steps(workdir), default=0)
    summary = None
    path = workdir / SUMMARY_FILE
    if path.is_file():
        try:
            summary = json.loads(path.read_text())
        except json.JSONDecodeError:
            summary = None
    if summary is not None:
        done = max(done, summary.get("steps", 0))
    if done > steps:
        raise ConfigError(
            f"config.rl.steps={steps} but {workdir} already holds {done} RL steps; "
            f"pass --config.rl.steps={done} (or more) or another --workdir"
        )
    if summary is not None and summary.get("steps") == steps:
        return summary
    return None
