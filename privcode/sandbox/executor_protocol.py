"""The executor's wire contract, shared by its server and its client: caps, limits, the
capped verdicts and the bearer token (:mod:`privcode.sandbox.executor` describes the service).

* :data:`MAX_LIMITS`: the most a client may ask for, per program; a server clamps
  ``memory_mb`` and ``disk_mb`` further to its pod's budget (:func:`clamp_limits`).
* A verdict on the wire (:func:`capped`): ``passed``, ``status``, ``seconds``, ``returncode``,
  ``isolation`` (at most 64 characters), ``error`` (at most :data:`ERROR_CHARS`) and the last
  ``tail_chars`` characters (default :data:`TAIL_CHARS`) of ``stdout`` and ``stderr``. JSON
  (at most 6 bytes a character), one verdict is at most :func:`verdict_max_bytes` and an
  answer at most ``ANSWER_HEAD_BYTES + programs x verdict_max_bytes``, whatever is printed.
* The token: the server reads it from ``--token-file`` (default ``$``:data:`SERVER_TOKEN_ENV`),
  clients from the file named by ``$``:data:`CLIENT_TOKEN_ENV`; at least
  :data:`MIN_TOKEN_CHARS` characters, compared in constant time, never logged or echoed.

Design notes: docs/kubernetes.md, "privcode/sandbox/executor_protocol.py".
"""

from __future__ import annotations

import hmac
import json
import math
from dataclasses import fields, replace
from pathlib import Path

from privcode.sandbox.pool import DEFAULT_LIMITS, SandboxError, SandboxLimits, Verdict

#: The most a client may ask for, per program (before a pod budget's clamp).
MAX_LIMITS = SandboxLimits(
    cpu_seconds=60,
    wall_seconds=120,
    memory_mb=4096,
    max_processes=64,
    file_size_mb=64,
    open_files=256,
    output_bytes=1 << 20,
    disk_mb=256,
    cpus=2.0,
)
MAX_PROGRAM_BYTES = 1 << 20
TAIL_CHARS = 2048
ERROR_CHARS = 128
ISOLATION_CHARS = 64
ANSWER_HEAD_BYTES = 256
SERVER_TOKEN_ENV = "PRIVCODE_EXECUTOR_TOKEN_FILE"
CLIENT_TOKEN_ENV = "PRIVCODE_SANDBOX_EXECUTOR_TOKEN_FILE"
MIN_TOKEN_CHARS = 16


class Refused(Exception):
    """A request the executor answers with ``status`` and ``message`` (never its content)."""

    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.retry_after = status, retry_after


def parse_limits(raw: object, caps: SandboxLimits = MAX_LIMITS) -> SandboxLimits:
    """A client's limits over the defaults; ValueError naming the field if bad or over a cap."""
    if raw is None:
        return DEFAULT_LIMITS
    if not isinstance(raw, dict):
        raise ValueError("limits must be an object")
    names = {f.name for f in fields(SandboxLimits)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ValueError(f"unknown limits: {unknown}")
    for k, v in raw.items():
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"limits.{k} must be a number")
        if not math.isfinite(v):  # JSON's Infinity and NaN: int() would raise OverflowError
            raise ValueError(f"limits.{k} must be a finite number")
        if v > getattr(caps, k):
            raise ValueError(f"limits.{k}={v} exceeds this executor's cap {getattr(caps, k)}")
    typed = {
        k: (int(v) if isinstance(getattr(DEFAULT_LIMITS, k), int) else float(v))
        for k, v in raw.items()
    }
    return replace(DEFAULT_LIMITS, **typed)  # SandboxLimits validates (> 0)


def clamp_limits(
    workers: int,
    memory_budget_mb: int | None = None,
    disk_budget_mb: int | None = None,
    reserve_mb: int = 0,
    caps: SandboxLimits = MAX_LIMITS,
) -> SandboxLimits:
    """``caps`` with ``memory_mb`` and ``disk_mb`` lowered so that ``workers`` runs at their
    caps fit the pod: ``workers x (memory_mb + disk_mb) + reserve_mb <= memory_budget_mb``
    (a run's tmpfs /tmp is memory too) and ``workers x disk_mb <= disk_budget_mb``.
    SandboxError when even :data:`DEFAULT_LIMITS` do not fit."""
    need = DEFAULT_LIMITS
    disk, memory = caps.disk_mb, caps.memory_mb
    if disk_budget_mb is not None:
        disk = min(disk, disk_budget_mb // workers)
    per_run = None
    if memory_budget_mb is not None:
        per_run = (memory_budget_mb - reserve_mb) // workers
        disk = min(disk, per_run - need.memory_mb)
        memory = min(memory, per_run - disk)
    if disk < need.disk_mb or memory < need.memory_mb:
        wanted = f"{workers} runs x ({need.memory_mb} MiB memory + {need.disk_mb} MiB disk)"
        raise SandboxError(
            f"the executor's budget cannot hold its default limits: {wanted} plus "
            f"{reserve_mb} MiB for the server need --memory-budget-mb >= "
            f"{workers * (need.memory_mb + need.disk_mb) + reserve_mb} (got {memory_budget_mb})"
            f" and --disk-budget-mb >= {workers * need.disk_mb} (got {disk_budget_mb}): "
            "give the pod more, or fewer --workers"
        )
    return replace(caps, memory_mb=memory, disk_mb=disk)


def programs(body: object, max_batch: int) -> tuple[list[str], list[str], object]:
    """(codes, stdins, raw limits) of a ``/v1/run`` body; :class:`Refused` if malformed."""
    if not isinstance(body, dict) or not isinstance(body.get("programs"), list):
        raise Refused(400, "body must be an object with a 'programs' list")
    progs = body["programs"]
    if not progs:
        raise Refused(400, "'programs' is empty")
    if len(progs) > max_batch:
        raise Refused(413, f"{len(progs)} programs: at most {max_batch} per request")
    codes, stdins = [], []
    for i, p in enumerate(progs):
        if not isinstance(p, dict) or not isinstance(p.get("code"), str):
            raise Refused(400, f"programs[{i}] must be an object with a string 'code'")
        stdin = p.get("stdin", "")
        if not isinstance(stdin, str):
            raise Refused(400, f"programs[{i}].stdin must be a string")
        if len(p["code"]) > MAX_PROGRAM_BYTES or len(stdin) > MAX_PROGRAM_BYTES:
            raise Refused(413, f"programs[{i}]: code and stdin at most {MAX_PROGRAM_BYTES} each")
        codes.append(p["code"])
        stdins.append(stdin)
    return codes, stdins, body.get("limits")


def capped(v: Verdict, tail_chars: int = TAIL_CHARS) -> dict:
    """``v`` as sent: the tails of its output, its error name and isolation cut (module doc)."""
    return {
        "passed": bool(v.passed),
        "status": str(v.status)[:16],
        "seconds": float(v.seconds),
        "returncode": None if v.returncode is None else int(v.returncode),
        "stdout": v.stdout[-tail_chars:] if tail_chars else "",
        "stderr": v.stderr[-tail_chars:] if tail_chars else "",
        "isolation": str(v.isolation)[:ISOLATION_CHARS],
        "error": None if v.error is None else str(v.error)[:ERROR_CHARS],
    }


def verdict_max_bytes(tail_chars: int = TAIL_CHARS) -> int:
    """The most one :func:`capped` verdict takes in an answer (6 bytes a character)."""
    return 6 * (2 * tail_chars + ERROR_CHARS + ISOLATION_CHARS + 16) + 256


def encode(obj: object) -> bytes:
    """JSON as UTF-8; a lone surrogate (never in decoded output) becomes '?'."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False).encode("utf-8", "replace")


def read_token(path: str | Path, where: str) -> str:
    """The token in the file ``path`` (named in errors as ``where``), never in a message."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeError) as exc:
        reason = getattr(exc, "strerror", None) or type(exc).__name__
        raise SandboxError(f"executor token file {path} ({where}): {reason}") from None
    if len(token) < MIN_TOKEN_CHARS or not token.isascii() or not token.isprintable():
        raise SandboxError(
            f"executor token file {path} ({where}): at least {MIN_TOKEN_CHARS} printable "
            "ASCII characters"
        )
    return token


def bearer_matches(values: list[bytes], token: bytes) -> bool:
    """True iff there is one ``Authorization: Bearer <token>`` (constant-time compare)."""
    if len(values) != 1:
        return False
    scheme, _, presented = values[0].strip().partition(b" ")
    ok = hmac.compare_digest(presented.strip(), token)
    return ok and scheme.lower() == b"bearer"


__all__ = [
    "ANSWER_HEAD_BYTES",
    "CLIENT_TOKEN_ENV",
    "MAX_LIMITS",
    "SERVER_TOKEN_ENV",
    "TAIL_CHARS",
    "Refused",
    "bearer_matches",
    "capped",
    "clamp_limits",
    "encode",
    "parse_limits",
    "programs",
    "read_token",
    "verdict_max_bytes",
]
