"""The error of ingesting a company's code: names the file, the row and the field, never a value."""

from __future__ import annotations

from privcode.errors import PrivcodeError

__all__ = ["IngestError"]


class IngestError(PrivcodeError, ValueError):
    """An input cannot be ingested; the message says where (file, row, field) and why.

    Inputs are private: a message never quotes a prompt, code, id or other cell value.
    """
