"""The dev commands of ``vllm-dsa`` (demo, make-model, bench ...), found through the entry point."""
