# ruff: noqa
# HOSTILE: ignore SIGTERM, SIGINT, SIGHUP (and SIGXCPU) and sleep: only SIGKILL ends it.
import signal, time

for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU):
    signal.signal(sig, signal.SIG_IGN)
time.sleep(3600)
