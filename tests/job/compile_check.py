"""Runs the real main job (``trace_jax.job.training.Training``) for N RL steps on a tiny config in this process and
prints, as JSON, every XLA compile after the first step: the engine's own counter and late list, and every
compile jax reports (``jax_log_compiles``), by function name and step.

    python -m tests.job.compile_check WORKDIR STEPS --config.x=y ...
"""

import ast
import json
import logging
import pathlib
import sys

import jax

from trace_jax.configs import load_config_file
from trace_jax.configs.validate import validate
from trace_jax.job.cli import Console
from trace_jax.job.commands import DEFAULT_CONFIG
from trace_jax.job.metrics import PhaseTimer
from trace_jax.job.training import Training


class CompileLog(logging.Handler):
    """Collects the function name of every ``Compiling <name> ...`` record jax logs."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Compiling "):
            self.names.append(message.split()[1])


def override(config, assignment: str) -> None:
    path, value = assignment.removeprefix("--config.").split("=", 1)
    *parents, leaf = path.split(".")
    for name in parents:
        config = config[name]
    old = config[leaf]
    if isinstance(old, tuple):  # '(512,)', as the command line takes it
        config[leaf] = ast.literal_eval(value)
    elif isinstance(old, int | float) and not isinstance(old, bool):
        config[leaf] = type(old)(float(value))
    else:
        config[leaf] = value


def main(workdir: str, steps: int, overrides: list[str]) -> None:
    config = load_config_file(str(DEFAULT_CONFIG))
    for assignment in overrides:
        override(config, assignment)
    jax.config.update("jax_log_compiles", True)
    handler = CompileLog()
    logging.getLogger("jax").addHandler(handler)
    logging.getLogger("jax").setLevel(logging.DEBUG)
    config.warm_start.cache_dir = str(pathlib.Path(workdir) / "warm_start_cache")
    run = Training(validate(config), pathlib.Path(workdir), Console(verbosity=0), PhaseTimer())
    engine = run.sampler.runner.engine
    per_step, engine_counts = [], []
    for _ in range(steps):
        start = len(handler.names)
        run.rl_step()
        per_step.append(handler.names[start:])
        engine_counts.append(engine.programs.total)
    print(
        json.dumps(
            {
                "per_step": per_step,
                "engine_programs": engine_counts,
                "engine_late": [shapes for _, shapes in engine.programs.late],
                "engine_compilations": dict(engine.programs.compilations),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
