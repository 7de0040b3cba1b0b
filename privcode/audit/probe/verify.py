"""Verification against a reference corpus: the stand-in for the seed's GitHub search (§4.3).

A judged candidate ``x`` is kept when ``1 <= k <= 100``, ``k`` the number of records of the
reference corpus (the private training corpus, ``prompt + "\\n" + code`` per record) whose text
contains ``x`` verbatim; case-sensitive except for e-mail addresses and host names.
:class:`ReferenceIndex` counts with ``str.find`` over the NUL-joined texts, jumping to the next
record after each hit and stopping at ``hi + 1`` records; the record ids it returns let the
metrics find interconnected elements.

PRIVACY: the index holds the private corpus in memory only; nothing here logs or returns text,
only counts and record ids. Design notes: docs/audits.md, "privcode/audit/probe/verify.py".
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from privcode.errors import PrivcodeError

__all__ = ["HIT_RANGE", "ReferenceIndex", "VerifyError", "Verification"]

#: The seed's hit range (inclusive).
HIT_RANGE = (1, 100)
_CASE_INSENSITIVE = frozenset({"email", "ip_address"})


class VerifyError(PrivcodeError, ValueError):
    """The reference corpus is empty or a hit range is invalid."""


@dataclass(frozen=True)
class Verification:
    """``hits``: records containing the value (capped at ``hi + 1``); ``ok``: lo <= hits <= hi."""

    hits: int
    ok: bool
    record_ids: tuple[str, ...]


class ReferenceIndex:
    """Counts the reference records that contain a string (see the module docstring)."""

    def __init__(self, items: Iterable[tuple[str, str]], *, hit_range: tuple[int, int] = HIT_RANGE):
        ids: list[str] = []
        parts: list[str] = []
        starts: list[int] = []
        pos = 0
        for rid, text in items:
            ids.append(str(rid))
            starts.append(pos)
            clean = text.replace("\x00", " ")
            parts.append(clean)
            pos += len(clean) + 1
        if not ids:
            raise VerifyError("the reference corpus has no records")
        lo, hi = hit_range
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise VerifyError(f"hit range must be integers 1 <= lo <= hi, got {hit_range!r}")
        self.ids, self.starts, self.hit_range = ids, starts, (lo, hi)
        self._text = "\x00".join(parts) + "\x00"
        self._lower: str | None = None

    @classmethod
    def from_records(cls, records: Sequence, **kwargs) -> ReferenceIndex:
        """From privcode records (``id``, ``prompt``, ``code``): text = prompt + newline + code."""

        def get(r, k):
            return r[k] if isinstance(r, dict) else getattr(r, k)

        return cls(
            ((get(r, "id"), f"{get(r, 'prompt')}\n{get(r, 'code')}") for r in records), **kwargs
        )

    def __len__(self) -> int:
        return len(self.ids)

    def _haystack(self, attribute: str | None) -> str:
        if attribute in _CASE_INSENSITIVE:
            if self._lower is None:
                self._lower = self._text.lower()
            return self._lower
        return self._text

    def hits(
        self, value: str, attribute: str | None = None, cap: int | None = None
    ) -> tuple[int, tuple[str, ...]]:
        """(number of records containing ``value``, their ids), counting stops after ``cap``."""
        if not value or "\x00" in value:
            return 0, ()
        cap = self.hit_range[1] + 1 if cap is None else cap
        text = self._haystack(attribute)
        needle = value.lower() if attribute in _CASE_INSENSITIVE else value
        found: list[str] = []
        at = text.find(needle)
        while at >= 0 and len(found) < cap:
            i = bisect.bisect_right(self.starts, at) - 1
            found.append(self.ids[i])
            nxt = self.starts[i + 1] if i + 1 < len(self.starts) else len(text)
            at = text.find(needle, nxt)
        return len(found), tuple(found)

    def verify(self, value: str, attribute: str | None = None) -> Verification:
        """The seed's rule: keep ``value`` iff lo <= hits <= hi (default 1..100)."""
        lo, hi = self.hit_range
        n, ids = self.hits(value, attribute)
        ok = lo <= n <= hi
        return Verification(hits=n, ok=ok, record_ids=ids if ok else ())
