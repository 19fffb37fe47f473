"""Sub-commands of ``vllm-dsa`` (one module each)."""
