"""The execution sandbox for generated (hostile) code: Stage II's execution filter, pass@k
evaluation (privcode.eval) and ``privcode sandbox check`` run every snippet here.

:mod:`privcode.sandbox.pool` is the parent side (the API below), :mod:`privcode.sandbox.zygote`
the stdlib-only processes that run the code (and the list of isolation layers),
:mod:`privcode.sandbox.cli` the subcommand.  Design and guarantees: docs/methods.md
("The sandbox").
"""

from privcode.sandbox.pool import (
    DEFAULT_LIMITS,
    FULL,
    ISOLATIONS,
    RLIMITS_ONLY,
    STATUSES,
    WEAK_NOTE,
    SandboxError,
    SandboxLayers,
    SandboxLimits,
    SandboxPool,
    Verdict,
    check_file,
    file_result,
    is_full,
    isolation_level,
    isolation_note,
    run_code,
)

__all__ = [
    "DEFAULT_LIMITS",
    "FULL",
    "ISOLATIONS",
    "RLIMITS_ONLY",
    "STATUSES",
    "WEAK_NOTE",
    "SandboxError",
    "SandboxLayers",
    "SandboxLimits",
    "SandboxPool",
    "Verdict",
    "check_file",
    "file_result",
    "is_full",
    "isolation_level",
    "isolation_note",
    "run_code",
]
