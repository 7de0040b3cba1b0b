"""The split of the Python standard library into private and public halves.

The offline demo needs two corpora that must never overlap:

* the *private* demo corpus (``privcode data demo``) is drawn from the
  modules in :data:`PRIVATE_MODULES` (networking, e-mail, formats: code in
  which a company's PII would plausibly appear), plus HumanEval;
* the *public* base model (``privcode base build``) is pretrained on every
  other module of the same standard library (:func:`public_source_files`).

Keeping the two disjoint is what lets the audits claim that a canary or a
private function the junior model reproduces came from DP fine-tuning and
not from pretraining. ``tests/test_disjoint.py`` checks it file by file and
function by function.
"""

from __future__ import annotations

import functools
import sysconfig
from collections.abc import Iterator
from pathlib import Path

#: Top-level stdlib modules/packages whose functions form the private corpus.
PRIVATE_MODULES: tuple[str, ...] = (
    "base64",
    "bisect",
    "calendar",
    "configparser",
    "csv",
    "datetime",
    "difflib",
    "email",
    "fnmatch",
    "ftplib",
    "getpass",
    "glob",
    "gzip",
    "heapq",
    "hmac",
    "html",
    "http",
    "imaplib",
    "ipaddress",
    "json",
    "mailbox",
    "mimetypes",
    "netrc",
    "poplib",
    "quopri",
    "secrets",
    "shlex",
    "shutil",
    "smtplib",
    "socketserver",
    "statistics",
    "tarfile",
    "textwrap",
    "urllib",
    "uuid",
    "wsgiref",
    "zipfile",
)

#: Parts of the stdlib used by neither corpus: tests (they quote other
#: modules' code), vendored or generated files, and platform-specific noise.
EXCLUDED_PARTS: frozenset[str] = frozenset(
    {
        "test",
        "tests",
        "idle_test",
        "site-packages",
        "dist-packages",
        "lib2to3",
        "idlelib",
        "turtledemo",
        "ensurepip",
        "__pycache__",
        "config-3.11-x86_64-linux-gnu",
        "__phello__",
        "encodings",
        "pydoc_data",
    }
)


def stdlib_dir() -> Path:
    """The directory of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def _top_module(rel: Path) -> str:
    head = rel.parts[0]
    return head[:-3] if head.endswith(".py") else head


def _eligible(rel: Path) -> bool:
    return not any(part in EXCLUDED_PARTS or part.startswith("_test") for part in rel.parts)


@functools.lru_cache(maxsize=1)
def _scan_stdlib() -> tuple[tuple[str, Path], ...]:
    # One directory walk per process (about a second): both corpora reuse it.
    root = stdlib_dir()
    return tuple(
        (_top_module(p.relative_to(root)), p)
        for p in sorted(root.rglob("*.py"))
        if _eligible(p.relative_to(root))
    )


def iter_stdlib_files() -> Iterator[tuple[str, Path]]:
    """(top-level module name, path) of every eligible ``.py`` file, sorted."""
    yield from _scan_stdlib()


def private_source_files() -> list[Path]:
    """Source files of :data:`PRIVATE_MODULES`, in a deterministic order."""
    private = set(PRIVATE_MODULES)
    return [p for mod, p in iter_stdlib_files() if mod in private]


def public_source_files() -> list[Path]:
    """Every other eligible stdlib source file: the public pretraining corpus."""
    private = set(PRIVATE_MODULES)
    return [p for mod, p in iter_stdlib_files() if mod not in private]
