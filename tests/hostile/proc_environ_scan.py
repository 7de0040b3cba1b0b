# ruff: noqa
# HOSTILE: read every process's /proc/<pid>/environ and cmdline, and the test process's by
# pid (stdin JSON {"pid": N}), looking for secrets.
import json, os, sys

pid = json.loads(sys.stdin.read() or "{}").get("pid")
pids = [p for p in os.listdir("/proc") if p.isdigit()] + ([str(pid)] if pid else [])
print("visible pids", sorted(pids))
for p in pids:
    for name in ("environ", "cmdline"):
        try:
            print(p, name, open(f"/proc/{p}/{name}", "rb").read())
        except OSError as exc:
            print(p, name, "DENIED", type(exc).__name__)
