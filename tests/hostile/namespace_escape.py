# ruff: noqa
# HOSTILE: escape the jail: create a user namespace (to be "root" in it: a big kernel attack
# surface), a network namespace, mount something, chroot out (classic mkdir+chroot+chdir ..).
# Prints one line per attempt; exits non-zero only if an attempt worked.
import ctypes, os

libc = ctypes.CDLL(None, use_errno=True)
worked = []
for name, flags in (
    ("user", 0x10000000),
    ("user+net", 0x10000000 | 0x40000000),
    ("net", 0x40000000),
    ("mount", 0x20000),
):
    r = libc.unshare(flags)
    print(f"unshare({name}) ->", "WORKED" if r == 0 else os.strerror(ctypes.get_errno()))
    worked += [name] if r == 0 else []
r = libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)
print("mount ->", "WORKED" if r == 0 else os.strerror(ctypes.get_errno()))
try:
    os.mkdir("jail")
    os.chroot("jail")
    worked.append("chroot")
    print("chroot WORKED")
except OSError as exc:
    print("chroot ->", exc.strerror)
assert not worked, f"escaped: {worked}"
