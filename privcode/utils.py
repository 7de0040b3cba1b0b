"""Small shared helpers: atomic file writes, JSON-object reading and stable content hashes.

Every artifact privcode writes goes through :func:`atomic_path` so that a
crash or a validation error half-way through never leaves a truncated file
under the final name: data is written to a temporary sibling, flushed,
fsynced and then renamed (``os.replace`` is atomic on POSIX within one
filesystem).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it over ``path`` on success.

    On any exception the temporary file is removed and ``path`` is untouched
    (an existing file keeps its old content).
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    # mkstemp creates 0600; artifacts get the usual 0644 (os.umask is process-global
    # and racy under threads, so it is not consulted).
    os.chmod(tmp_path, 0o644)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp_path, final)
        fsync_dir(final.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


def fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace variance: equal objects, equal bytes."""
    return json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False, default=str) + "\n"


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, canonical_json(obj))


def read_json_object(path: str | os.PathLike, error: type[Exception] = ValueError) -> dict[str, Any]:
    """The JSON object in ``path``; ``error`` naming the file when unreadable or not an object."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise error(f"{path}: not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise error(f"{path}: not a JSON object")
    return data


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def stable_hash(obj: Any, length: int = 16) -> str:
    """Short sha256 of the canonical JSON of ``obj`` (config/cache keys)."""
    return sha256_bytes(canonical_json(obj).encode("utf-8"))[:length]


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[int]:
    """Run the block with ``n`` (at least 1) torch threads; restore the previous count after.

    torch's thread count is process state, and Ray reuses worker processes
    across tasks: set it for a block, never for good.
    """
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(max(1, int(n)))
    try:
        yield max(1, int(n))
    finally:
        torch.set_num_threads(previous)
