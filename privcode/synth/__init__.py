"""Stage II: synthesis from the released DP artifact (sandbox, extraction, filters, Ray Data pipeline)."""
