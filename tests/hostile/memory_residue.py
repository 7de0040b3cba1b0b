# ruff: noqa
# HOSTILE: look for what earlier runs left in memory: scan every readable mapping of this
# process (/proc/self/maps + /proc/self/mem) for markers PRIVCODE-<KIND>-<32 hex>; prints
# whether its own marker (its stdin) was found, then every other one. A run forked from a
# process that held earlier requests (code, stdin) or outputs would find theirs.
import re, sys

own = sys.stdin.read().strip()
pattern = re.compile(rb"PRIVCODE-[A-Z]+-[0-9a-f]{32}")
found = set()
with open("/proc/self/maps") as fh:
    maps = fh.read().splitlines()
with open("/proc/self/mem", "rb", buffering=0) as mem:
    for line in maps:
        span, perms = line.split()[:2]
        if not perms.startswith("r"):
            continue
        pos, end = (int(x, 16) for x in span.split("-"))
        while pos < end:
            try:
                mem.seek(pos)
                chunk = mem.read(min(1 << 20, end - pos))
            except (OSError, ValueError, OverflowError):
                break
            found.update(m.group().decode() for m in pattern.finditer(chunk))
            pos += max(1, len(chunk) - 64)  # overlap: a marker across two chunks
print(own in found, sorted(found - {own}))
