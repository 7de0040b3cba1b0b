"""Error types shown to users: each message names what is wrong and where."""


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


class LedgerConflictError(LedgerUnavailableError):
    """A run's ledger exists with another budget, delta, accountant or write-ahead log."""
