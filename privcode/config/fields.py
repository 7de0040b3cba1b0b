"""Fields of the config sections: help text and constraints in the field metadata.

:func:`opt` declares a field; :func:`_check_constraints` enforces its
``min``/``max`` (with :func:`privcode.checks.check_number`), ``choices``,
``min_len`` and ``pattern``; :func:`section_to_dict` gives a section back as
plain YAML/JSON values.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import field
from typing import Any

from privcode.checks import check_number
from privcode.errors import ConfigError


def opt(default: Any, help: str, **constraints: Any) -> Any:  # noqa: A002 - "help" reads best
    """A dataclass field with help text and validation constraints."""
    if isinstance(default, list):
        default = tuple(default)
    return field(default=default, metadata={"help": help, **constraints})


def _check_constraints(value: Any, meta: dict[str, Any], where: str) -> None:
    items = value if isinstance(value, tuple) else (value,)
    if "min_len" in meta and len(items) < meta["min_len"]:
        raise ConfigError(f"{where}: needs at least {meta['min_len']} item(s), got {len(items)}")
    for item in items:
        if "choices" in meta and item not in meta["choices"]:
            raise ConfigError(f"{where}: {item!r} is not one of {list(meta['choices'])}")
        if "min" in meta or "max" in meta:
            check_number(where, item, min=meta.get("min"), max=meta.get("max"), error=ConfigError)
        if "pattern" in meta and not re.fullmatch(meta["pattern"], item):
            raise ConfigError(f"{where}: {item!r} does not match {meta['pattern']}")


def section_to_dict(section: Any) -> dict[str, Any]:
    return {f.name: _plain(getattr(section, f.name)) for f in dataclasses.fields(section)}


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
