"""Multi-host start-up: ``jax.distributed`` initialisation driven by the run's config, never by surprise.

On a Cloud TPU pod every host runs the same command; ``jax.distributed.initialize()`` with no arguments
discovers the coordinator from the TPU metadata. On GPU clusters the coordinator, the process count and
this process's id are given explicitly (the launch scripts pass them as config overrides).

Who does what once several processes run: ``is_main_process`` (process 0) alone writes logs, plots and
summaries (``MainProcessWriter``, ``run_on_main``); checkpoints are written by every process together
(orbax). Data across processes: ``trace_jax.parallel.multihost``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import jax

from trace_jax.config_utils import documented

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How this process joins a job of several JAX processes (``jax.distributed.initialize``)."""

    mode: str = documented(
        "none",
        '"none" (one process), "auto" (TPU pods: the coordinator and process ids are discovered) or "explicit" (GPU '
        "clusters: the three fields below, passed by the launcher).",
    )
    coordinator_address: str = documented("", '"host:port" of process 0 (mode "explicit").')
    num_processes: int = documented(1, 'how many processes the job has (mode "explicit").')
    process_id: int = documented(0, 'this process\'s index, 0 .. num_processes - 1 (mode "explicit").')
    heartbeat_timeout_s: int = documented(
        100,
        "seconds without a heartbeat after which a process counts as lost: the job's other processes then stop "
        "with an error naming it (instead of waiting on it in a collective). Shorter finds a dead host sooner; "
        "too short for the machine's pauses (a long compile, a busy host) stops a healthy job.",
    )


def initialize(config: DistributedConfig) -> None:
    """Joins this process to the job. Must run before anything touches a device.

    A no-op when this process has already joined (a wrapper or a notebook initialised it first). jax's
    preemption service is turned off: its SIGTERM handler would replace the job's own
    (``trace_jax.job.cli.Termination``), and a preempted job would run on instead of checkpointing and exiting 143.
    """
    if config.mode == "none" or jax.distributed.is_initialized():
        return
    if config.heartbeat_timeout_s < 1:
        raise ValueError(f"distributed.heartbeat_timeout_s={config.heartbeat_timeout_s}; give a number of seconds >= 1")
    timeouts = {"heartbeat_timeout_seconds": config.heartbeat_timeout_s}
    jax.config.update("jax_enable_preemption_service", False)
    if config.mode == "auto":
        jax.distributed.initialize(**timeouts)
        return
    if config.mode != "explicit":
        raise ValueError(f"distributed.mode={config.mode!r}; choose 'none', 'auto' or 'explicit'")
    if not config.coordinator_address or not 0 <= config.process_id < config.num_processes:
        raise ValueError(
            "distributed.mode='explicit' needs coordinator_address (host:port), num_processes >= 1 and "
            f"0 <= process_id < num_processes; got {config}"
        )
    jax.distributed.initialize(config.coordinator_address, config.num_processes, config.process_id, **timeouts)


def process_index() -> int:
    """This process's index in [0, process_count()); 0 in a one-process run."""
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


def is_main_process() -> bool:
    """Only process 0 writes logs, plots and summaries (checkpoints are written collectively by orbax)."""
    return jax.process_index() == 0


def run_on_main(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
    """``fn(*args, **kwargs)`` on process 0; None elsewhere. For one-off writes: plots, summary.json."""
    return fn(*args, **kwargs) if is_main_process() else None


class MainProcessWriter:
    """A writer that exists only on process 0: on other processes every method call does nothing.

    ``writer = MainProcessWriter(lambda: MetricWriter(workdir))`` builds the real writer (and its files)
    on process 0 only; ``writer.write(step, metrics)`` and ``writer.close()`` are no-ops returning None
    elsewhere. Reduce metrics across processes *before* writing (``multihost.reduce_metrics``): the
    reduction is collective, the write is not.
    """

    def __init__(self, make: Callable[[], Any]):
        self._writer = make() if is_main_process() else None

    @property
    def active(self) -> bool:
        """True on the process that really writes."""
        return self._writer is not None

    def __getattr__(self, name: str) -> Any:
        writer = self.__dict__.get("_writer")
        if writer is None:
            return lambda *args, **kwargs: None
        return getattr(writer, name)
