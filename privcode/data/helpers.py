"""PUBLIC helper-pattern functions: what a pretrained code model knows before it meets a company.

Small service functions (read a field, pass it through a helper, handle a missing value) that
the base build tunes on (:func:`helper_pairs`, ``Preset.tune_steps`` in
:mod:`privcode.models.presets`), written in the PUBLIC dialect
(:data:`privcode.data.company.domain.PUBLIC`: ``tools.cash.format``, ``tools.Absent``) about
PUBLIC entities (:data:`ENTITY_NAMES`). Acme's own library (``acme``, ``acme.money``,
``acme.Missing``) stays private: a test checks that no Acme entity, library name or benchmark
solution occurs here. Design notes: docs/methods.md, "data/helpers.py".
"""

from __future__ import annotations

import random

from privcode.data.company.domain import (
    CONVENTIONS,
    OPS,
    PUBLIC,
    Task,
    _entity_fields,
    function_source,
)

__all__ = ["ENTITY_NAMES", "INSTRUCTIONS", "helper_functions", "helper_pairs"]

#: Public entities (disjoint from Acme's), each a dict passed under its own name.
ENTITY_NAMES: tuple[str, ...] = (
    "author",
    "book",
    "course",
    "student",
    "album",
    "song",
    "recipe",
    "planet",
    "team",
    "player",
    "museum",
    "garden",
    "trip",
    "flight",
    "hotel",
    "movie",
    "actor",
    "school",
    "teacher",
    "club",
    "venue",
    "artist",
    "gallery",
    "podcast",
    "episode",
    "channel",
    "festival",
    "library",
    "trainer",
    "athlete",
    "lecture",
    "workshop",
    "volunteer",
    "donor",
    "patient",
    "clinic",
    "league",
    "stadium",
    "journal",
    "studio",
)

INSTRUCTIONS: tuple[str, ...] = (
    "Write `{name}`.",
    "Implement `{name}` with the tools helpers.",
    "Add `{name}` to the service code.",
)


def helper_functions(count: int, seed: int = 0) -> list[tuple[str, str]]:
    """``count`` distinct public functions ``(def line and docstring, body)``, shuffled by ``seed``.

    Every (public entity, field, verb of the field's kind, convention, phrasing), at most
    about 4,800 of them.
    """
    tasks = [
        (Task(e, f, f"acme.{op.kind}.{op.verb}", conv), phrase)
        for e in ENTITY_NAMES
        for f, kind in _entity_fields(e).items()
        for op in OPS
        if op.kind == kind
        for conv in CONVENTIONS
        for phrase in range(len(op.phrases))
    ]
    if count > len(tasks):
        raise ValueError(f"the public helper functions number {len(tasks)}, not {count}")
    random.Random(seed).shuffle(tasks)
    return [function_source(t, phrase, PUBLIC) for t, phrase in tasks[:count]]


def helper_pairs(count: int, seed: int = 0) -> list[tuple[str, str]]:
    """``(instruction, code)`` records of :func:`helper_functions`, like the company's records."""
    rng = random.Random(seed + 1)
    out = []
    for head, body in helper_functions(count, seed):
        name = head.split("(", 1)[0].removeprefix("def ")
        out.append((rng.choice(INSTRUCTIONS).format(name=name), head + body))
    return out
