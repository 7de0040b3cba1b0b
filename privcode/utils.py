"""Small shared helpers: atomic file writes, JSON-object reading and stable content hashes.

Every artifact privcode writes goes through :func:`atomic_path` so that a
crash or a validation error half-way through never leaves a truncated file
under the final name: data is written to a temporary sibling, flushed,
fsynced and then renamed (``os.replace`` is atomic on POSIX within one
filesystem). Files are private (0600, directories 0700) unless the caller
publishes them, whatever the process umask.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

#: File and directory modes inside the private boundary (the run directory: the private
#: corpus, checkpoints, the non-DP comparison, audit data; the privacy store): the default.
PRIVATE_FILE_MODE, PRIVATE_DIR_MODE = 0o600, 0o700
#: For what is meant to be read by others: the published report, a DP release.
PUBLIC_FILE_MODE, PUBLIC_DIR_MODE = 0o644, 0o755


def dir_mode_for(file_mode: int) -> int:
    """The directory mode that goes with ``file_mode``: search (x) wherever read is set."""
    return file_mode | ((file_mode & 0o444) >> 2)


def make_dirs(path: str | os.PathLike, mode: int = PRIVATE_DIR_MODE) -> Path:
    """``mkdir -p path``, each directory it creates getting ``mode`` whatever the umask.

    Existing directories keep their mode. ``os.umask`` is process-global and racy under
    threads, so each new directory is chmod-ed instead.
    """
    path = Path(path)
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another writer made it first: its mode
            directory.mkdir(mode=mode)
            os.chmod(directory, mode)
    return path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, mode: int = PRIVATE_FILE_MODE) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it over ``path`` on success.

    On any exception the temporary file is removed and ``path`` is untouched
    (an existing file keeps its old content). The file gets ``mode`` whatever the
    umask: private (0600) unless a caller publishes (:data:`PUBLIC_FILE_MODE`);
    missing parent directories get the matching :func:`dir_mode_for` mode.
    """
    final = Path(path)
    make_dirs(final.parent, dir_mode_for(mode))
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    os.chmod(tmp_path, mode)  # and again before the rename: a writer may re-create the file
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as fh:
            os.fsync(fh.fileno())
            os.fchmod(fh.fileno(), mode)
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


def replace_dir(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Rename the finished directory ``tmp`` to ``final``, replacing an older one there whole.

    The old directory is moved aside first (and moved back if the rename fails), so ``final``
    is never a mix of both; a reader racing the swap may briefly find none. The old one is
    removed afterwards.
    """

    tmp, final = Path(tmp), Path(final)
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
    try:
        os.rename(tmp, final)
    except BaseException:
        if old is not None:
            os.rename(old, final)
        raise
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, mode: int = PRIVATE_FILE_MODE) -> None:
    with atomic_path(path, mode) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str, mode: int = PRIVATE_FILE_MODE) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), mode)


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace variance: equal objects, equal bytes."""
    return json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False, default=str) + "\n"


def atomic_write_json(path: str | os.PathLike, obj: Any, mode: int = PRIVATE_FILE_MODE) -> None:
    atomic_write_text(path, canonical_json(obj), mode)


def read_json_object(
    path: str | os.PathLike, error: type[Exception] = ValueError
) -> dict[str, Any]:
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


class ThreadTuner:
    """Picks the faster of ``threads`` and 1 torch thread for a training loop, and re-checks.

    On an idle 2-core machine two threads make the demo base's step about 1.9x
    faster than one; beside one busy process they make it about 9x *slower*
    (libgomp spin-waits for its descheduled thread: 4.8 s instead of 0.55 s a
    step, measured). So the loop starts on 1 thread (the cheap mistake), and
    from step ``first_probe`` on runs up to ``probe_steps`` steps on the other
    setting every ``probe_every`` steps; it keeps more threads only where their
    median step time is at least 10% below fewer threads' (beside a busy
    process two passive OpenMP threads came within 10-25% of one thread,
    either side of it by noise; one thread won there: 1,840 vs 1,420-1,660
    tokens/s, measured). A probe step slower than 1.5x the
    current median ends its probe at once, and a probe that loses doubles the
    wait before the next (up to 8x ``probe_every``): a busy machine pays for
    one slow step now and then, not for four every 64. The choice changes
    timing only, never what is computed. ``set_threads`` is called whenever
    the count changes (default ``torch.set_num_threads``).
    """

    #: A probe step this much slower than the current median ends the probe.
    ABORT_RATIO = 1.5
    #: More threads are kept only at this fraction of fewer threads' median step time or less
    #: (fewer threads, then, at its inverse of more threads' median or less: one boundary).
    MORE_THREADS_RATIO = 0.90
    #: Longest wait between probes, in multiples of ``probe_every``.
    MAX_BACKOFF = 8

    def __init__(
        self,
        threads: int,
        *,
        probe_every: int = 64,
        probe_steps: int = 4,
        first_probe: int = 4,
        set_threads: Any = None,
    ):
        if probe_every <= probe_steps or probe_steps < 2 or first_probe < 2:
            raise ValueError("need probe_every > probe_steps >= 2 and first_probe >= 2")
        self.options = sorted({max(1, int(threads)), 1})
        self.current = self.options[0]
        self.probe_every, self.probe_steps = probe_every, probe_steps
        self.steps = {n: 0 for n in self.options}  # steps run at each setting
        self.probes = 0  # probes started
        self._times: dict[int, list[float]] = {n: [] for n in self.options}
        self._set = set_threads or _set_torch_threads
        self._active = 0  # no count applied yet
        self._wait = probe_every  # steps from the end of one probe to the next
        self._next_probe = first_probe
        self._probe_left = 0

    def _other(self) -> int | None:
        return next((o for o in self.options if o != self.current), None)

    def threads_for(self, step: int) -> int:
        """The thread count for ``step`` (applied before it returns)."""
        other = self._other()
        if other is not None and not self._probe_left and step >= self._next_probe:
            self._probe_left = self.probe_steps
            self._times[other].clear()
            self.probes += 1
        n = other if self._probe_left and other is not None else self.current
        if n != self._active:
            self._set(n)
            self._active = n
        return n

    def observe(self, step: int, seconds: float) -> None:
        """Record ``step``'s wall time (run at the count last applied); at the end of a
        probe, keep the faster setting."""
        self.steps[self._active] += 1
        times = self._times[self._active]
        times.append(seconds)
        if self._active == self.current:
            del times[: -self.probe_steps]
            return
        self._probe_left -= 1
        mine = self._times[self.current]
        clearly_slower = bool(mine) and seconds > self.ABORT_RATIO * statistics.median(mine)
        if self._probe_left and not clearly_slower:
            return
        self._probe_left = 0
        ratio = (
            self.MORE_THREADS_RATIO if self._active > self.current else 1 / self.MORE_THREADS_RATIO
        )
        if (
            len(times) >= 2
            and len(mine) >= 2
            and statistics.median(times) < ratio * statistics.median(mine)
        ):
            self.current, self._wait = self._active, self.probe_every
        else:
            self._wait = min(2 * self._wait, self.MAX_BACKOFF * self.probe_every)
        self._next_probe = step + 1 + self._wait


def _set_torch_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """PEP 562 lazy re-exports: ``(__all__, __getattr__, __dir__)`` for ``package``'s
    ``__init__``, where ``exports`` maps each submodule to the names it provides
    (space-separated, as :func:`collections.namedtuple`'s fields). A name
    is imported from ``package.<submodule>`` on first access and kept, so importing the
    package (for the CLI's parser) imports nothing heavy."""
    where = {name: module for module, names in exports.items() for name in names.split()}

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return sorted(where), __getattr__, __dir__
