"""Error types shown to users: each message names what is wrong and where."""

import importlib
from types import ModuleType


class PrivcodeError(Exception):
    """Base of the errors the CLI reports as one clear line (exit code 2)."""


class ConfigError(PrivcodeError, ValueError):
    """A config file or override is invalid; the message names the key and the file."""


class RecordError(PrivcodeError, ValueError):
    """A dataset row is invalid; the message names the file, row index, id and field."""


class AccountingError(PrivcodeError, ValueError):
    """A privacy-accounting request is invalid or cannot be met (names the value and why)."""


class LedgerUnavailableError(PrivcodeError):
    """The privacy-budget ledger of a run cannot be reached or restored: the run must not train."""


class BudgetRefused(PrivcodeError):
    """Admission refused a DP job: its worst record would go over the privacy store's budget."""


class LedgerConflictError(LedgerUnavailableError):
    """A run's ledger exists with another budget, delta, accountant or write-ahead log."""


class MissingExtraError(PrivcodeError, ImportError):
    """An optional dependency is not installed; names the pip extra that brings it."""


def import_extra(module: str, extra: str, purpose: str) -> ModuleType:
    """``import module``, or :class:`MissingExtraError` saying ``pip install 'privcode[extra]'``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(
            f"{purpose} needs {module.split('.')[0]}, which is not installed: "
            f"pip install 'privcode[{extra}]' ({exc})"
        ) from exc
