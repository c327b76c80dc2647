"""The main job's command line: usage text, flag parsing and the run config it names (file + overrides)."""

from __future__ import annotations

import pathlib
from typing import Any

import ml_collections

from trace_jax import cli

DEFAULT_CONFIG = pathlib.Path(__file__).resolve().parents[1] / "configs" / "default.py"
DEFAULT_WORKDIR = "./runs/default"
USAGE = f"""usage: python -m trace_jax.train [--config=FILE[:ARG]] [--workdir=DIR] [--config.KEY=VALUE ...]
                                [--show-config] [--verbosity=N]

Trains the TRACE agent end to end: warm start (cached), evaluation, RL, evaluation.

options:
  --config=FILE[:ARG]   a config file (default: configs/default.py); ablations: configs/ablation.py:uniform
  --config.KEY=VALUE    override any config key, e.g. --config.rl.steps=40 --config.optim.learning_rate=1e-4
  --workdir=DIR         run directory (default: {DEFAULT_WORKDIR}); rerunning resumes, a larger rl.steps extends
  --show-config         print every config key with its value and doc (overrides applied), then exit
  --verbosity=N         1 or more: library logs and full tracebacks on errors
  -h, --help            show this help and exit

exit codes: 0 done (or already complete), 2 bad flag or config value, 3 missing file, 4 unusable workdir,
130 interrupted (rerun the same command to resume), 1 unexpected error."""


# -------------------------------------------------------------------------------------------- command line
def flag_value(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def verbosity_of(argv: list[str]) -> int:
    value = flag_value(argv, "verbosity") or flag_value(argv, "v")
    try:
        return int(value) if value is not None else 0
    except ValueError:
        return 0  # reported properly when the flags are parsed


def _fresh_flag_values(argv: list[str]) -> Any:
    """A fresh absl flag set for one command line (the global one keeps state between parses)."""
    from absl import flags
    from ml_collections import config_flags

    values = flags.FlagValues()
    # config_flags reads the --config.x overrides from the argv given here (sys.argv when None).
    config_flags.DEFINE_config_file(
        "config", str(DEFAULT_CONFIG), "Run config (a configs/*.py file).", flag_values=values, sys_argv=argv
    )
    flags.DEFINE_string("workdir", DEFAULT_WORKDIR, "Run directory: checkpoints, logs, plots.", flag_values=values)
    flags.DEFINE_bool("show_config", False, "Print every config key, its value and doc.", flag_values=values)
    flags.DEFINE_integer("verbosity", 0, "1 or more: library logs and tracebacks.", short_name="v", flag_values=values)
    return values


def load_config(argv: list[str]) -> tuple[ml_collections.ConfigDict, Any]:
    """The config of a command line (file, then ``--config.x=v`` overrides) and the parsed flags.

    Raises ``MissingFileError`` for a config file that does not exist and ``ConfigError`` for a config file
    that fails, an unknown key, a value of the wrong type or a stray argument; nothing else is touched.
    """
    from trace_jax.config_utils import load_config_file, unknown_overrides

    spec = flag_value(argv, "config") or str(DEFAULT_CONFIG)
    path = pathlib.Path(spec.partition(":")[0])
    if not path.is_file():
        raise cli.MissingFileError(f"config file {path} does not exist; pass --config=configs/<name>.py")
    try:
        base = load_config_file(spec)
    except (ValueError, TypeError, KeyError) as e:
        raise cli.ConfigError(f"--config={spec}: {' '.join(str(e).split())}") from None
    problems = unknown_overrides([a for a in argv if a.startswith("--config.")], base)
    if problems:
        raise cli.ConfigError("; ".join(problems) + " (--show-config lists every key)")
    argv = [("--show_config" if arg == "--show-config" else arg) for arg in argv]
    if flag_value(argv, "config") is None:  # named explicitly, so the overrides are parsed against it
        argv = [argv[0], f"--config={spec}", *argv[1:]]
    values = _fresh_flag_values(argv)
    try:
        rest = values(argv)
    except Exception as e:  # absl's flag errors and ml_collections' type errors for a --config.x value
        raise cli.ConfigError(f"{' '.join(str(e).split())} (see --help)") from None
    if len(rest) > 1:
        raise cli.ConfigError(f"unexpected arguments {rest[1:]}; options look like --config.rl.steps=40 (see --help)")
    return values.config, values
