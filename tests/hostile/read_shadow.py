# ruff: noqa
# HOSTILE: read password hashes from /etc/shadow (root-only).
print(open("/etc/shadow").read())
