# ruff: noqa
# HOSTILE: burn CPU forever (RLIMIT_CPU must stop it).
while True:
    pass
