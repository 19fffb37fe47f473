"""The engine-free core: plan/, handoff/, transfer/. Nothing here imports vLLM (tests/test_core_isolation.py)."""
