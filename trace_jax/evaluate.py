"""Evaluates a run: ``python -m trace_jax.evaluate --workdir RUN [--split test]``."""

import sys

from trace_jax.job.commands import evaluate_main

if __name__ == "__main__":
    sys.exit(evaluate_main())
