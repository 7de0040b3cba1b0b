# ruff: noqa
# HOSTILE: read private data on the host: the repository, root's home, a file the test names
# on stdin as JSON {"path": ...} (e.g. a private corpus) and print them. Must not be readable.
import json, sys

path = json.loads(sys.stdin.read() or "{}").get("path", "/work/main/README.md")
found = []
for p in (path, "/work/main/README.md", "/root/.bash_history", "/root/.ssh/id_rsa"):
    try:
        found.append((p, open(p).read()[:100]))
    except OSError as exc:
        print(p, "DENIED", type(exc).__name__)
print("READ", found)
