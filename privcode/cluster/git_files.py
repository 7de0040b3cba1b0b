"""Which files of a working directory a Ray job may take along: git's tracked files.

A job's ``working_dir`` upload packs everything under the directory that the
``excludes`` do not name (Ray also honours ``.gitignore``).  A file lying untracked
in a checkout (a key, a dump of private data, a scratch copy of the corpus) is
not meant to leave the machine, so where the directory is a git checkout the
upload holds the files ``git ls-files`` lists (tracked, not deleted) and nothing
else: :func:`untracked_excludes` turns every untracked path, ignored or not, into
an anchored Ray ``excludes`` pattern.  Ray's ``excludes`` (gitignore syntax) are
the mechanism because Ray offers no file list; git is asked rather than
re-implementing ignore rules.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

GIT_TIMEOUT_S = 30.0
_GLOB_SPECIALS = "\\*?["


def _git(root: Path, *args: str) -> subprocess.CompletedProcess[bytes] | None:
    """``git -C root args...``; None when git is missing or times out."""
    git = shutil.which("git")
    if git is None:
        return None
    try:
        return subprocess.run(
            [git, "--literal-pathspecs", "-C", str(root), *args],
            capture_output=True,
            timeout=GIT_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None


def is_checkout(root: str | Path) -> bool:
    """Whether ``root`` lies in a git work tree (and git is there to ask)."""
    done = _git(Path(root), "rev-parse", "--is-inside-work-tree")
    return done is not None and done.returncode == 0 and done.stdout.strip() == b"true"


def _escape(path: str) -> str:
    """``path`` as a gitwildmatch pattern that matches it literally, anchored at the root."""
    out = []
    for ch in path:
        if ch in _GLOB_SPECIALS:
            out.append("\\" + ch)
        elif ch < " ":  # a newline would end the pattern: match any one character there
            out.append("?")
        else:
            out.append(ch)
    text = "".join(out)
    stripped = text.rstrip(" ")  # trailing spaces are dropped from patterns unless bracketed
    return "/" + stripped + "[ ]" * (len(text) - len(stripped))


def untracked_excludes(root: str | Path) -> list[str] | None:
    """Ray ``excludes`` patterns for every untracked path under ``root``; None if no checkout.

    ``git ls-files --others --directory`` lists untracked files, ignored ones
    included, and each wholly untracked directory once (``dir/``), so ``.venv/``
    is one pattern, not a walk of it.
    """
    root = Path(root)
    if not is_checkout(root):
        return None
    done = _git(root, "ls-files", "-z", "--others", "--directory")
    if done is None or done.returncode != 0:
        return None
    paths = [p.decode("utf-8", "surrogateescape") for p in done.stdout.split(b"\0") if p]
    return [_escape(p) for p in paths]


def is_tracked(root: str | Path, relative: str) -> bool:
    """Whether git tracks ``relative`` (a file path under ``root``)."""
    done = _git(Path(root), "ls-files", "--error-unmatch", "--", relative)
    return done is not None and done.returncode == 0
