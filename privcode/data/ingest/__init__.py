"""Ingest a company's repositories and instruction data as the private corpus."""
