"""The main job's command: ``python -m trace_jax.train --help``."""

from trace_jax.job.commands import train_and_exit

if __name__ == "__main__":
    train_and_exit()
