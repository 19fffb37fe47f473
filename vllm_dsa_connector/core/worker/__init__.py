"""A worker's two sides, engine-free: :mod:`.sending` (P: push jobs become posts, polled until done; failure
notices) and :mod:`.receiving` (D: the transport's one receiver with the connector's notices), beside
:mod:`.counters` (what they count), :mod:`.pool_bytes` (CRC32 of byte runs, pool views) and :mod:`.peer_setup` (the
one-time peer set-up thread). An adapter's worker (:mod:`vllm_dsa_connector.connector.worker`) owns one of each side
and hands them its NIXL engine, lock, counters and records. Imports nothing from vLLM.
"""
