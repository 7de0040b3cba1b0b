# ruff: noqa
# HOSTILE: kill everything: kill(-1, SIGKILL), killpg of the test's process group, kill of
# the test process (pid/pgid on stdin as JSON) and of pid 1. The test process must survive.
import json, os, signal, sys

params = json.loads(sys.stdin.read() or "{}")
attempts = [
    ("kill(-1)", lambda: os.kill(-1, signal.SIGKILL)),
    ("killpg(test)", lambda: os.killpg(params["pgid"], signal.SIGKILL)),
    ("kill(test)", lambda: os.kill(params["pid"], signal.SIGKILL)),
    ("kill(1)", lambda: os.kill(1, signal.SIGKILL)),
    ("kill(parent)", lambda: os.kill(os.getppid(), signal.SIGKILL)),
]
for name, attempt in attempts:
    try:
        attempt()
        print(name, "sent")
    except OSError as exc:
        print(name, "failed", type(exc).__name__)
print("snippet still alive")
