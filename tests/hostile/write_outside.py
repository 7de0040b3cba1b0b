# ruff: noqa
# HOSTILE: write files outside the sandbox's work dir: /root, /work/main, /tmp, /dev/shm,
# /var/tmp, the parent's cwd, and any extra paths given on stdin as JSON {"paths": [...]}.
# Prints WROTE/DENIED per path; the test asserts none of the host files appears.
import json, os, sys

params = json.loads(sys.stdin.read() or "{}")
targets = [
    "/root/privcode-hostile-x",
    "/work/main/privcode-hostile-x",
    "/usr/privcode-hostile-x",
    "/etc/privcode-hostile-x",
    "/var/tmp/privcode-hostile-x",
    "/dev/shm/privcode-hostile-x",
    "/tmp/privcode-hostile-x",
] + params.get("paths", [])
for path in targets:
    try:
        with open(path, "w") as fh:
            fh.write("pwned")
        print("WROTE", path)
    except OSError as exc:
        print("DENIED", path, type(exc).__name__)
