"""Stage I training: the DP-SGD train loop on Ray Train and the per-record losses of each method."""
