# ruff: noqa
# HOSTILE: memory bomb: allocate 10 GB at once, then keep growing a list of 100 MB blocks.
blocks = [bytearray(10 * 1024**3)]
while True:
    blocks.append(bytearray(100 * 1024**2))
