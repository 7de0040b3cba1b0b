"""Typed JSON records: the base of every on-disk format privcode owns.

A :class:`JsonRecord` is a frozen dataclass whose fields are checked against
their annotations when read, so a renamed, missing or mistyped key fails with
an :class:`ArtifactError` naming the file and the key, instead of a report
printing "n/a". Annotations are read as written (``"float | None"``,
``"int"``, ``"dict[str, Any]"``); a field whose value is itself structured
names ``decode``/``encode`` functions in its metadata (:func:`nested`). A
field's JSON key is its name unless its metadata sets ``key``.

Written by hand rather than with pydantic: the records sit in the bottom layer
(no third-party import at all) and are read by the zygote-free parts of every
stage, the report and the CLI; a record is ~10 lines of dataclass.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Self

from privcode.errors import PrivcodeError
from privcode.utils import atomic_write_json, read_json_object

__all__ = ["ArtifactError", "JsonRecord", "nested"]


class ArtifactError(PrivcodeError, ValueError):
    """An artifact file is missing, unreadable or not of its format; names the file and key."""


def nested(
    decode: Callable[[Any, str], Any], encode: Callable[[Any], Any], **extra: Any
) -> dict[str, Any]:
    """Field metadata for a structured value: ``decode(json_value, where)`` and ``encode``."""
    return {"decode": decode, "encode": encode, **extra}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check(value: Any, annotation: str, where: str) -> Any:
    """``value`` if it has the type ``annotation`` names (ints widen to float), else raise."""
    options = [part.strip() for part in annotation.split("|")]
    if value is None:
        if "None" in options:
            return None
        raise ArtifactError(f"{where}: is null, expected {annotation}")
    for option in options:
        base = option.split("[", 1)[0]
        if base == "bool" and isinstance(value, bool):
            return value
        if base == "int" and isinstance(value, int) and not isinstance(value, bool):
            return value
        if base == "float" and _is_number(value):
            if not math.isfinite(value):
                raise ArtifactError(f"{where}: {value!r} is not a finite number")
            return float(value)
        if base == "str" and isinstance(value, str):
            return value
        if base in ("dict", "Mapping") and isinstance(value, dict):
            return value
        if base in ("list", "tuple") and isinstance(value, list):
            return value
        if base == "Any":
            return value
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise ArtifactError(f"{where}: {shown} is not {annotation}")


class JsonRecord:
    """Mixin of a frozen dataclass stored as one JSON object (see the module docstring).

    ``FILE`` names the record's file inside its directory, ``extra_keys`` says
    whether unknown keys are refused (the default) or ignored (records other
    code may extend).
    """

    FILE: ClassVar[str] = ""
    extra_keys: ClassVar[bool] = False

    @classmethod
    def _fields(cls) -> tuple[dataclasses.Field, ...]:
        return dataclasses.fields(cls)  # type: ignore[arg-type]

    @classmethod
    def from_json(cls, obj: Any, where: str = "") -> Self:
        """The record in the JSON object ``obj``; ``where`` (a path) prefixes every error."""
        where = where or cls.__name__
        if not isinstance(obj, Mapping):
            raise ArtifactError(f"{where}: not a JSON object")
        keys = {f.metadata.get("key", f.name): f for f in cls._fields()}
        unknown = sorted(set(obj) - set(keys))
        if unknown and not cls.extra_keys:
            raise ArtifactError(
                f"{where}: unknown keys {unknown} for {cls.__name__} (known: {sorted(keys)})"
            )
        values: dict[str, Any] = {}
        for key, f in keys.items():
            if key not in obj:
                if f.default is not dataclasses.MISSING:
                    continue
                if f.default_factory is not dataclasses.MISSING:
                    continue
                raise ArtifactError(f"{where}: missing key {key!r} ({cls.__name__})")
            at = f"{where}: {key}"
            decode = f.metadata.get("decode")
            value = obj[key]
            values[f.name] = decode(value, at) if decode else _check(value, str(f.type), at)
        try:
            return cls(**values)
        except (TypeError, ValueError) as exc:
            raise ArtifactError(f"{where}: {exc}") from None

    def to_json(self) -> dict[str, Any]:
        """The JSON object (keys as stored); nested values through their ``encode``."""
        out: dict[str, Any] = {}
        for f in self._fields():
            value = getattr(self, f.name)
            encode = f.metadata.get("encode")
            out[f.metadata.get("key", f.name)] = encode(value) if encode else value
        return out

    @classmethod
    def read(cls, path: str | os.PathLike) -> Self:
        """The record in ``path`` (a file, or a directory holding :attr:`FILE`)."""
        path = Path(path)
        if cls.FILE and path.is_dir():
            path = path / cls.FILE
        return cls.from_json(read_json_object(path, ArtifactError), str(path))

    def write(self, path: str | os.PathLike) -> Path:
        """Write atomically to ``path`` (a file, or a directory to hold :attr:`FILE`)."""
        path = Path(path)
        if self.FILE and path.is_dir():
            path = path / self.FILE
        atomic_write_json(path, self.to_json())
        return path
