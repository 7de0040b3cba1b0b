# ruff: noqa
# HOSTILE: print gigabytes (stdout and stderr) without end.
import sys

line = "A" * 1000 + "\n"
while True:
    sys.stdout.write(line)
    sys.stderr.write(line)
