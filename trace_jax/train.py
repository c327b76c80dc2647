"""The main job's command: ``python -m trace_jax.train --help``."""

import os
import sys

from trace_jax.cli import ExitCode
from trace_jax.job.commands import train_main

if __name__ == "__main__":
    code = train_main()
    if code == ExitCode.PREEMPTED:
        # The checkpoint is written and the logs are closed: skip the interpreter's teardown (freeing every array,
        # joining library threads), which took ~40 s under load, longer than a preemption notice leaves.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
