"""Hugging Face checkpoints: ``python -m trace_jax.hf {import,export} --help``."""

import sys

from trace_jax.job.commands import hf_main

if __name__ == "__main__":
    sys.exit(hf_main())
