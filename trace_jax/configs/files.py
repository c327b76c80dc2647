"""A run's config from a config file and its ``--config.a.b=v`` overrides: the way every entry point (the main
job, the launcher, the planner, the benches) reads one.

    run = load("configs/default.py", ["--config.rl.steps=40"])   # a checked RunConfig, or ConfigError

The overrides are parsed exactly as the main job's command line parses them (``ml_collections.config_flags``),
after the checks that name the fix: a retired key names its replacement, a key the run's recipe does not read
names the recipes that do, an unknown key names the nearest ones.
"""

from __future__ import annotations

import difflib
import importlib.util
from collections.abc import Sequence

import ml_collections
from absl import flags
from ml_collections import config_flags

from trace_jax.configs.errors import ConfigError
from trace_jax.configs.run import RECIPES, SECTIONS, RunConfig, readers, recipe_kind, retired_problems
from trace_jax.configs.validate import validate


def load_config_file(spec: str) -> ml_collections.ConfigDict:
    """``path/to/config.py[:arg]`` -> ``get_config(arg)``, the way ``config_flags`` reads a config file."""

    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("trace_jax_run_config", path)
    if module_spec is None or module_spec.loader is None:
        raise FileNotFoundError(f"config file {path!r} cannot be loaded")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def _dotted_keys(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in config.items():
        keys.append(prefix + key)
        if isinstance(value, ml_collections.ConfigDict):
            keys += _dotted_keys(value, f"{prefix}{key}.")
    return keys


def unknown_overrides(overrides: Sequence[str], config: ml_collections.ConfigDict) -> list[str]:
    """One message per ``--config.a.b=v`` whose key ``a.b`` the config lacks, naming the nearest keys."""
    known = _dotted_keys(config)
    messages = []
    for flag in overrides:
        key = flag.split("=", 1)[0].removeprefix("--config.")
        if key not in known:
            near = difflib.get_close_matches(key, known, n=3, cutoff=0.5)
            messages.append(f"unknown config key {key!r}" + (f"; near matches: {', '.join(near)}" if near else ""))
    return messages


def unread_overrides(overrides: Sequence[str], base: ml_collections.ConfigDict) -> list[str]:
    """One message per ``--config.a.b=v`` whose key the run's recipe (``recipe.kind``, the file's or the command
    line's) does not read, naming the recipes that do."""
    kind = next(
        (a.split("=", 1)[1] for a in overrides if a.startswith("--config.recipe.kind=")), recipe_kind(base)
    ).strip("'\"")
    if kind not in RECIPES:
        return []  # the check of recipe.kind says what is allowed
    messages = []
    for flag in overrides:
        key = flag.split("=", 1)[0].removeprefix("--config.")
        if RECIPES[kind].reads(key) or key.partition(".")[0] not in SECTIONS:
            continue  # read, or not a key at all (unknown_overrides names the near ones)
        others = [other for other in readers(key) if other != kind]
        messages.append(
            f"config key {key!r} is not read by this run's recipe (recipe.kind={kind!r})"
            + (f"; it is read by the {' and '.join(others)} recipe" if others else "")
        )
    return messages


def check_overrides(base: ml_collections.ConfigDict, overrides: Sequence[str]) -> None:
    """Raises :class:`ConfigError` for retired keys (in the file or the overrides: each names the key that
    replaces it), then overrides the recipe does not read, then unknown override keys."""
    keys = [a.split("=", 1)[0].removeprefix("--config.") for a in overrides]
    problems = retired_problems(base) + retired_problems(keys)
    if problems:
        raise ConfigError("; ".join(problems))
    problems = unread_overrides(overrides, base)
    if problems:
        raise ConfigError("; ".join(problems))
    problems = unknown_overrides(overrides, base)
    if problems:
        raise ConfigError("; ".join(problems) + " (--show-config lists every key)")


def read_config_file(spec: str) -> ml_collections.ConfigDict:
    """:func:`load_config_file`, a config file that fails to build raising :class:`ConfigError` naming it."""
    try:
        return load_config_file(spec)
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"--config={spec}: {' '.join(str(e).split())}") from None


def config_flag_values(argv: Sequence[str], default_spec: str) -> flags.FlagValues:
    """A fresh absl flag set holding ``--config`` (``default_spec`` unless ``argv`` names one) whose
    ``--config.x=v`` overrides are read from ``argv`` (the global flag set keeps state between parses)."""
    values = flags.FlagValues()
    config_flags.DEFINE_config_file(
        "config", default_spec, "Run config (a configs/*.py file).", flag_values=values, sys_argv=list(argv)
    )
    return values


def load(spec: str, overrides: Sequence[str] = ()) -> RunConfig:
    """The checked ``RunConfig`` of config file ``spec`` (``path.py[:arg]``) with ``overrides``
    (``--config.a.b=v``) applied as the main job applies them. Raises :class:`ConfigError`."""
    base = read_config_file(spec)
    check_overrides(base, overrides)
    argv = ["trace_jax", f"--config={spec}", *overrides]
    values = config_flag_values(argv, spec)
    try:
        values(argv)
    except Exception as e:  # absl's flag errors and ml_collections' type errors for a --config.x value
        raise ConfigError(" ".join(str(e).split())) from None
    return validate(values.config)
