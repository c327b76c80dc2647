"""The sampling side in a process of its own, pinned to its own CPU cores (``mesh.rollout_cpus = n``).

XLA:CPU runs every program of a process, on any of its host devices, on one shared thread pool: two host
devices in one process (``mesh.rollout_devices``) still contend for every core, so a decode running beside an
update slows it down, and the overlap of ``rl.max_staleness >= 1`` gains less than it could. Here the sampling
side (``trace_jax.job.sampling.SamplingSide``) is built in a child process (``spawn``: a fresh interpreter, its
own JAX) pinned to the last ``n`` cores this process may use, and the trainer's threads keep the others; each
has its own XLA runtime and thread pool. On accelerators, disjoint devices in one process already split the work
(``mesh.rollout_devices``); this is for CPU hosts.

The child rebuilds the world from the config and the warm start's tokenizer (the synthetic recipe), and serves the
sampling side's calls over a pipe: the weights go in as host arrays after each update, the trees, metrics,
evaluation rows and checkpoint state come back pickled. Calls are answered in order, one at a time; an error in
the child is raised here with the child's traceback; the child ends with this process (``PR_SET_PDEATHSIG`` on
Linux, and an end of the pipe anywhere).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import pathlib
import threading
import traceback
from collections.abc import Sequence
from typing import Any

import jax

from trace_jax.cluster.pipeline import Sampled
from trace_jax.cluster.processes import Processes
from trace_jax.configs import RunConfig
from trace_jax.job import build, recipes
from trace_jax.job.sampling import SamplingSide
from trace_jax.models import ModelConfig, lora
from trace_jax.parallel.mesh import make_mesh

# The calls a child serves: ``SamplingSide``'s methods that cross the pipe.
CALLS = ("set_weights", "sample", "warm_up_predictor", "evaluate", "state_dict", "load_state_dict")
_PR_SET_PDEATHSIG, _SIGKILL = 1, 9


def split_cpus(sampling: int, available: Sequence[int] | None = None) -> tuple[list[int], list[int]]:
    """(the sampling process's cores, the trainer's): the last ``sampling`` of ``available`` (default: the cores
    this process may run on) and the rest. Raises ``ValueError`` unless both get at least one."""
    cores = sorted(os.sched_getaffinity(0) if available is None else available)
    if not 1 <= sampling < len(cores):
        raise ValueError(
            f"mesh.rollout_cpus={sampling} must leave the trainer a core: this process may use {len(cores)} "
            f"({cores}); allowed 1 to {len(cores) - 1}"
        )
    return cores[-sampling:], cores[:-sampling]


def pin_threads(cores: Sequence[int]) -> None:
    """Every thread of this process (those XLA started too) onto ``cores``; threads started later inherit it."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cores)


class SamplingProcess:
    """A ``SamplingSide`` in a child process: the same calls, answered over a pipe.

    Args:
      config: the run's config (its ``world`` section and the sampling side's sections are what the child uses).
      model_config: the policy's architecture.
      world_dir: where the warm start keeps the world's tokenizer (``build.build_world``'s ``workdir``).
      cpus: how many cores the child gets (``mesh.rollout_cpus``); the trainer's threads keep the rest.
    """

    layout = None  # the engine's layout lives in the child; the weights cross as host arrays

    def __init__(self, config: RunConfig, model_config: ModelConfig, world_dir: str, cpus: int):
        sampling, training = split_cpus(cpus)
        self._restore = sorted(os.sched_getaffinity(0))
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._lock = threading.Lock()
        self._weights: Any = None  # the host copy of the weights last sent to the child
        self._process = context.Process(
            target=serve,
            args=(child, config, model_config, world_dir, sampling),
            name="trace-jax-sampling",
            daemon=True,
        )
        self._process.start()
        child.close()
        try:
            self._call("ready")  # the child built its engine, runners, scheduler and prompt stream
        except BaseException:
            self.close(wait=False)
            raise
        pin_threads(training)
        self.cores = {"sampling": sampling, "training": training}

    def _call(self, method: str, *args: Any) -> Any:
        with self._lock:
            try:
                self._conn.send((method, args))
                status, value = self._conn.recv()
            except (EOFError, OSError) as error:
                self._process.join(timeout=5)
                raise RuntimeError(
                    f"the sampling process ended (exit code {self._process.exitcode}) during {method}"
                ) from error
        if status == "error":
            raise RuntimeError(f"the sampling process failed in {method}:\n{value}")
        return value

    def set_weights(self, weights: Any) -> None:
        # The host copy sent is kept: ``weights`` answers with it while the child is busy sampling.
        sent = jax.device_get(weights)
        self._call("set_weights", sent)
        self._weights = lora.received(self._weights, sent)

    def weights(self) -> Any:
        """A host copy of the weights the child's engine holds (the ones last sent)."""
        return self._weights

    def sample(self, step: int, version: int) -> Sampled:
        return self._call("sample", step, version)

    def warm_up_predictor(self) -> dict[str, float]:
        return self._call("warm_up_predictor")

    def evaluate(self, tasks: list[Any], chunk_size: int, progress: Any = None) -> list[dict[str, Any]]:
        rows = self._call("evaluate", tasks, chunk_size)
        if progress is not None:
            progress.update(len(tasks))
        return rows

    def sampled_questions(self, trees: list[Any]) -> list[list[str]]:
        return Processes().sampled_questions(None, trees)  # one JAX process: the trees' own questions

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._call("load_state_dict", state)

    def describe(self) -> dict[str, Any]:
        """Facts for a run's summary: the cores of each side."""
        return dict(self.cores)

    def close(self, wait: bool = True) -> None:
        """Ends the child (asked to, when ``wait`` and it is idle; else killed) and gives this process its cores
        back."""
        if self._process.is_alive() and wait and not self._lock.locked():
            with contextlib.suppress(EOFError, OSError):
                self._conn.send(("close", ()))
            self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=5)
        self._conn.close()
        pin_threads(self._restore)


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent ends (a parent's ``os._exit`` runs no cleanup)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, _SIGKILL)


def serve(conn: Any, config: RunConfig, model_config: ModelConfig, world_dir: str, cores: list[int]) -> None:
    """The child's main: pins itself, builds the sampling side, then answers calls until told to close."""
    _die_with_parent()
    pin_threads(cores)  # before JAX's backend starts its threads: they inherit it
    try:
        world = build.build_world(config, pathlib.Path(world_dir))
        prompts = recipes.source_of(config).prompt_stream(config, world)
        mesh = make_mesh(data=1, fsdp=-1, tensor=1, devices=jax.devices())
        side = SamplingSide(config, world, model_config, prompts, mesh, Processes())
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):  # the trainer's process is gone
            return
        if method == "close":
            return
        try:
            if method == "ready":
                value = None
            elif method in CALLS:
                value = getattr(side, method)(*args)
            else:
                raise ValueError(f"unknown call {method!r}; the sampling process serves {list(CALLS)}")
            conn.send(("ok", value))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
