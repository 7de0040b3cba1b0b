"""Loading: YAML file and ``--set`` overrides -> a validated :class:`PipelineConfig`.

Types are checked (and lists made tuples) by :func:`_coerce`, constraints by
:func:`~privcode.config.fields._check_constraints`, combinations of fields by a
section's ``cross_check``; every problem is a :class:`ConfigError` naming the
file and the dotted key.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from privcode import registry
from privcode.config.fields import _check_constraints, _plain
from privcode.config.pipeline import SECTIONS, PipelineConfig
from privcode.errors import ConfigError


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is tuple:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against type ``tp``; lists become tuples. Raises ConfigError."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, where)
            except ConfigError:
                continue
        raise ConfigError(
            f"{where}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}"
        )
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(
                f"{where}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}"
            )
        item_tp = typing.get_args(tp)[0]
        return tuple(_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value))
    if tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - a section used a type this loader does not know
        raise ConfigError(f"{where}: unsupported field type {tp!r}")
    raise ConfigError(f"{where}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")


def build_section(cls: type, raw: dict[str, Any], source: str, name: str) -> Any:
    """Validate the mapping ``raw`` against section ``cls``; return the frozen instance."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: section '{name}' must be a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(
            f"{source}: unknown key '{name}.{unknown[0]}' "
            f"(known keys of '{name}': {', '.join(sorted(fields))})"
        )
    values = {}
    for key, value in raw.items():
        where = f"{source}: {name}.{key}"
        coerced = _coerce(value, hints[key], where)
        _check_constraints(coerced, dict(fields[key].metadata), where)
        values[key] = coerced
    for key, f in fields.items():
        if key not in values and f.default is not dataclasses.MISSING:
            _check_constraints(f.default, dict(f.metadata), f"{source}: {name}.{key} (default)")
    section = cls(**values)
    check = getattr(section, "cross_check", None)
    if check is not None:
        problem = check()
        if problem:
            key, message = problem
            raise ConfigError(f"{source}: {name}.{key}: {message}")
    return section


def parse_override(text: str) -> tuple[str, str, Any]:
    """``"data.size=100"`` -> ``("data", "size", 100)`` (value parsed as YAML)."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"--set {text!r}: expected SECTION.KEY=VALUE, e.g. data.size=100")
    dotted, raw_value = text.split("=", 1)
    section, key = dotted.strip().split(".", 1)
    try:
        value = yaml.safe_load(raw_value) if raw_value.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {text!r}: value is not valid YAML: {exc}") from None
    return section, key, value


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> PipelineConfig:
    """Load and validate a pipeline config file, then apply ``--set`` overrides.

    ``path=None`` gives the defaults. Raises :class:`ConfigError` naming the
    file and the offending key on any problem.
    """
    source = str(path) if path is not None else "<defaults>"
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"{source}: config file not found") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"{source}: not valid UTF-8 ({exc.reason} at byte {exc.start})"
            ) from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{source}: invalid YAML: {exc}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"{source}: top level must be a mapping of sections "
                f"({', '.join(SECTIONS)}), got {type(loaded).__name__}"
            )
        raw = {k: dict(v) if isinstance(v, dict) else v for k, v in loaded.items()}
    for text in overrides:
        section, key, value = parse_override(text)
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ConfigError(f"{source}: section '{section}' must be a mapping")
        raw[section][key] = value
    where = source + (" (with --set overrides)" if overrides else "")
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"{where}: unknown section '{unknown[0]}' (known: {', '.join(SECTIONS)})")
    sections = {
        name: build_section(cls, raw.get(name) or {}, where, name) for name, cls in SECTIONS.items()
    }
    for stage in sections["run"].stages:
        if stage not in registry.STAGES:
            raise ConfigError(
                f"{where}: run.stages: unknown stage '{stage}' "
                f"(known: {', '.join(registry.STAGES)})"
            )
    return PipelineConfig(**sections, source=source)


def describe(cls: type) -> list[tuple[str, str, Any, str]]:
    """(name, type, default, help) of every field of a section: for docs and `config show`."""
    hints = typing.get_type_hints(cls)
    return [
        (f.name, _type_name(hints[f.name]), _plain(f.default), f.metadata.get("help", ""))
        for f in dataclasses.fields(cls)
    ]
