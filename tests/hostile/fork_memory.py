# ruff: noqa
# HOSTILE: many processes each under the per-process memory limit, together far above it:
# 8 children touching 150 MB each (1.2 GB). The run's cgroup must stop them (status
# "memory"), not the node.
import os, time

kids = []
for _ in range(8):
    pid = os.fork()
    if pid == 0:
        b = bytearray(150 << 20)
        for j in range(0, len(b), 4096):
            b[j] = 1
        time.sleep(2)
        os._exit(0)
    kids.append(pid)
codes = [os.waitstatus_to_exitcode(os.waitpid(k, 0)[1]) for k in kids]
print("children", codes)
