"""Where numbers go: TensorBoard event files + ``metrics.jsonl``, PNG curves, and small summary tables.

    writer = MetricWriter(workdir, resume_step=restored_step)   # None for a fresh run
    writer.write(step, {"reward": 0.4, "effective_ratio": 0.55}, prefix="rollout/")
    writer.close()
    records = read_jsonl(workdir / "metrics.jsonl")
    plot_metrics(records, ["rollout/reward", "eval/em"], workdir / "curves.png")
    print(format_table([{"policy": "trace", "EM": 0.41}, {"policy": "uniform", "EM": 0.38}]))

``metrics.jsonl`` holds one JSON object per ``write`` call: ``{"step": s, "<name>": value, ...}``. Both outputs
are flushed by every ``write``, so a kill loses nothing already written. On resume from a checkpoint at step
``s`` the records after ``s`` are dropped (they belong to the lost part of the killed run) and the records up
to ``s`` are kept, the checkpoint step's included; TensorBoard gets the same view through its purge marker: a
new event file starts with ``SessionLog.START`` at step ``s + 1``, and readers (``EventAccumulator``, the
TensorBoard UI) then drop every earlier-file event at a step > ``s``. So a resumed run's logs read exactly
like an uninterrupted run's, provided the caller writes each step's record before checkpointing that step.
A fresh run (``resume_step=None``) starts both outputs over.
"""

from __future__ import annotations

import contextlib
import json
import math
import socket
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.record_writer import RecordWriter

JSONL_NAME = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def _scalar(value: Any) -> float | None:
    """A float for numbers / 0-d arrays / bools, None for anything else (not logged)."""
    try:
        array = np.asarray(value)
    except Exception:
        return None
    if array.ndim != 0 or not (np.issubdtype(array.dtype, np.number) or array.dtype == bool):
        return None
    return float(array)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl file, in order; a torn last line (killed writer) is ignored."""
    records = []
    path = Path(path)
    if not path.exists():
        return records
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class EventFile:
    """One TensorBoard event file, written synchronously: every ``write_scalars`` is on disk when it returns.

    (tensorboardX's ``SummaryWriter`` hands events to a background thread whose queue its ``flush`` does not
    wait for, so a kill right after a logged step could lose it; this writes the same records itself.)

    purge_step: when set, the file starts with ``SessionLog.START`` at that step, which tells readers to drop
      every event of earlier files at a step >= ``purge_step``.
    """

    def __init__(self, directory: Path, purge_step: int | None = None):

        directory.mkdir(parents=True, exist_ok=True)
        # Named like TensorBoard's own files; readers take the files in name order, so the nanosecond suffix
        # orders (and keeps apart) writers started within the same second.
        now = time.time_ns()
        name = f"events.out.tfevents.{now // 10**9:010d}.{socket.gethostname()}.{now:020d}"
        self.path = directory / name
        self._writer = RecordWriter(str(self.path))
        start = 0 if purge_step is None else purge_step
        self._write(Event(wall_time=time.time(), step=start, file_version="brain.Event:2"))
        if purge_step is not None:
            self._write(Event(wall_time=time.time(), step=start, session_log=SessionLog(status=SessionLog.START)))
        self._writer.flush()

    def _write(self, event: Any) -> None:
        self._writer.write(event.SerializeToString())

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:

        values = [Summary.Value(tag=name, simple_value=float(value)) for name, value in scalars.items()]
        self._write(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))
        self._writer.flush()

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MetricWriter:
    """Writes scalar metrics to TensorBoard event files and to ``<logdir>/metrics.jsonl``.

    Args:
      logdir: directory for both outputs (created if missing); events go to ``logdir/tensorboard``.
      resume_step: resuming from a checkpoint at this step: keep what was logged up to and including it,
        drop (jsonl) or purge (TensorBoard) anything later. None: a fresh run, earlier logs are deleted.
      tensorboard: also write TensorBoard event files (tensorboardX).
    """

    def __init__(self, logdir: str | Path, resume_step: int | None = None, tensorboard: bool = True):
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.logdir / JSONL_NAME
        self.tensorboard_dir = self.logdir / TENSORBOARD_DIR
        if resume_step is not None and self.jsonl_path.exists():
            kept = [r for r in read_jsonl(self.jsonl_path) if r.get("step", -1) <= resume_step]
            self.jsonl_path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        elif resume_step is None:  # a fresh run starts fresh logs
            self.jsonl_path.unlink(missing_ok=True)
            for events in self.tensorboard_dir.glob("events.out.tfevents.*"):
                events.unlink()
        self._jsonl = self.jsonl_path.open("a")
        self._tb = None
        if tensorboard:
            # The purge marker sits one step past the checkpoint: a reader keeps the checkpoint step's events.
            self._tb = EventFile(self.tensorboard_dir, purge_step=None if resume_step is None else resume_step + 1)

    def write(self, step: int, metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
        """Logs every scalar of ``metrics`` (non-scalars are skipped) under ``prefix + name``; returns them."""
        scalars = {prefix + k: v for k, v in ((k, _scalar(v)) for k, v in metrics.items()) if v is not None}
        record = {"step": int(step), **{k: (v if math.isfinite(v) else None) for k, v in scalars.items()}}
        if self._tb is not None:
            # Undefined figures (an AUC with one class) stay out of the curves.
            self._tb.write_scalars(int(step), {k: v for k, v in scalars.items() if math.isfinite(v)})
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        return scalars

    def flush(self) -> None:
        self._jsonl.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> MetricWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PhaseTimer:
    """Wall-clock seconds per named phase (warm start, evaluation, RL, ...) plus ``total``, accumulated over
    every process of a run: ``state_dict()`` goes into a checkpoint, ``load_state_dict`` adds it back.

    with timer.phase("evaluation"): ...
    timer.state_dict()   # {"evaluation": 12.5, "total": 30.1}
    """

    def __init__(self) -> None:
        self._totals: dict[str, float] = {}
        self._started = time.perf_counter()
        self._earlier_total = 0.0

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._totals[name] = self._totals.get(name, 0.0) + time.perf_counter() - start

    def state_dict(self) -> dict[str, float]:
        total = self._earlier_total + time.perf_counter() - self._started
        return {**{k: round(v, 3) for k, v in self._totals.items()}, "total": round(total, 3)}

    def load_state_dict(self, saved: Mapping[str, float]) -> None:
        """Adds a saved run's seconds (up to its checkpoint) to this process's."""
        for name, seconds in saved.items():
            if name == "total":
                self._earlier_total += seconds
            else:
                self._totals[name] = self._totals.get(name, 0.0) + seconds


# ---------------------------------------------------------------------------------------------- plots
def _pyplot():
    import matplotlib  # pyplot must not load before its file-only backend is chosen, nor on every import

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: str | Path) -> Path:
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def series(records: Iterable[Mapping[str, Any]], key: str, x_key: str = "step") -> tuple[np.ndarray, np.ndarray]:
    """(x, y) float arrays of the records that have a finite ``key``."""
    points = [(r[x_key], r[key]) for r in records if r.get(key) is not None and r.get(x_key) is not None]
    points = [(x, y) for x, y in points if math.isfinite(y)]
    if not points:
        return np.zeros(0), np.zeros(0)
    x, y = zip(*points, strict=True)
    return np.asarray(x, np.float64), np.asarray(y, np.float64)


def plot_metrics(
    records: Sequence[Mapping[str, Any]],
    keys: Sequence[str],
    path: str | Path,
    x_key: str = "step",
    title: str | None = None,
) -> Path:
    """One panel per metric key (a curve over ``x_key``), saved as a PNG; keys with no data are left empty."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        x, y = series(records, key, x_key)
        ax.plot(x, y, marker="o" if len(x) < 30 else None, markersize=3)
        ax.set_title(key)
        ax.set_xlabel(x_key)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    return _save(plt, fig, path)


def mean_std_curve(runs: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x, mean, std) over runs, at the x values every run has (population std; 0 for one run)."""
    if not runs:
        return np.zeros(0), np.zeros(0), np.zeros(0)
    common = sorted(set.intersection(*(set(np.asarray(x).tolist()) for x, _ in runs)))
    stacked = np.stack([[dict(zip(np.asarray(x).tolist(), y, strict=True))[c] for c in common] for x, y in runs])
    return np.asarray(common, np.float64), stacked.mean(axis=0), stacked.std(axis=0)


def plot_mean_std(
    groups: Mapping[str, Sequence[tuple[np.ndarray, np.ndarray]]],
    path: str | Path,
    xlabel: str = "step",
    ylabel: str = "",
    title: str | None = None,
) -> Path:
    """One line per group (e.g. allocation policy): mean over its runs (seeds) with a ±std band; a PNG."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for label, runs in groups.items():
        x, mean, std = mean_std_curve(runs)
        ax.plot(x, mean, label=f"{label} (n={len(runs)})")
        ax.fill_between(x, mean - std, mean + std, alpha=0.2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    return _save(plt, fig, path)


# --------------------------------------------------------------------------------------------- tables
def format_mean_std(values: Sequence[float], digits: int = 3) -> str:
    """``"mean ± std"`` (population std) of a list of numbers; ``"n/a"`` when empty."""
    if len(values) == 0:
        return "n/a"
    array = np.asarray(values, np.float64)
    return f"{array.mean():.{digits}f} ± {array.std():.{digits}f}"


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None, digits: int = 3) -> str:
    """A Markdown table (pipes, header separator) of ``rows``; floats get ``digits`` decimals, missing cells ``-``."""
    if not rows:
        return ""
    if columns is None:
        columns = list(dict.fromkeys(k for row in rows for k in row))

    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float | np.floating):
            return f"{value:.{digits}f}"
        return str(value)

    body = [[cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(str(c)), *(len(r[i]) for r in body)) for i, c in enumerate(columns)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"
    separator = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line([str(c) for c in columns]), separator, *(line(r) for r in body)])
