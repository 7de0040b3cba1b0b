# ruff: noqa
# HOSTILE: daemonise (double fork + setsid) a grandchild that outlives the snippet, waits
# 2 s and then writes marker files (host path on stdin as JSON {"marker": path}, and in /tmp).
# The snippet itself exits 0 at once. The daemon must be killed with the run.
import json, os, sys, time

marker = json.loads(sys.stdin.read() or "{}").get("marker", "/tmp/privcode-daemon-marker")
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        for fd in (0, 1, 2):
            os.close(fd)
        time.sleep(2)
        for path in (marker, "/tmp/privcode-daemon-marker"):
            try:
                with open(path, "w") as fh:
                    fh.write("daemon survived")
            except OSError:
                pass
        time.sleep(3600)
    os._exit(0)
print("parent done")
