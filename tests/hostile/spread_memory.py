# ruff: noqa
# HOSTILE: hold 480 MB where no per-process limit sees the total (memfd being denied): the
# run's /dev/shm (tmpfs) filled as far as it goes, and 12 children of 40 MB each, every one
# under RLIMIT_AS at memory_mb=64. Without a cgroup this is "ok" and the pod's OOM killer
# picks a victim; the run's cgroup must stop it (status "memory").
import os, time

chunk, shm = b"x" * (1 << 20), 0
for i in range(40):  # files under RLIMIT_FSIZE, until the tmpfs is full
    try:
        with open(f"/dev/shm/fill-{i}", "wb") as fh:
            for _ in range(8):
                fh.write(chunk)
                shm += 1
    except OSError:
        break
kids = []
for _ in range(12):
    pid = os.fork()
    if pid == 0:
        b = bytearray(40 << 20)
        for j in range(0, len(b), 4096):
            b[j] = 1
        time.sleep(3)
        os._exit(0)
    kids.append(pid)
codes = [os.waitstatus_to_exitcode(os.waitpid(k, 0)[1]) for k in kids]
if codes == [0] * 12:
    print("HELD", shm + 12 * 40, "MB")
print("children", codes)
