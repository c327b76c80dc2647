"""Multi-host start-up: ``jax.distributed`` initialisation driven by the run's config, never by surprise.

On a Cloud TPU pod every host runs the same command; ``jax.distributed.initialize()`` with no arguments
discovers the coordinator from the TPU metadata. On GPU clusters the coordinator, the process count and
this process's id are given explicitly (the launch scripts pass them as config overrides).
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """``mode``: "none" (one process), "auto" (TPU pods: discovered) or "explicit" (the three fields below)."""

    mode: str = "none"
    coordinator_address: str = ""
    num_processes: int = 1
    process_id: int = 0


def initialize(config: DistributedConfig) -> None:
    """Joins this process to the job. Must run before anything touches a device."""
    if config.mode == "none":
        return
    if config.mode == "auto":
        jax.distributed.initialize()
        return
    if config.mode != "explicit":
        raise ValueError(f"distributed.mode={config.mode!r}; choose 'none', 'auto' or 'explicit'")
    if not config.coordinator_address or not 0 <= config.process_id < config.num_processes:
        raise ValueError(
            "distributed.mode='explicit' needs coordinator_address (host:port), num_processes >= 1 and "
            f"0 <= process_id < num_processes; got {config}"
        )
    jax.distributed.initialize(config.coordinator_address, config.num_processes, config.process_id)


def is_main_process() -> bool:
    """Only process 0 writes logs, plots and summaries (checkpoints are written collectively by orbax)."""
    return jax.process_index() == 0
