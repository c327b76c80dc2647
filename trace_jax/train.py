"""The main job's command: ``python -m trace_jax.train --help``."""

import sys

from trace_jax.job.commands import train_main

if __name__ == "__main__":
    sys.exit(train_main())
