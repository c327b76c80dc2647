"""Command-line plumbing for the entry points: exit codes, one-line errors, the console and progress bars.

A user mistake (a bad config value, a missing file, an unusable workdir) raises a :class:`UserError`
subclass; :func:`run_main` turns it into one ``error: ...`` line on stderr and the class's exit code, with
no traceback unless ``--verbosity`` is 1 or more. Ctrl-C ends with one line and exit code 130; SIGTERM (how
spot / queued capacity announces a preemption) with exit code 143, after the main job has checkpointed what it
could within its grace (:class:`Termination`).

    console = Console(verbosity=0, log_path=workdir / "train.log")
    console.info("warm start: training 1000 steps")
    with console.progress(1000, "warm start (SFT)") as bar:
        bar.update(1)
    sys.exit(run_main(lambda: main(console), console))
"""

from __future__ import annotations

import _thread
import contextlib
import datetime
import enum
import logging
import os
import pathlib
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any, TextIO

from absl import logging as absl_logging
from tqdm import tqdm
from tqdm.std import EMA  # the smoothed rate tqdm keeps; restarted after the compiling step

from trace_jax.configs.errors import ConfigError


class ExitCode(enum.IntEnum):
    """What a process exit status means (distinct per kind of failure, so scripts can tell them apart)."""

    OK = 0
    FAILED = 1  # an unexpected error: a bug or a failure outside the user's control
    CONFIG = 2  # a flag or config value that is not allowed (nothing was done)
    MISSING_FILE = 3  # a file the user named does not exist (nothing was done)
    WORKDIR = 4  # the workdir cannot be used: a file, not writable, or a run with other settings
    INTERRUPTED = 130  # Ctrl-C; rerunning the same command resumes from the last checkpoint
    # SIGTERM (a preemption notice, 128 + 15): the main job finished or abandoned its step, checkpointed and
    # stopped within rl.preemption_grace_s; rerunning the same command resumes exactly (launch/tpu_pod.sh --watch)
    PREEMPTED = 143


class UserError(Exception):
    """An error the user can fix; its message is one line that says what happened and what to do."""

    exit_code = ExitCode.FAILED


class MissingFileError(UserError):
    exit_code = ExitCode.MISSING_FILE


class WorkdirError(UserError):
    exit_code = ExitCode.WORKDIR


class Interrupted(UserError):
    """Raised in place of KeyboardInterrupt once the run knows what to tell (its step, last checkpoint)."""

    exit_code = ExitCode.INTERRUPTED


class Preempted(Interrupted):
    """A SIGTERM stopped the run (see :class:`Termination`); the message says which checkpoint a rerun resumes."""

    exit_code = ExitCode.PREEMPTED


class Repeated:
    """Calls ``fire`` (on its own thread) ``delay_s`` seconds from now, then again every ``every_s`` seconds until
    :meth:`cancel`: a grace's deadline, repeated because the interrupt it raises can be lost (raised while a
    garbage-collector callback runs, which JAX installs, Python prints it as "Exception ignored" and goes on).
    The caller cancels it once the interrupt has reached it (on leaving the grace)."""

    def __init__(self, delay_s: float, fire: Callable[[], None], every_s: float = 1.0):
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(delay_s, fire, every_s), daemon=True)
        self._thread.start()

    def _run(self, delay_s: float, fire: Callable[[], None], every_s: float) -> None:
        wait = delay_s
        while not self._cancelled.wait(wait):
            fire()
            wait = every_s

    def cancel(self) -> None:
        self._cancelled.set()


class Termination:
    """SIGTERM as a preemption notice: a request to stop at the next safe point, with a deadline.

    Outside :meth:`grace` a SIGTERM interrupts at once (KeyboardInterrupt; ``run_main`` exits 143). Inside it,
    the SIGTERM only sets :attr:`requested`: the job finishes its step, checkpoints and raises
    :class:`Preempted`; should the step still be running ``abandon_after_s`` seconds after the notice, the
    main thread gets a KeyboardInterrupt there (the step is abandoned, the last checkpoint stays the
    resume point). ``run_main`` installs :data:`TERMINATION` as the SIGTERM handler.
    """

    def __init__(self) -> None:
        self.received_at: float | None = None  # time.monotonic() of the first SIGTERM
        self._abandon_after_s: float | None = None
        self._timer: Repeated | None = None
        self._expired = False  # the grace's deadline passed: the next notice interrupts

    @property
    def requested(self) -> bool:
        return self.received_at is not None

    def handle(self, signum: int, frame: Any) -> None:
        del signum, frame
        if self.received_at is None:
            self.received_at = time.monotonic()
        if self._abandon_after_s is None or self._expired:
            raise KeyboardInterrupt
        self._arm()

    def _arm(self) -> None:
        if self._timer is not None or self.received_at is None or self._abandon_after_s is None:
            return
        left = self._abandon_after_s - (time.monotonic() - self.received_at)
        if left == float("inf"):
            return
        self._timer = Repeated(max(left, 0.0), self._deadline_passed)

    def _deadline_passed(self) -> None:
        """The grace ran out: the main thread gets a KeyboardInterrupt from :meth:`handle`, run there as if a
        SIGTERM came. Not through SIGINT (``interrupt_main()``'s default): a job a script started in the
        background has SIGINT ignored, and Python then raises nothing for it."""
        self._expired = True
        _thread.interrupt_main(signal.SIGTERM)

    @contextlib.contextmanager
    def grace(self, abandon_after_s: float) -> Any:
        """Inside: a SIGTERM lets the work go on until the caller stops, at most ``abandon_after_s`` seconds after
        the notice (``inf``: until the caller stops). Graces nest; leaving one restores the enclosing one."""
        previous = self._abandon_after_s
        self._disarm()
        self._abandon_after_s = max(float(abandon_after_s), 0.0)
        self._arm()  # a notice that came before
        try:
            yield self
        finally:
            self._disarm()
            self._abandon_after_s = previous
            self._arm()

    def stop_if_requested(self) -> None:
        """Raises KeyboardInterrupt when a SIGTERM came and no grace holds it. The handler's own interrupt can be
        lost: raised while a garbage-collector callback runs (JAX installs one), Python prints it as "Exception
        ignored" and goes on. The job calls this at its setup's phase boundaries and SFT steps, so such a notice
        still stops it with exit code 143 instead of after the whole warm start and first evaluation."""
        if self.requested and self._abandon_after_s is None:
            raise KeyboardInterrupt

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._expired = False

    def reset(self) -> None:
        """Forgets a notice (tests that run several jobs in one process)."""
        self.received_at = None


TERMINATION = Termination()


# Loggers of libraries that narrate routine work (orbax checkpoint steps, absl's jax messages, index builds).
CHATTY_LOGGERS = ("absl", "orbax", "jax", "bm25s", "transformers", "tensorboardX", "matplotlib", "grain")


def _at_least_warning(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING


def quiet_third_party(verbosity: int) -> None:
    """Keeps libraries' routine messages off the console unless ``verbosity >= 1``.

    Call before importing transformers: it reads ``TRANSFORMERS_VERBOSITY`` once, at import (that is how its
    "PyTorch was not found" advisory is silenced when torch is absent).
    """
    if verbosity >= 1:
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    for name in CHATTY_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.ERROR)
        # A filter as well: some libraries set their own level when imported (bm25s sets DEBUG).
        logger.addFilter(_at_least_warning)
    absl_logging.set_verbosity(absl_logging.ERROR)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*os.fork.*")


class _NoBar:
    """Stands in for a progress bar when bars are off."""

    def update(self, n: int = 1) -> None:
        del n

    def set_postfix(self, **values: Any) -> None:
        del values

    def close(self) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class Console:
    """Progress lines for the user on stderr, also appended (timestamped) to ``log_path`` once attached.

    verbosity: -1 hides progress bars (lines still print), 0 the default, >= 1 adds tracebacks to errors.
    """

    def __init__(self, verbosity: int = 0, stream: TextIO | None = None, log_path: pathlib.Path | None = None):
        self.verbosity = verbosity
        self.stream = stream if stream is not None else sys.stderr
        self.log_path = log_path

    def attach_log(self, path: pathlib.Path) -> None:
        self.log_path = path

    def log(self, message: str) -> None:
        """Appends ``message`` to the run log only."""
        if self.log_path is not None:
            stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")
            with open(self.log_path, "a") as f:
                f.write(f"{stamp} {message}\n")

    def info(self, message: str) -> None:
        print(message, file=self.stream, flush=True)
        self.log(message)

    def error(self, message: str) -> None:
        print(f"error: {message}", file=self.stream, flush=True)
        with contextlib.suppress(OSError):  # the log may be the very thing that failed (a read-only workdir)
            self.log(f"error: {message}")

    def progress(self, total: int, description: str, unit: str = "step", initial: int = 0, leave: bool = True) -> Any:
        """A tqdm bar on the console with rate and ETA (or a no-op bar at ``verbosity < 0``); ``leave=False``
        erases it when closed (a bar inside another one)."""
        if self.verbosity < 0:
            return _NoBar()

        interactive = hasattr(self.stream, "isatty") and self.stream.isatty()
        return _PhaseBar(
            total=total,
            initial=initial,
            desc=description,
            unit=unit,
            leave=leave,
            file=self.stream,
            dynamic_ncols=interactive,
            mininterval=0.5 if interactive else 10.0,  # a log file gets a line every 10 s, not every step
        )


class _PhaseBar(tqdm):
    """A progress bar that says "compiling" and shows no rate or ETA until its first step is done.

    The first step of every phase (warm start, evaluation, RL) compiles its programs, which can take longer
    than many later steps; a rate measured over it would promise hours. The first step counts, its time
    does not: the description then says how long the compiling step took, and elapsed time, rate and ETA
    count from the end of it.
    """

    COMPILING = "{desc}: {n_fmt}/{total_fmt} [{elapsed}, compiling]"

    def __init__(self, **kwargs: Any):
        super().__init__(bar_format=self.COMPILING, **kwargs)
        self.compiling = True

    def update(self, n: float | None = 1) -> bool | None:
        if not self.compiling:
            return super().update(n)
        self.compiling = False
        now = self._time()
        self.set_description_str(f"{self.desc} (first step {now - self.start_t:.0f} s)", refresh=False)
        self.n += n or 0
        self.initial = self.last_print_n = self.n  # tqdm's rate is (n - initial) / elapsed until it has a smoothed one
        self.start_t = self.last_print_t = now
        self._ema_dn, self._ema_dt = EMA(self.smoothing), EMA(self.smoothing)
        self.bar_format = None  # tqdm's own format: bar, rate, ETA
        self.refresh()
        return True


def run_main(main: Callable[[], Any], console: Console) -> int:
    """Runs ``main`` and returns the exit code: 0, or the failure's code after one ``error:`` line.

    SIGTERM goes to :data:`TERMINATION` (like Ctrl-C, unless the job is inside its grace; exit code 143). With
    ``console.verbosity >= 1`` the traceback is printed as well.
    """
    signal.signal(signal.SIGTERM, TERMINATION.handle)
    try:
        main()
        return ExitCode.OK
    except (UserError, ConfigError) as e:  # ConfigError's exit_code is ExitCode.CONFIG
        if console.verbosity >= 1:
            traceback.print_exc(file=console.stream)
        console.error(str(e))
        return e.exit_code
    except KeyboardInterrupt:
        if console.verbosity >= 1:
            traceback.print_exc(file=console.stream)
        what = "stopped by SIGTERM" if TERMINATION.requested else "interrupted"
        console.error(f"{what}; rerun the same command to resume from the last checkpoint")
        return ExitCode.PREEMPTED if TERMINATION.requested else ExitCode.INTERRUPTED
    except Exception as e:  # anything else is unexpected: say so in one line, the traceback on request
        if console.verbosity >= 1:
            traceback.print_exc(file=console.stream)
        console.error(f"{type(e).__name__}: {e} (rerun with --verbosity=1 for the traceback)")
        return ExitCode.FAILED
