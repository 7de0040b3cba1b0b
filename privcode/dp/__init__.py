"""Differential privacy core: accounting (pure), the budget ledger (a Ray actor), DP-SGD."""
