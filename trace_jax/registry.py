"""One mechanism for every family of interchangeable parts chosen by a config string.

Allocation policies, advantage estimators, policy losses, KL estimators, loss aggregations, predictors,
answer metrics and learning-rate schedules are each a ``Registry``: a dict from name to implementation whose
lookup of an unknown name is a clear error listing the choices, and whose ``register`` is a decorator.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(dict[str, T], Generic[T]):
    """Named implementations of one family; ``registry[name]`` raises ``ValueError`` for unknown names."""

    def __init__(self, family: str, entries: Mapping[str, T] | None = None):
        super().__init__(entries or {})
        self.family = family

    def __missing__(self, name: str) -> T:
        raise ValueError(f"unknown {self.family} {name!r}; choose one of {', '.join(sorted(self))}")

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: adds the decorated object under ``name`` and returns it unchanged."""

        def add(entry: T) -> T:
            if name in self:
                raise ValueError(f"{self.family} {name!r} is registered twice")
            self[name] = entry
            return entry

        return add
