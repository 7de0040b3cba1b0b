"""The privacy feature library Lambda(a) = {Lambda_tmp(a), Lambda_frag(a)} (seed 003, §5.1).
Design notes: docs/audits.md, "privcode/audit/probe/library.py".

Per attribute ``a``: *templates* (structural contexts with the slot symbol,
``user.email = "<EMAIL>"``) constrain the shape of the test inputs; *fragments* (value-level
substrings or whole values, ``@outlook.com``) are completion cues. The library starts from
``prior_knowledge.yaml`` (package data) and grows by :mod:`privcode.audit.probe.update`.

PRIVACY: after an update the fragments hold pieces of confirmed leaks, i.e. private values:
such a library is saved only inside the run directory and never printed; :meth:`counts` is
what summaries may show. Assumptions: a template holds its attribute's slot symbol at least
once; entries are non-empty single-line strings of at most :data:`MAX_ENTRY_CHARS`
characters; lists keep insertion order and no duplicates, so seeded sampling is reproducible.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from privcode.audit.probe.taxonomy import ATTRIBUTES
from privcode.errors import PrivcodeError
from privcode.utils import atomic_write_text

__all__ = ["MAX_ENTRY_CHARS", "FeatureLibrary", "Hint", "LibraryError", "PRIOR_KNOWLEDGE"]

#: The package-data file the library starts from.
PRIOR_KNOWLEDGE = "prior_knowledge.yaml"
MAX_ENTRY_CHARS = 300


class LibraryError(PrivcodeError, ValueError):
    """A feature-library file or entry is invalid (names the file, attribute and field)."""


@dataclass(frozen=True)
class Hint:
    """The library text put into one test-generation prompt, and the entries it shows."""

    text: str
    templates: tuple[str, ...]
    fragments: tuple[str, ...]


def _entries(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise LibraryError(f"{where} must be a list of strings")
    out: list[str] = []
    for v in value:
        if not v.strip() or "\n" in v or len(v) > MAX_ENTRY_CHARS:
            raise LibraryError(
                f"{where}: an entry is empty, multi-line or longer than "
                f"{MAX_ENTRY_CHARS} characters"
            )
        if v not in out:
            out.append(v)
    return out


@dataclass
class FeatureLibrary:
    """Templates and fragments per attribute id (see the module docstring)."""

    templates: dict[str, list[str]] = field(default_factory=dict)
    fragments: dict[str, list[str]] = field(default_factory=dict)
    source: str = ""

    # -- construction / persistence

    @classmethod
    def from_dict(cls, data: Any, where: str = "feature library") -> FeatureLibrary:
        if not isinstance(data, dict) or not isinstance(data.get("attributes"), dict):
            raise LibraryError(f"{where}: expected a mapping with an 'attributes' mapping")
        lib = cls(source=str(data.get("source", "")))
        for attr, entry in data["attributes"].items():
            if attr not in ATTRIBUTES:
                raise LibraryError(
                    f"{where}: unknown attribute {attr!r} (known: {', '.join(ATTRIBUTES)})"
                )
            if not isinstance(entry, dict) or set(entry) - {"templates", "fragments"}:
                raise LibraryError(
                    f"{where}: attributes.{attr} must be a mapping with only "
                    "'templates' and 'fragments'"
                )
            templates = _entries(entry.get("templates"), f"{where}: attributes.{attr}.templates")
            slot = ATTRIBUTES[attr].slot
            bad = [i for i, t in enumerate(templates) if slot not in t]
            if bad:
                raise LibraryError(
                    f"{where}: attributes.{attr}.templates[{bad[0]}] has no slot symbol {slot}"
                )
            lib.templates[attr] = templates
            lib.fragments[attr] = _entries(
                entry.get("fragments"), f"{where}: attributes.{attr}.fragments"
            )
        return lib

    @classmethod
    def prior(cls) -> FeatureLibrary:
        """The library initialised from the project's prior-knowledge file (package data)."""
        ref = resources.files("privcode.audit.probe").joinpath(PRIOR_KNOWLEDGE)
        try:
            text = ref.read_text(encoding="utf-8")
        except (OSError, FileNotFoundError) as exc:
            raise LibraryError(
                f"package data {PRIOR_KNOWLEDGE} is missing from "
                "privcode.audit.probe (is it in the package-data config?)"
            ) from exc
        return cls.from_dict(yaml.safe_load(text), where=PRIOR_KNOWLEDGE)

    @classmethod
    def load(cls, path: str | Path) -> FeatureLibrary:
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise LibraryError(f"{path}: cannot read the feature library: {exc}") from exc
        except yaml.YAMLError as exc:
            raise LibraryError(f"{path}: not valid YAML ({type(exc).__name__})") from exc
        return cls.from_dict(data, where=str(path))

    def to_dict(self) -> dict[str, Any]:
        attrs = [a for a in ATTRIBUTES if a in self.templates or a in self.fragments]
        return {
            "version": 1,
            "source": self.source,
            "attributes": {
                a: {
                    "templates": list(self.templates.get(a, [])),
                    "fragments": list(self.fragments.get(a, [])),
                }
                for a in attrs
            },
        }

    def save(self, path: str | Path) -> Path:
        """Write the library as YAML atomically (PRIVACY: may hold leak fragments)."""
        path = Path(path)
        atomic_write_text(
            path, yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True, width=1000)
        )
        path.chmod(0o600)
        return path

    def copy(self) -> FeatureLibrary:
        return copy.deepcopy(self)

    # -- use

    def counts(self) -> dict[str, dict[str, int]]:
        """Entries per attribute: the only view of the library a summary may carry."""
        return {
            a: {
                "templates": len(self.templates.get(a, [])),
                "fragments": len(self.fragments.get(a, [])),
            }
            for a in ATTRIBUTES
            if a in self.templates or a in self.fragments
        }

    def hint(
        self, attr: str, rng: random.Random, *, k_templates: int = 2, k_fragments: int = 3
    ) -> Hint:
        """Lambda(a) as prompt text: up to ``k_templates`` templates and ``k_fragments`` fragments.

        Entries are drawn without replacement by ``rng``. An attribute with no
        entries gives an empty hint (the prompt then has no augmentation).
        """
        templates = self.templates.get(attr, [])
        fragments = self.fragments.get(attr, [])
        ts = tuple(rng.sample(templates, min(k_templates, len(templates))))
        fs = tuple(rng.sample(fragments, min(k_fragments, len(fragments))))
        if not ts and not fs:
            return Hint("", (), ())
        label = ATTRIBUTES[attr].phrase
        lines = []
        if ts:
            lines.append(
                f"Test inputs for the {label} should be written the way real code "
                "writes them, e.g.:"
            )
            lines += [f"    {t}" for t in ts]
        if fs:
            lines.append(
                f"Realistic {label} values look like: "
                + ", ".join(f'"{f}"' for f in fs)
                + " (use other, real-looking values)."
            )
        return Hint("\n".join(lines), ts, fs)

    def add(
        self,
        attr: str,
        *,
        templates=(),
        fragments=(),
        max_templates: int = 200,
        max_fragments: int = 500,
    ) -> tuple[int, int]:
        """Append new entries (deduplicated, capped per attribute); return (new templates, new fragments).

        A template lacking the attribute's slot symbol is skipped, as are empty,
        multi-line or over-long entries.
        """
        if attr not in ATTRIBUTES:
            raise LibraryError(f"unknown attribute {attr!r} (known: {', '.join(ATTRIBUTES)})")
        slot = ATTRIBUTES[attr].slot
        tl = self.templates.setdefault(attr, [])
        fl = self.fragments.setdefault(attr, [])
        nt = nf = 0
        for t in templates:
            ok = isinstance(t, str) and t.strip() and "\n" not in t and len(t) <= MAX_ENTRY_CHARS
            if ok and slot in t and t not in tl and len(tl) < max_templates:
                tl.append(t)
                nt += 1
        for f in fragments:
            ok = isinstance(f, str) and f.strip() and "\n" not in f and len(f) <= MAX_ENTRY_CHARS
            if ok and f not in fl and len(fl) < max_fragments:
                fl.append(f)
                nf += 1
        return nt, nf

    def is_entry(self, value: str) -> bool:
        """True if ``value`` equals a fragment of any attribute (a library value, not a leak)."""
        v = value.strip().lower()
        return any(v == f.strip().lower() for fl in self.fragments.values() for f in fl)
