# ruff: noqa
# HOSTILE: learn about the host from /proc: its kernel command line and config, boot id,
# load, pressure, memory, uptime, the users of the key store, and the host cgroup path in
# /proc/self/cgroup; list the visible processes. Then check that ordinary stdlib code still
# works (cpu_count, /dev/fd, /dev/stdin) and read oom_score_adj (itself and a child).
import os

for path in (
    "/proc/cmdline",
    "/proc/config.gz",
    "/proc/sys/kernel/random/boot_id",
    "/proc/loadavg",
    "/proc/pressure/cpu",
    "/proc/key-users",
    "/proc/meminfo",
    "/proc/uptime",
    "/proc/stat",
):
    try:
        with open(path, "rb") as fh:
            print(path, "READ", len(fh.read()))
    except OSError as exc:
        print(path, "DENIED", type(exc).__name__)
print("pressure dir", os.path.isdir("/proc/pressure") and os.listdir("/proc/pressure"))
with open("/proc/self/cgroup") as fh:
    print("cgroup", sorted({ln.split(":", 2)[2] for ln in fh.read().split()}))
print("cpus", os.cpu_count(), len(os.sched_getaffinity(0)))
print("fds", sorted(os.listdir("/dev/fd"))[:3], len(open("/dev/stdin").read()))
print("pids", sorted(p for p in os.listdir("/proc") if p.isdigit()))
print("oom", open("/proc/self/oom_score_adj").read().strip())
if os.fork() == 0:
    print("child oom", open("/proc/self/oom_score_adj").read().strip(), flush=True)
    os._exit(0)
os.wait()
