# ruff: noqa
# HOSTILE: forge verdicts through the sandbox's own processes: walk up the parents and open
# /proc/<pid>/mem read-write (and environ) of each one whose command line is the zygote's
# (it holds the requests and outputs of every run). In rlimits-only the zygote runs as the
# snippet's own user: only PR_SET_DUMPABLE 0 keeps its memory closed.
import os

pid = os.getppid()
while pid > 0:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmdline = fh.read()
        with open(f"/proc/{pid}/stat", "rb") as fh:
            parent = int(fh.read().rsplit(b")", 1)[1].split()[1])
    except OSError as exc:
        print("parent", pid, "INVISIBLE", type(exc).__name__)
        break
    if b"_privcode_sandbox_zygote" in cmdline:
        for name, mode in (("mem", "r+b"), ("environ", "rb")):
            try:
                with open(f"/proc/{pid}/{name}", mode, buffering=0):
                    print("zygote", pid, name, "OPENED")
            except OSError as exc:
                print("zygote", pid, name, "DENIED", type(exc).__name__)
    pid = parent
