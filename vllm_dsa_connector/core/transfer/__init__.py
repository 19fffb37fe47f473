"""How a request's KV bytes move from P's pools into D's: the routed sender (direct, bounce, ipc) and the layer
push, notices, the one receiver, the gate; ``nixl/`` wraps NIXL, ``copy/`` holds the local copies. Imports nothing
from vLLM; a byte's way through these modules is in docs/architecture.md ("A byte's way").
"""
