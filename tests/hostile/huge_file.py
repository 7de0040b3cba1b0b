# ruff: noqa
# HOSTILE: fill the disk: write a 1 GB file in the work dir (RLIMIT_FSIZE must stop it).
chunk = b"\0" * (1 << 20)
with open("big.bin", "wb") as fh:
    for _ in range(1024):
        fh.write(chunk)
        fh.flush()
