"""A fixed program set: device functions compiled ahead of time per input signature, counted, checked.

``ProgramSet`` holds named pure functions. Calling one looks up the executable compiled for the call's input
signature (shapes, dtypes, shardings and the static arguments), compiling it on first use with
``jax.jit(...).lower(...).compile()``. Every compile is counted per name and logged; once the owner declares
the set warm (``mark_warm``: after its ahead-of-time warm-up, or after the first RL step), a compile is a
bug in bucketing and is logged as a warning naming the program and its shapes, and kept in ``late``.

Arguments may be concrete arrays or ``jax.ShapeDtypeStruct`` (to compile without data: ``compile``), and the
executables are called directly, so what runs is exactly what was counted.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import jax

log = logging.getLogger(__name__)


def signature(args: Any) -> tuple:
    """Hashable input signature: the tree structure and each leaf's (shape, dtype, sharding)."""
    leaves, treedef = jax.tree.flatten(args)
    return treedef, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves)


def describe_signature(args: Any) -> str:
    """Short text of each argument: ``dtype[shape]`` for an array, the leaf count for a tree (weights, state)."""
    parts = []
    for arg in args:
        leaves = jax.tree.leaves(arg)
        one = len(leaves) == 1 and leaves[0] is arg
        parts.append(f"{arg.dtype}{list(arg.shape)}" if one else f"<{len(leaves)} arrays>")
    return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class _Definition:
    fn: Callable[..., Any]
    jit_kwargs: dict[str, Any]


class ProgramSet:
    """Named device functions, each compiled once per input signature (see the module docstring).

    Args:
      owner: name used in log lines (e.g. ``"engine"``).
    """

    def __init__(self, owner: str):
        self.owner = owner
        self.compilations: collections.Counter[str] = collections.Counter()
        self.late: list[tuple[str, str]] = []  # (program, shapes) compiled after mark_warm
        self.warm = False
        # Profiling (benchmarks): when on, each call waits for its outputs and its seconds are added here.
        self.timed = False
        self.seconds: collections.Counter[str] = collections.Counter()
        self._definitions: dict[str, _Definition] = {}
        self._executables: dict[tuple, Any] = {}

    def define(self, name: str, fn: Callable[..., Any], **jit_kwargs: Any) -> None:
        """Registers ``fn`` (pure; static arguments are passed as ``static=`` at call time)."""
        self._definitions[name] = _Definition(fn, jit_kwargs)

    def __contains__(self, name: str) -> bool:
        return name in self._definitions

    def compile(self, name: str, *args: Any, static: tuple = ()) -> Any:
        """The executable for ``name`` at these arguments' signature, compiling it if new."""
        key = (name, static, signature(args))
        executable = self._executables.get(key)
        if executable is None:
            executable = self.jitted(name, static).lower(*args).compile()
            self._executables[key] = executable
            self.compilations[name] += 1
            shapes = f"{name}{list(static) if static else ''}({describe_signature(args)})"
            if self.warm:
                self.late.append((name, shapes))
                log.warning("%s compiled %s after warm-up: a shape escaped the buckets", self.owner, shapes)
            else:
                log.info("%s compiled %s", self.owner, shapes)
        return executable

    def jitted(self, name: str, static: tuple = ()) -> Any:
        """The ``jax.jit`` of program ``name`` with its static arguments bound (for AOT tools such as the
        memory planner; calls go through ``__call__`` so they are counted)."""
        definition = self._definitions[name]
        fn = functools.partial(definition.fn, *static) if static else definition.fn
        return jax.jit(fn, **definition.jit_kwargs)

    def __call__(self, name: str, *args: Any, static: tuple = ()) -> Any:
        executable = self.compile(name, *args, static=static)
        if not self.timed:
            return executable(*args)
        start = time.perf_counter()
        out = jax.block_until_ready(executable(*args))
        self.seconds[name] += time.perf_counter() - start
        return out

    def mark_warm(self) -> None:
        """From now on every compile is a warning (the set was meant to be complete)."""
        if not self.warm:
            log.info("%s: %d programs compiled during warm-up %s", self.owner, self.total, dict(self.compilations))
        self.warm = True

    @property
    def total(self) -> int:
        return sum(self.compilations.values())
