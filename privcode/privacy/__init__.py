"""The privacy store: per-record DP history keyed by what trains, PAC curator charges,
one writer (the ledger), and one admission. The DP maths stays in :mod:`privcode.dp`."""
