"""The commands: ``python -m trace_jax.train``, ``python -m trace_jax.evaluate`` and ``python -m trace_jax.hf``.

Each ``*_main(argv)`` parses its command line, runs the job and returns the exit code (``trace_jax.job.cli.ExitCode``);
the modules ``trace_jax.train``, ``trace_jax.evaluate`` and ``trace_jax.hf`` only call them. The parts that import
JAX are imported inside the commands, so ``--help`` and a mistyped flag answer at once.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

from absl import flags

from trace_jax.job import cli

DEFAULT_CONFIG = pathlib.Path(__file__).resolve().parents[2] / "configs" / "default.py"
DEFAULT_WORKDIR = "./runs/default"
USAGE = f"""usage: python -m trace_jax.train [--config=FILE[:ARG]] [--workdir=DIR] [--config.KEY=VALUE ...]
                                [--show-config] [--verbosity=N]

Trains the TRACE agent end to end: warm start (cached), evaluation, RL, evaluation.

The default config runs in a few minutes on a 2-core CPU (the README's quick start gives the time and memory
measured there); its warm start is cached for later runs. Each phase's first step compiles its programs: its
progress bar says "compiling" and shows a rate and ETA once that step is done.

What the summary prints:
  effective ratio    share of a step's prompts whose rollout tree holds both a success and a failure, so its
                     group advantages are not all zero (only those prompts give RL a gradient)
  EM / F1            exact match / token F1 of the final answer against the gold answers (greedy decoding),
                     per number of hops, on held-out questions; "sft" before RL, "rl" after it
  generated tokens   tokens the policy sampled over all RL steps (the sampling budget actually spent)

options:
  --config=FILE[:ARG]   a config file (default: configs/default.py); ablations: configs/ablation.py:uniform
  --config.KEY=VALUE    override any config key, e.g. --config.rl.steps=40 --config.optim.learning_rate=1e-4
  --workdir=DIR         run directory (default: {DEFAULT_WORKDIR}); rerunning resumes, a larger rl.steps extends
  --show-config         print every config key with its value and doc (overrides applied), then exit
  --verbosity=N         1 or more: library logs and full tracebacks on errors
  -h, --help            show this help and exit

exit codes: 0 done (or already complete), 2 bad flag or config value, 3 missing file, 4 unusable workdir,
130 interrupted (rerun the same command to resume), 143 stopped by SIGTERM (a preemption notice: the step under
way finished or was abandoned within rl.preemption_grace_s and checkpointed; rerun the same command to resume),
1 unexpected error."""


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
    """A fresh absl flag set for one command line: the config door's ``--config`` and the job's own flags."""
    from trace_jax.configs import files  # the config sections' dataclasses import JAX

    values = files.config_flag_values(argv, str(DEFAULT_CONFIG))
    flags.DEFINE_string("workdir", DEFAULT_WORKDIR, "Run directory: checkpoints, logs, plots.", flag_values=values)
    flags.DEFINE_bool("show_config", False, "Print every config key, its value and doc.", flag_values=values)
    flags.DEFINE_integer("verbosity", 0, "1 or more: library logs and tracebacks.", short_name="v", flag_values=values)
    return values


def load_config(argv: list[str]) -> tuple[Any, Any]:
    """The run's typed config (a ``RunConfig``: the config file, then its ``--config.x=v`` overrides, checked by
    ``trace_jax.configs``) and the parsed flags.

    Raises ``MissingFileError`` for a config file that does not exist and ``ConfigError`` for a config file
    that fails, an unknown key, a key the run's recipe does not read, a value of the wrong type or not allowed,
    or a stray argument; nothing else is touched.
    """
    spec = flag_value(argv, "config") or str(DEFAULT_CONFIG)
    path = pathlib.Path(spec.partition(":")[0])
    if not path.is_file():
        raise cli.MissingFileError(f"config file {path} does not exist; pass --config=configs/<name>.py")
    from trace_jax.configs import files, validate  # the config sections' dataclasses import JAX

    base = files.read_config_file(spec)
    files.check_overrides(base, [a for a in argv if a.startswith("--config.")])
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
    return validate.validate(values.config), values


# ------------------------------------------------------------------------------------------ train
def _train(argv: list[str], console: cli.Console) -> None:
    if any(arg in ("-h", "--help", "-help", "--helpshort", "--helpfull", "-?") for arg in argv[1:]):
        print(USAGE)
        return
    config, parsed = load_config(argv)
    if parsed.show_config:
        from trace_jax.configs.schema import describe  # the config sections' dataclasses import JAX

        print(describe(config))
        return
    from trace_jax.job import train  # JAX and the whole job: only once the command line is known to be good

    summary = train.train(config, parsed.workdir, console)
    print(f"\n{train.summary_line(summary)}")
    print(train.summary_table(summary))
    print(f"\nwrote {parsed.workdir}/summary.json, metrics.jsonl, tensorboard/, plots/, checkpoints/")


def train_main(argv: list[str] | None = None) -> int:
    """``python -m trace_jax.train``: runs, resumes or extends a run (see ``USAGE``); returns the exit code."""
    argv = list(sys.argv if argv is None else argv)
    verbosity = verbosity_of(argv)
    cli.quiet_third_party(verbosity)
    console = cli.Console(verbosity)
    return cli.run_main(lambda: _train(argv, console), console)


def train_and_exit() -> None:
    """``python -m trace_jax.train`` as a process: runs ``train_main`` and exits with its code."""
    code = train_main()
    if code == cli.ExitCode.PREEMPTED:
        # The checkpoint is written and the logs are closed: skip the interpreter's teardown (freeing every array,
        # joining library threads), which took ~40 s under load, longer than a preemption notice leaves.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


# --------------------------------------------------------------------------------------- evaluate
def _evaluate(args: Any) -> None:
    from trace_jax.job.evaluate import evaluate_run  # JAX and the whole job: after the flags are known good

    if args.samples < 1 or args.limit < 0:
        raise cli.ConfigError("--samples must be >= 1 and --limit >= 0")
    evaluate_run(args.workdir, args.split, args.samples, args.limit, cli.Console(args.verbosity))


def evaluate_main(argv: Sequence[str] | None = None) -> int:
    """``python -m trace_jax.evaluate``: EM/F1 per group and pass@k of a run's newest policy."""
    parser = argparse.ArgumentParser(
        prog="python -m trace_jax.evaluate", description="EM / F1 per group and pass@k of a run's newest policy."
    )
    parser.add_argument("--workdir", required=True, help="a trace_jax.train run directory")
    parser.add_argument("--split", default="test", help="split: train, test or ood (synthetic); train, dev or test")
    parser.add_argument("--samples", type=int, default=1, help="samples per question (1: greedy decoding)")
    parser.add_argument("--limit", type=int, default=0, help="evaluate only the first N questions (0: all)")
    return _run(parser, argv, _evaluate)


# ------------------------------------------------------------------------------------------ hf
def _hf(args: Any) -> None:
    try:
        _port(args)
    except FileNotFoundError as e:  # a directory that is not a checkpoint, or one with files missing
        raise cli.MissingFileError(str(e)) from None


def _port(args: Any) -> None:
    from trace_jax.checkpoint import hf  # JAX and orbax: after the flags are known good
    from trace_jax.job import recipes  # the run's recipe knows where its tokenizer files are

    if args.command == "import":
        hf.import_hf(args.hf_dir, args.out)
        print(f"import: {args.hf_dir} -> {args.out}")
    elif args.workdir:
        policy = recipes.export_run(args.workdir, args.out, args.max_shard_bytes)
        print(f"export: {policy} -> {args.out}")
    else:
        hf.export_orbax(args.ckpt, args.out, args.max_shard_bytes)
        print(f"export: {args.ckpt} -> {args.out}")


def hf_main(argv: Sequence[str] | None = None) -> int:
    """``python -m trace_jax.hf``: Hugging Face checkpoints to orbax and back, or a run's newest policy to HF."""
    parser = argparse.ArgumentParser(
        prog="python -m trace_jax.hf",
        description="Hugging Face Qwen checkpoints <-> trace_jax checkpoints. `import` writes the parameters as an "
        "orbax checkpoint for use from Python (trace_jax.checkpoint.hf.load_orbax) and for `export --ckpt` back to "
        "HF (token ids, tokenizer files and generation_config.json kept); no training recipe reads it: to train "
        "from a HF checkpoint, pass --config.model.hf_dir=<the HF directory>.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    to_orbax = commands.add_parser(
        "import",
        help="HF directory -> orbax checkpoint (for load_orbax and export --ckpt; recipes read HF directories)",
    )
    to_orbax.add_argument("--hf-dir", required=True)
    to_orbax.add_argument("--out", required=True)
    to_hf = commands.add_parser("export", help="an orbax checkpoint, or a run's newest policy, -> HF directory")
    source = to_hf.add_mutually_exclusive_group(required=True)
    source.add_argument("--ckpt", help="an orbax checkpoint written by `import`")
    source.add_argument("--workdir", help="a trace_jax.train run: its newest policy, with its tokenizer files")
    to_hf.add_argument("--out", required=True)
    to_hf.add_argument("--max-shard-bytes", type=int, default=0, help="split the safetensors above this size")
    return _run(parser, argv, _hf)


def _run(parser: argparse.ArgumentParser, argv: Sequence[str] | None, body: Any) -> int:
    """Parses an argparse command line (plus ``--verbosity``), then runs ``body(args)`` under ``cli.run_main``."""
    parser.add_argument("--verbosity", type=int, default=0, help="1 or more: library logs and tracebacks")
    args = parser.parse_args(argv)
    cli.quiet_third_party(args.verbosity)
    return cli.run_main(lambda: body(args), cli.Console(args.verbosity))
