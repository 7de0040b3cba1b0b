# ruff: noqa
# HOSTILE: fork storm: every process keeps forking (os.fork in a loop); children do the same.
# RLIMIT_NPROC caps the count, the wall-clock kill must take all of them down.
import os, time

while True:
    try:
        os.fork()
    except OSError:
        time.sleep(0.05)
