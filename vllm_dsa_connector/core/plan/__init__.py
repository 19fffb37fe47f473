"""What moves: page tables of DSA/MLA KV caches (``pages``, ``rules``), byte runs (``runs``), and the plan over
them (``token_map``, ``pairing``, ``segments``, ``peer_plan``): every byte of D's pools written exactly once.
Imports nothing from vLLM (the builders from vLLM's specs are :mod:`vllm_dsa_connector.connector.page_tables`).
Address of block ``b`` of an entry: ``pool.base_ptr + entry.offset + b * pool.block_stride``.
"""
