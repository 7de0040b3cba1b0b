# ruff: noqa
# HOSTILE: survive the kill at the deadline: double-fork a grandchild into its own session
# that ignores SIGTERM/SIGHUP/SIGINT and keeps forking replacements, while the snippet itself
# loops until the wall-clock kill. killpg of the snippet's group would not reach it; the end
# of the run's pid namespace (and the cgroup) must.
import os, signal, time

if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        while True:
            if os.fork() == 0:
                time.sleep(0.5)
                os._exit(0)
            time.sleep(0.2)
            try:
                os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pass
    os._exit(0)
print("forked", flush=True)
while True:
    time.sleep(0.1)
