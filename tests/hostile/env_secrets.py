# ruff: noqa
# HOSTILE: read environment secrets: os.environ, /proc/self/environ, the parent's and
# pid 1's environ. Prints everything it gets; the test asserts no secret is in the output.
import os

print(dict(os.environ))
for path in ("/proc/self/environ", "/proc/1/environ", f"/proc/{os.getppid()}/environ"):
    try:
        print(path, open(path, "rb").read())
    except OSError as exc:
        print(path, "DENIED", type(exc).__name__)
