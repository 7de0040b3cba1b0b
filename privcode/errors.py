"""Error types shown to users: each message names what is wrong and where."""


class PrivcodeError(Exception):
    """Base of the errors the CLI reports as one clear line (exit code 2)."""


class ConfigError(PrivcodeError, ValueError):
    """A config file or override is invalid; the message names the key and the file."""


class RecordError(PrivcodeError, ValueError):
    """A dataset row is invalid; the message names the file, row index, id and field."""
