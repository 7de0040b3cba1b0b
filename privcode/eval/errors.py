"""The one error type of :mod:`privcode.eval`."""

from __future__ import annotations

from privcode.errors import PrivcodeError


class EvalError(PrivcodeError, ValueError):
    """An evaluation cannot run: a bad argument, benchmark file, samples file or model.

    The message names the file, the line and the field (never the row's content: samples
    and benchmark rows may be private code).
    """
