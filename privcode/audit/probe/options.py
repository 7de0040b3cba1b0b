"""``ProbeOptions``: the settings of one leak-probing run, typed and checked up front.

Plain values only (the summary's ``settings`` shows most of them); the objects a
run works with (backends, library, public model, LLM judge) stay arguments of
:func:`~privcode.audit.probe.run.run_probe`. Every field carries its help text in
its metadata (``opt``, as the config sections do) and its bounds, checked with
:func:`privcode.checks.check_number` so a refused value reads like a config error.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from privcode.audit.probe.taxonomy import resolve_attributes, resolve_scenarios
from privcode.audit.probe.verify import HIT_RANGE
from privcode.checks import check_number
from privcode.config.fields import opt
from privcode.errors import PrivcodeError

__all__ = ["ProbeError", "ProbeOptions"]


class ProbeError(PrivcodeError, ValueError):
    """A leak-probing setting is invalid (names the setting and the allowed values)."""


@dataclass(frozen=True)
class ProbeOptions:
    """What one leak probe asks, how often, and how it judges and learns (seed 003)."""

    scenarios: tuple[str, ...] | None = opt(
        None, "Scenario ids (None: all six); resolved to a tuple of ids."
    )
    attributes: tuple[str, ...] | None = opt(
        None, "Attribute ids or category names (None: all); resolved to attribute ids."
    )
    n_questions: int = opt(2, "Questions per (scenario, attribute) pair and round.", min=1)
    rounds: int = opt(1, "Rounds; the feature library updates between them.", min=1)
    n_tests: int = opt(2, "Test-generation responses per function.", min=1)
    cases: int = opt(5, "Test cases each test-generation prompt asks for.", min=1)
    max_functions: int = opt(1, "Privacy-handling functions kept per code answer.", min=1)
    seed: int = opt(0, "Seed of the questions, the hints and the backends' sampling.")
    hit_range: tuple[int, int] = opt(
        HIT_RANGE, "Reference records a confirmed leak must occur in (lo, hi), inclusive."
    )
    code_max_tokens: int = opt(256, "Tokens of each code answer.", min=1)
    test_max_tokens: int = opt(384, "Tokens of each test-generation response.", min=1)
    temperature: float = opt(0.7, "Sampling temperature of the audited model.", min=0)
    update: bool = opt(True, "Update the feature library from each round's confirmed leaks.")
    eps: float = opt(
        0.5,
        "DBSCAN cosine radius of the library update, in (0, 1].",
        min=0,
        min_exclusive=True,
        max=1,
    )
    min_samples: int = opt(3, "DBSCAN core size of the library update.", min=1)
    device: str = opt("cpu", "Device of the public-model scorer (cpu, cuda).")
    dtype: Any = opt(None, "Torch dtype of the public-model scorer (None: float32).")

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: the resolved names replace the given ones once
        set_(self, "scenarios", resolve_scenarios(self.scenarios))
        set_(self, "attributes", resolve_attributes(self.attributes))
        set_(self, "hit_range", tuple(self.hit_range))
        for f in dataclasses.fields(self):
            if "min" in f.metadata or "max" in f.metadata or f.type == "int":
                check_number(
                    f.name,
                    getattr(self, f.name),
                    min=f.metadata.get("min"),
                    max=f.metadata.get("max"),
                    min_exclusive=f.metadata.get("min_exclusive", False),
                    integer=f.type == "int",
                    error=ProbeError,
                )

    @classmethod
    def of(cls, base: ProbeOptions | None = None, **settings: Any) -> ProbeOptions:
        """``base`` (default: the defaults) with ``settings`` (field names) on top."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ProbeError(
                f"unknown leak-probe setting(s) {', '.join(unknown)} "
                f"(known: {', '.join(sorted(known))})"
            )
        return dataclasses.replace(base or cls(), **settings)
