"""The sandbox slots' uids: a random base per pool, inside this user namespace's uid map.

A slot runs its snippets as ``base + index`` (or the next free uid after it).  A fixed
node-wide range (61000+ before) is shared with every other pod on the node: their
processes of those uids counted against a run's RLIMIT_NPROC and looked like survivors of
its kill.  A random base from 2**31 - 2**20 makes such sharing improbable; in a pod with
user namespaces (``hostUsers: false``) only 0..65535 are mapped, every one the pod's own.
Within a node, or a pod, an ``flock`` per uid (in the pool's state directory) makes each
uid one slot's, across processes too.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import threading

SPAN = 1000  # uids from a base: slot indices 0..999
# Where a base is drawn: far above the uids of any distribution or image, else (a pod with
# user namespaces maps 0..65535 only, all its own) between 10000 and nobody (65534).
WINDOWS = ((1 << 20, 1 << 31), (10_000, 65_534))


def _id_ranges(path: str) -> list[tuple[int, int]]:
    """[start, end) of the ids mapped into this user namespace (/proc/self/uid_map...)."""
    with open(path, encoding="ascii") as fh:
        return [(int(a), int(a) + int(n)) for a, _, n in (ln.split() for ln in fh if ln.strip())]


def random_uid_base(span: int = SPAN) -> int:
    """A random first uid (``secrets``) of ``span`` uids that are all mapped as uid and gid
    in this user namespace, from the first of :data:`WINDOWS` with room; OSError if none."""
    try:
        uids, gids = _id_ranges("/proc/self/uid_map"), _id_ranges("/proc/self/gid_map")
    except FileNotFoundError:  # a kernel without user namespaces: everything is mapped
        uids = gids = [(0, 1 << 32)]
    mapped = [(max(a, c), min(b, d)) for a, b in uids for c, d in gids if max(a, c) < min(b, d)]
    for lo, hi in WINDOWS:
        spans = [(max(a, lo), min(b, hi) - span) for a, b in mapped]
        spans = [(a, b) for a, b in spans if b > a]
        if total := sum(b - a for a, b in spans):
            pick = secrets.randbelow(total)
            for a, b in spans:
                if pick < b - a:
                    return a + pick
                pick -= b - a
    raise OSError(f"no room for {span} sandbox uids in this user namespace's uid/gid maps {mapped}")


class UidBase:
    """A base drawn on first use, once (thread-safe): one per pool."""

    def __init__(self) -> None:
        self._lock, self._value = threading.Lock(), None

    def get(self) -> int:
        with self._lock:
            if self._value is None:
                self._value = random_uid_base()
            return self._value


PROCESS_BASE = UidBase()  # the base of this process's run_code slots


def try_lock(lock_dir: str, uid: int) -> int | None:
    """An fd holding an exclusive ``flock`` on ``uid``, or None if another process has it.
    A lock won on a file that its last owner unlinked meanwhile (:func:`release`) does not
    count."""
    path = os.path.join(lock_dir, f"uid-{uid}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        st, now = os.fstat(fd), os.stat(path, follow_symlinks=False)
        if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
            return fd
    except (BlockingIOError, FileNotFoundError):
        pass
    os.close(fd)
    return None


def claim(lock_dir: str, base: int, index: int) -> tuple[int, int]:
    """(uid, lock fd): the first free of ``base + index``, ``base + index + 1``... (mod
    :data:`SPAN`); OSError if all are taken."""
    for i in range(SPAN):
        uid = base + (index + i) % SPAN
        if (fd := try_lock(lock_dir, uid)) is not None:
            return uid, fd
    raise OSError(f"all {SPAN} sandbox uids from {base} are in use")


def release(lock_dir: str, uid: int, fd: int) -> None:
    """Give ``uid`` back: its lock file goes (unlinked while held: see :func:`_lock`)."""
    try:
        os.unlink(os.path.join(lock_dir, f"uid-{uid}.lock"))
    except OSError:
        pass
    os.close(fd)
