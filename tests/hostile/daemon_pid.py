# ruff: noqa
# HOSTILE: leave a daemon behind (fork, setsid, fork, stdio closed) that sleeps for a minute
# and says its pid first; the run itself exits 0 at once. In rlimits-only (no pid namespace)
# the test looks the pid up: the daemon must be gone once the verdict is back.
import os, time

r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(w, str(os.getpid()).encode())
        for fd in (0, 1, 2, r, w):
            os.close(fd)
        time.sleep(60)
    os._exit(0)
os.close(w)
os.wait()
print("daemon", os.read(r, 32).decode())
