"""Premium model: non-DP LoRA fine-tuning on the Stage II synthetic data (post-processing)."""
