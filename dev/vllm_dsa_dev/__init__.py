"""The workshop of vllm-dsa-connector, not in the wheel: harness, benches, tiny models, test assets."""
