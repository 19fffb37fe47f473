"""Tokenizer benches, workloads, tiny models and test assets (GPT-2 ranks)."""
