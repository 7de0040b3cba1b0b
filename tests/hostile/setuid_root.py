# ruff: noqa
# HOSTILE: regain root: ctypes setuid(0)/setgid(0)/seteuid(0), then check we are root.
import ctypes, os

libc = ctypes.CDLL(None, use_errno=True)
print(
    "setuid(0) ->", libc.setuid(0), "setgid(0) ->", libc.setgid(0), "seteuid(0) ->", libc.seteuid(0)
)
print("uid", os.getuid(), "euid", os.geteuid())
assert os.geteuid() == 0, "still unprivileged"
