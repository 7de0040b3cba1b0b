# ruff: noqa
# HOSTILE: exhaust file descriptors: open 100000 files (RLIMIT_NOFILE must stop it).
handles = [open(f"f{i}", "w") for i in range(100000)]
