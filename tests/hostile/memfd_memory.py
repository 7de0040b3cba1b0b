# ruff: noqa
# HOSTILE: take the node's memory where no per-process rlimit looks: 60 memfds of 15 MB each
# (each under RLIMIT_FSIZE, none mapped: RLIMIT_AS never sees them) = 900 MB of shmem.
# The run's cgroup must stop it (status "memory").
import os

chunk = b"x" * (1 << 20)
fds = []
for i in range(60):
    fd = os.memfd_create(f"m{i}")
    for _ in range(15):
        os.write(fd, chunk)
    fds.append(fd)
print("HELD", len(fds) * 15, "MB")
