# ruff: noqa
# HOSTILE: the calls that reached the kernel through the old deny-list filter (issue 43):
# modify_ldt, memfd_secret, vmsplice, io_setup/io_submit, mbind, set_mempolicy, move_pages,
# migrate_pages, sysfs, ustat, pidfd_open; memfd_create (shmem no rlimit sees) and sysinfo
# (the host's uptime, load and RAM). Each with arguments that do something if the call gets through. One line per call:
# "<name> DENIED <errno>" (the filter's EPERM) or "<name> REACHED <result> <errno>".
# x86_64 syscall numbers.
import ctypes, os, platform

assert platform.machine() == "x86_64", platform.machine()
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
buf = ctypes.create_string_buffer(4096)
ctx = ctypes.c_ulong(0)
r, w = os.pipe()
iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 16)  # struct iovec {base, len}
mask = ctypes.c_ulong(1)
name = ctypes.create_string_buffer(b"m")
CALLS = {
    "modify_ldt": (154, 0, ctypes.addressof(buf), 16),  # read the LDT
    "memfd_secret": (447, 0),
    "vmsplice": (278, w, ctypes.addressof(iov), 1, 0),
    "io_setup": (206, 1, ctypes.addressof(ctx)),
    "io_submit": (209, 0, 0, 0),
    "mbind": (237, ctypes.addressof(buf), 4096, 0, 0, 0, 0),  # MPOL_DEFAULT
    "set_mempolicy": (238, 0, 0, 0),  # MPOL_DEFAULT
    "move_pages": (279, 0, 0, 0, 0, 0, 0),
    "migrate_pages": (256, 0, 64, ctypes.addressof(mask), ctypes.addressof(mask)),
    "sysfs": (139, 3),  # the number of filesystem types
    "ustat": (136, 0, ctypes.addressof(buf)),
    "pidfd_open": (434, os.getpid(), 0),
    "memfd_create": (319, ctypes.addressof(name), 0),
    "sysinfo": (99, ctypes.addressof(buf)),  # the host's uptime, load and memory
}
for name, (nr, *args) in CALLS.items():
    ctypes.set_errno(0)
    res = libc.syscall(ctypes.c_long(nr), *map(ctypes.c_long, args))  # 64-bit, not int
    err = ctypes.get_errno()
    print(name, "DENIED" if res == -1 and err == 1 else f"REACHED {res}", err)
try:
    os.memfd_create("m")
    print("os.memfd_create REACHED")
except OSError as exc:
    print("os.memfd_create DENIED", exc.errno)
