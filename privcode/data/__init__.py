"""Private data: the record schema, JSONL/Parquet IO, and the demo corpus."""
