"""Plain values -> validated dataclass, naming ``group.field`` in every error.

Shared by the recipe config and by components (the DataModule) that accept a Hydra node directly.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

from data_contract.errors import ConfigError

T = TypeVar("T")

_SCALARS = (bool, int, float, str)


def _accepts(annotation: Any, value: Any) -> bool:
    """Loose runtime check of ``value`` against a field annotation (scalars, optionals, literals)."""
    if annotation is Any or value is None and _is_optional(annotation):
        return True
    if annotation is type(None):  # the None of an optional field accepts None only
        return value is None
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(arg, value) for arg in typing.get_args(annotation))
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation in _SCALARS:
        return isinstance(value, annotation)
    if origin in (tuple, list):
        return isinstance(value, (list, tuple))
    if origin is dict or annotation is dict:
        return isinstance(value, dict)
    return True


def _is_optional(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in typing.get_args(
        annotation
    )


def dataclass_from_dict(schema: type[T], values: dict[str, Any], prefix: str) -> T:
    """Build ``schema`` from plain values, naming ``prefix.field`` in any error."""
    hints = typing.get_type_hints(schema)
    known = {f.name for f in dataclasses.fields(schema)}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"{prefix}.{key} is not a known field; known fields: {sorted(known)}")
        if dataclasses.is_dataclass(hints[key]) and isinstance(value, dict):  # a nested group
            values[key] = dataclass_from_dict(hints[key], dict(value), f"{prefix}.{key}")
            continue
        if not _accepts(hints[key], value):
            raise ConfigError(f"{prefix}.{key}={value!r} has the wrong type; expected {hints[key]}")
        if typing.get_origin(hints[key]) is tuple and isinstance(value, list):
            values[key] = tuple(value)
    instance = schema(**values)
    validate = getattr(instance, "validate", None)
    return validate() if callable(validate) else instance
