"""ConfigDict sections <-> the frozen dataclasses each part of the framework is configured with.

A part's defaults live in its dataclass (``WorldConfig``, ``EngineConfig``, ``LossConfig``...);
``configs/*.py`` start from ``to_config(PartConfig())`` (through ``trace_jax.configs.section``) and change only
what the recipe needs, and the main job turns the whole config back once, into a typed ``RunConfig``
(``trace_jax.configs``), with ``from_config`` per section. Nested dataclasses (``EngineConfig.sampling``) become
nested sections; tuples become lists and back.

A field is documented where it is declared, with :func:`documented` (``steps: int = documented(30, "RL
updates")``); ``--show-config`` reads the text from ``dataclasses.fields(cls)[i].metadata["doc"]``.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

import ml_collections

T = TypeVar("T")


_OVERRIDABLE = (int, float, str, bool)
DOC = "doc"  # the metadata key of a field's documentation


def documented(default: Any = dataclasses.MISSING, doc: str = "", **field_kwargs: Any) -> Any:
    """A dataclass field with ``default`` (or ``default_factory=...`` and any other ``dataclasses.field``
    argument) whose documentation is ``doc``: what the key means and what its values do, one sentence or a few."""
    if not doc:
        raise ValueError("documented() needs the field's doc")
    return dataclasses.field(default=default, metadata={DOC: doc}, **field_kwargs)


def field_doc(field: dataclasses.Field) -> str | None:
    """The text :func:`documented` gave ``field``, or None."""
    return field.metadata.get(DOC)


def _optional_scalar(annotation: Any) -> type | None:
    """``X`` for an ``X | None`` annotation with X a scalar type (int, float, str, bool), else None."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1 and args[0] in _OVERRIDABLE and len(typing.get_args(annotation)) == 2:
            return args[0]
    return None


def to_config(instance: Any) -> ml_collections.ConfigDict:
    """A ConfigDict with every field of a dataclass instance (nested dataclasses become sections).

    A field that is None but typed ``X | None`` (X a scalar) becomes a typed ``FieldReference``, so the
    command line can still set it (``--config.sft.time_budget_s=120``); ml_collections refuses to override
    a plain None.
    """

    def convert(value: Any, annotation: Any = None) -> Any:
        if dataclasses.is_dataclass(value):
            hints = _field_types(type(value))
            return {f.name: convert(getattr(value, f.name), hints[f.name]) for f in dataclasses.fields(value)}
        if isinstance(value, tuple):  # kept a tuple: the command line can override it (``--config.x='(1, 2)'``)
            return tuple(convert(v) for v in value)
        if value is None and _optional_scalar(annotation) is not None:
            return ml_collections.FieldReference(None, field_type=_optional_scalar(annotation))
        return value

    return ml_collections.ConfigDict(convert(instance))


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _dataclass_in(annotation: Any) -> type | None:
    """The dataclass type inside ``X`` or ``X | None`` annotations, if any."""
    if dataclasses.is_dataclass(annotation):
        return annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        for arg in typing.get_args(annotation):
            if dataclasses.is_dataclass(arg):
                return arg
    return None


def _tuples(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_tuples(v) for v in value)
    return value


def from_config(cls: type[T], section: Mapping[str, Any] | ml_collections.ConfigDict | None, **overrides: Any) -> T:
    """Builds ``cls`` from a section holding any subset of its fields; ``overrides`` win.

    An unknown field is an error that names the section's class and the closest field names.
    """
    values = dict(section.items()) if section is not None else {}
    values.update(overrides)
    types_by_name = _field_types(cls)
    for key in values:
        if key not in types_by_name:
            near = difflib.get_close_matches(key, list(types_by_name), n=3)
            hint = f"; did you mean {' or '.join(near)}?" if near else ""
            raise ValueError(f"{cls.__name__} has no field {key!r}{hint} (fields: {', '.join(types_by_name)})")
    kwargs = {}
    for key, value in values.items():
        nested = _dataclass_in(types_by_name[key])
        if nested is not None and isinstance(value, Mapping | ml_collections.ConfigDict):
            kwargs[key] = from_config(nested, value)
        elif isinstance(value, ml_collections.ConfigDict):
            kwargs[key] = value.to_dict()
        else:
            kwargs[key] = _tuples(value)
    return cls(**kwargs)
