# ruff: noqa
# HOSTILE: sockets of families outside the network namespace's reach: AF_VSOCK (the
# hypervisor's channel on VM-isolated nodes: no network namespace), AF_NETLINK (the
# kernel's configuration interfaces), AF_PACKET, AF_ALG (kernel crypto), AF_BLUETOOTH, and
# socketpair of a family other than AF_UNIX. One line each: "<family> DENIED <errno>" or
# "<family> CREATED"; then the allowed families (AF_UNIX, AF_INET, AF_INET6) for contrast.
import socket

TRIES = {
    "AF_VSOCK": (40, socket.SOCK_STREAM),
    "AF_NETLINK": (16, socket.SOCK_RAW),
    "AF_PACKET": (17, socket.SOCK_DGRAM),
    "AF_ALG": (38, socket.SOCK_SEQPACKET),
    "AF_BLUETOOTH": (31, socket.SOCK_STREAM),
}
for name, (family, kind) in TRIES.items():
    try:
        socket.socket(family, kind).close()
        print(name, "CREATED")
    except OSError as exc:
        print(name, "DENIED", exc.errno)
try:
    socket.socketpair(socket.AF_INET)
    print("socketpair(AF_INET) CREATED")
except OSError as exc:
    print("socketpair(AF_INET) DENIED", exc.errno)
for name in ("AF_UNIX", "AF_INET", "AF_INET6"):
    socket.socket(getattr(socket, name), socket.SOCK_STREAM).close()
    print(name, "CREATED")
a, b = socket.socketpair()
print("socketpair(AF_UNIX) CREATED")
