# ruff: noqa
# HOSTILE: reach the kernel's attack surface from the snippet: io_uring, bpf, userfaultfd,
# the key store, perf events, ptrace and cross-process memory, namespaces, mounts, kexec,
# kernel modules, handle-based opens, clone with namespace flags, clone3, and a syscall of
# the x32 ABI. One line per call: "<group> <name> DENIED <errno>" or "<group> <name>
# ALLOWED". x86_64 syscall numbers.
import ctypes, os, platform

assert platform.machine() == "x86_64", platform.machine()
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
CALLS = {
    "io_uring": {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427},
    "bpf": {"bpf": 321},
    "userfaultfd": {"userfaultfd": 323},
    "keys": {"keyctl": 250, "add_key": 248, "request_key": 249},
    "perf": {"perf_event_open": 298},
    "ptrace": {"ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311},
    "namespaces": {"unshare": 272, "setns": 308},
    "mount": {"mount": 165, "umount2": 166, "pivot_root": 155, "fsopen": 430, "open_tree": 428},
    "kexec": {"kexec_load": 246, "kexec_file_load": 320},
    "modules": {"init_module": 175, "finit_module": 313, "delete_module": 176},
    "handles": {"open_by_handle_at": 304, "name_to_handle_at": 303},
}
buf = ctypes.create_string_buffer(4096)
for group, calls in CALLS.items():
    for name, nr in calls.items():
        # Arguments that would do something if the call got through (a valid pointer, fd 0).
        r = libc.syscall(nr, 0, ctypes.addressof(buf), 0, 0, 0, 0)
        err = ctypes.get_errno()
        print(group, name, "ALLOWED" if r >= 0 or err != 1 else "DENIED", err)
# clone(CLONE_NEWNET | SIGCHLD): a child in a fresh network namespace, if it got through.
r = libc.syscall(56, 0x40000000 | 17, 0, 0, 0, 0)
if r == 0:
    os._exit(0)
print("clone_ns clone", "ALLOWED" if r > 0 else "DENIED", ctypes.get_errno())
r = libc.syscall(435, ctypes.addressof(buf), 88)  # clone3 with a zeroed struct: a plain fork
if r == 0:
    os._exit(0)
print("clone3 clone3", "ALLOWED" if r > 0 else "DENIED", ctypes.get_errno())
pid = os.fork()
if pid == 0:  # the x32 ABI's getpid: outside the filter's architecture
    libc.syscall(0x40000000 | 39)
    os._exit(0)
print("x32 getpid", "status", os.waitpid(pid, 0)[1])
